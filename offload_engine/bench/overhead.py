"""Engine overhead with an instant handler: jobs/s and submit->result latency.

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

The handler completes each job inside ``launch``, so what is measured is the
engine: routing, queues, result delivery and the cross-thread wake-ups.
``benchmarks/engine_overhead.py`` and ``offload-engine bench`` run these.
"""

from __future__ import annotations

import importlib.util
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from offload_engine.bench import percentile
from offload_engine.engine.handler import LaunchedJob, TransferHandler
from offload_engine.engine.manager import OffloadingQueueManager
from offload_engine.engine.sync import SyncOffloadingEngine
from offload_engine.errors import InvalidTransferError
from offload_engine.vocabulary import Medium, TransferResult, TransferSpec, cpu_blocks, gpu_blocks

SPEC = TransferSpec(gpu_blocks([1, 2, 3, 4]), cpu_blocks([5, 6, 7, 8]))
WARM_UP = 200


class InstantHandler(TransferHandler[int]):
    """GPU->CPU jobs that succeed inside ``launch``, moving nothing: what is left is the engine."""

    src = Medium.GPU
    dst = Medium.CPU

    def prepare(self, spec: TransferSpec) -> int:
        if len(spec.src) != len(spec.dst):
            raise InvalidTransferError(f"{len(spec.src)} source blocks, {len(spec.dst)} targets")
        return len(spec.src)

    def launch(self, job: LaunchedJob[int]) -> None:
        job.succeed(job.prepared)


async def async_throughput(jobs: int) -> float:
    async with OffloadingQueueManager([InstantHandler()], capacity=4096) as mgr:
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
    async with OffloadingQueueManager([InstantHandler()]) as mgr:
        for _ in range(WARM_UP):
            await mgr.wait([mgr.submit_nowait(SPEC)])
        for _ in range(samples):
            t0 = time.perf_counter()
            j = mgr.submit_nowait(SPEC)
            await mgr.wait([j])
            out.append(time.perf_counter() - t0)
    return out


def sync_throughput(jobs: int) -> float:
    with SyncOffloadingEngine([InstantHandler()], capacity=4096) as engine:
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
    with SyncOffloadingEngine([InstantHandler()]) as engine:
        for _ in range(WARM_UP):
            engine.wait([engine.submit_nowait(SPEC)])
        for _ in range(samples):
            t0 = time.perf_counter()
            j = engine.submit_nowait(SPEC)
            engine.wait([j])
            out.append(time.perf_counter() - t0)
    return out


@dataclass(frozen=True)
class OverheadResult:
    """One host's throughput and low-load latency."""

    host: str  # "async API (asyncio)", "async API (trio)", "sync facade"
    key: str  # "async_asyncio", "async_trio", "sync"
    jobs_per_s: float
    p50_us: float
    p99_us: float

    def as_dict(self) -> dict[str, float]:
        return {"jobs_per_s": self.jobs_per_s, "p50_us": self.p50_us, "p99_us": self.p99_us}


def backends() -> tuple[str, ...]:
    """The event loops to measure: asyncio, and trio when it is installed."""
    return ("asyncio", "trio") if importlib.util.find_spec("trio") else ("asyncio",)


def _result(host: str, key: str, rate: float, lat: list[float]) -> OverheadResult:
    return OverheadResult(host, key, rate, percentile(lat, 50) * 1e6, percentile(lat, 99) * 1e6)


def run_overhead(
    jobs: int, latency_samples: int, *, tick: Callable[[str], None] = lambda _what: None
) -> list[OverheadResult]:
    """Every case, async hosts first (one per backend), then the sync facade."""
    out = []
    for backend in backends():
        rate = anyio.run(async_throughput, jobs, backend=backend)
        lat = anyio.run(async_latency, latency_samples, backend=backend)
        out.append(_result(f"async API ({backend})", f"async_{backend}", rate, lat))
        tick(f"engine overhead, async API ({backend}): {rate:,.0f} jobs/s")
    rate = sync_throughput(jobs)
    lat = sync_latency(latency_samples)
    out.append(_result("sync facade", "sync", rate, lat))
    tick(f"engine overhead, sync facade: {rate:,.0f} jobs/s")
    return out
