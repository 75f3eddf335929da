"""Engine overhead with an instant fake handler: jobs/s and submit->result latency.

    python benchmarks/engine_overhead.py [--jobs 100000] [--latency-samples 3000] [--json out.json]

Each case runs in one process, side by side, so their ratios are comparable:

* async throughput: a producer task ``await submit(...)``s N jobs while a
  consumer task reads results with ``async for``; wall time first submit ->
  last result (asyncio and trio);
* async latency at low load: one job at a time, ``submit_nowait`` then
  ``await wait([job])``; p50/p99 of the wall time around both calls;
* sync throughput: the calling thread submits N jobs (``submit``, which waits
  only while the queue is full) and drains them with ``get_finished``; the
  engine's loop runs in its own thread;
* sync latency at low load: ``submit_nowait`` then ``wait([job])``.

The fake completes each job inside ``launch``, so what is measured is the
engine: routing, queues, result delivery and the cross-thread wake-ups.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import deque
from datetime import date

import anyio

from offload_engine import (
    OffloadingQueueManager,
    SyncOffloadingEngine,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.testing import FakeHandler

SPEC = TransferSpec(gpu_blocks([1, 2, 3, 4]), cpu_blocks([5, 6, 7, 8]))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def async_throughput(jobs: int) -> float:
    async with OffloadingQueueManager([FakeHandler()], capacity=4096) as mgr:
        done = anyio.Event()
        t0 = time.perf_counter()

        async def consume() -> None:
            n = 0
            async for _ in mgr:
                n += 1
                if n == jobs:
                    break
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for _ in range(jobs):
                await mgr.submit(SPEC)
            await done.wait()
        return jobs / (time.perf_counter() - t0)


async def async_latency(samples: int) -> list[float]:
    out = []
    async with OffloadingQueueManager([FakeHandler()]) as mgr:
        for _ in range(200):  # warm-up
            await mgr.wait([mgr.submit_nowait(SPEC)])
        for _ in range(samples):
            t0 = time.perf_counter()
            j = mgr.submit_nowait(SPEC)
            await mgr.wait([j])
            out.append(time.perf_counter() - t0)
    return out


def sync_throughput(jobs: int) -> float:
    with SyncOffloadingEngine([FakeHandler()], capacity=4096) as engine:
        t0 = time.perf_counter()
        order: deque[int] = deque()
        collected: set[int] = set()

        def collect(results: list[TransferResult]) -> None:
            collected.update(r.job_id for r in results)

        for i in range(jobs):
            order.append(engine.submit(SPEC))
            if i % 256 == 255:
                collect(engine.get_finished())
        while len(collected) < jobs:
            finished = engine.get_finished()
            if not finished:
                while order[0] in collected:
                    order.popleft()
                finished = engine.wait([order[0]])  # block on the oldest outstanding job
            collect(finished)
        return jobs / (time.perf_counter() - t0)


def sync_latency(samples: int) -> list[float]:
    out = []
    with SyncOffloadingEngine([FakeHandler()]) as engine:
        for _ in range(200):
            engine.wait([engine.submit_nowait(SPEC)])
        for _ in range(samples):
            t0 = time.perf_counter()
            j = engine.submit_nowait(SPEC)
            engine.wait([j])
            out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--latency-samples", type=int, default=3000)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    rows: list[tuple[str, str, str]] = []
    report: dict[str, object] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "python": sys.version.split()[0],
        "jobs": args.jobs,
    }
    for backend in ("asyncio", "trio"):
        rate = anyio.run(async_throughput, args.jobs, backend=backend)
        lat = anyio.run(async_latency, args.latency_samples, backend=backend)
        p50, p99 = percentile(lat, 50) * 1e6, percentile(lat, 99) * 1e6
        rows.append((f"async API ({backend})", f"{rate:,.0f}", f"{p50:.0f} / {p99:.0f}"))
        report[f"async_{backend}"] = {"jobs_per_s": rate, "p50_us": p50, "p99_us": p99}
    rate = sync_throughput(args.jobs)
    lat = sync_latency(args.latency_samples)
    p50, p99 = percentile(lat, 50) * 1e6, percentile(lat, 99) * 1e6
    rows.append(("sync facade", f"{rate:,.0f}", f"{p50:.0f} / {p99:.0f}"))
    report["sync"] = {"jobs_per_s": rate, "p50_us": p50, "p99_us": p99}

    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"engine overhead, instant fake handler, {args.jobs:,} jobs, {report['date']}")
    print(f"{'host':<22} {'jobs/s':>12} {'p50 / p99 submit->result (us)':>32}")
    for name, rate_s, lat_s in rows:
        print(f"{name:<22} {rate_s:>12} {lat_s:>32}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
