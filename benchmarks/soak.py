"""Soak: minutes of mixed load through the sync facade and the async API; nothing may creep.

    python benchmarks/soak.py [--minutes 4] [--interval 15] [--json out.json]

Two engines run side by side in one process:

* a :class:`~offload_engine.SyncOffloadingEngine` (asyncio loop thread) with
  the host handler (CPU <-> CPU, real copies), the device handler pair on the
  fake runtime (NPU <-> CPU, stream threads and ``memmove``) and a faulty
  route (GPU -> CPU). Two threads run store/load round trips with checksums
  (host and device), one thread submits batches of faulty jobs and waits for
  them;
* an :class:`~offload_engine.OffloadingQueueManager` on trio (in an anyio
  blocking portal) with two faulty routes: two producer tasks ``await submit``,
  one task submits and ``await wait``\\s its own jobs, and a consumer task
  collects everything else with ``async for`` (it competes with the waiter).

Every interval the script samples jobs finished per source, RSS, the memory
blocks the interpreter holds (``sys.getallocatedblocks``), thread counts (all, and the engine's
own), the trio loop's task count, open file descriptors, the jobs still open
in the ledgers, and the process's CPU time and the machine's load average: on
a shared machine, jobs per CPU-second tells the engine slowing down from the
process being starved. At the end it checks that, after the first (warm-up)
interval, thread, task and descriptor counts never changed, RSS stayed within
max(32 MiB, 10 %) and the block count within 10 % (+10,000) of their first
samples; that no result was lost, duplicated or impossible; and that no block
was corrupted. Exit status 1 otherwise.

The fake runtime records every batched copy for tests (``batch_calls``); the
soak clears that record as it goes, since it is test instrumentation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import anyio
import anyio.from_thread
import torch

from offload_engine import (
    CacheBlocks,
    HostCopyHandler,
    HostTier,
    InvalidTransferError,
    KVLayout,
    Medium,
    OffloadingQueueManager,
    SyncOffloadingEngine,
    TransferSpec,
    UnknownJobError,
    cpu_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.host.layout import byte_view
from offload_engine.testing import (
    FakeRuntime,
    Fault,
    FaultPlan,
    FaultyHandler,
    Ledger,
    build_layout,
    cache_block_bytes,
    engine_threads,
)

MIX = {
    Fault.OK: 75,
    Fault.INSTANT: 10,
    Fault.FAIL: 4,
    Fault.RAISE: 3,
    Fault.LAUNCH_RAISES: 3,
    Fault.BAD_REPORT: 2,
    Fault.LOST: 1,
    Fault.REFUSED: 2,
}


@dataclass
class Counters:
    """Jobs finished per source; written by one thread each, read by the sampler."""

    jobs: Counter[str] = field(default_factory=Counter)
    corrupt: int = 0
    checked: int = 0
    errors: list[str] = field(default_factory=list)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def digest(layout: KVLayout, block: int) -> bytes:
    return hashlib.blake2b(cache_block_bytes(layout, block), digest_size=16).digest()


def scribble(layout: KVLayout, blocks: list[int], gen: torch.Generator) -> None:
    for regions in layout.groups:
        for r in regions:
            base = byte_view(layout.tensors[r.tensor])
            for b in blocks:
                start = r.offset + b * r.stride
                base[start : start + r.size].copy_(
                    torch.randint(0, 256, (r.size,), dtype=torch.uint8, generator=gen)
                )


def round_trips(
    name: str,
    engine: SyncOffloadingEngine,
    layout: KVLayout,
    medium: Medium,
    tier_blocks: int,
    stop: threading.Event,
    counters: Counters,
    *,
    per_job: int = 4,
    depth: int = 4,
    after_each: Callable[[], None] = lambda: None,
) -> None:
    """Store fresh random blocks, load them elsewhere, compare checksums; repeat."""
    rng = random.Random(name)
    gen = torch.Generator().manual_seed(len(name))
    half = layout.num_blocks // 2
    sources, targets = list(range(half)), list(range(half, layout.num_blocks))
    tiers = list(range(tier_blocks))
    try:
        while not stop.is_set():
            rng.shuffle(sources)
            rng.shuffle(targets)
            rng.shuffle(tiers)
            jobs = [
                (
                    sources[d * per_job : (d + 1) * per_job],
                    targets[d * per_job : (d + 1) * per_job],
                    tiers[d * per_job : (d + 1) * per_job],
                )
                for d in range(depth)
            ]
            scribble(layout, [b for src, _, _ in jobs for b in src], gen)
            want = [[digest(layout, b) for b in src] for src, _, _ in jobs]
            stores = [
                engine.submit(TransferSpec(CacheBlocks(medium, src), cpu_blocks(t)))  # type: ignore[arg-type]
                for src, _, t in jobs
            ]
            for r in engine.wait(stores, timeout=60):
                if not r.success:
                    counters.errors.append(f"{name}: store failed: {r.error!r}")
            loads = [
                engine.submit(TransferSpec(cpu_blocks(t), CacheBlocks(medium, dst)))  # type: ignore[arg-type]
                for _, dst, t in jobs
            ]
            for r in engine.wait(loads, timeout=60):
                if not r.success:
                    counters.errors.append(f"{name}: load failed: {r.error!r}")
            for (_, dst, _), w in zip(jobs, want, strict=True):
                for b, expect in zip(dst, w, strict=True):
                    counters.checked += 1
                    if digest(layout, b) != expect:
                        counters.corrupt += 1
            counters.jobs[name] += 2 * depth
            after_each()
    except BaseException as exc:  # noqa: BLE001 - reported in the summary
        counters.errors.append(f"{name}: {exc!r}")


def faulty_batches(
    engine: SyncOffloadingEngine,
    plan: FaultPlan,
    ledger: Ledger,
    stop: threading.Event,
    counters: Counters,
) -> None:
    """Batches of jobs with injected faults; waits for each batch (claiming its results)."""
    rng = random.Random(7)
    faults, weights = list(MIX), list(MIX.values())
    try:
        while not stop.is_set():
            ids = []
            for _ in range(64):
                fault = rng.choices(faults, weights)[0]
                timeout = 0.01 if fault is Fault.LOST else None
                try:
                    jid = engine.submit(plan.spec(fault), timeout=timeout)
                except InvalidTransferError:
                    continue  # REFUSED: refused at submit, as it should be
                ledger.accepted(jid, fault, timed=timeout is not None, nbytes=plan.nbytes)
                ids.append(jid)
            ledger.collected(engine.wait(ids, timeout=60))
            counters.jobs["sync-faulty"] += len(ids)
    except BaseException as exc:  # noqa: BLE001
        counters.errors.append(f"sync-faulty: {exc!r}")


# --------------------------------------------------------------------------- async side


def count_trio_tasks() -> int:
    import trio

    def walk(task: Any) -> int:
        return 1 + sum(walk(c) for n in task.child_nurseries for c in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


class AsyncSide:
    """A manager on trio in a blocking portal, with producer, waiter and consumer tasks."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.ledger = Ledger()
        self.plans = [FaultPlan(Medium.GPU, Medium.CPU), FaultPlan(Medium.CPU, Medium.GPU)]
        self.handlers = [
            FaultyHandler(self.plans[0], workers=2, ordered=True, delay=0.0002),
            FaultyHandler(self.plans[1], workers=1, ordered=False),
        ]
        self._portal_cm = anyio.from_thread.start_blocking_portal("trio")
        self.portal = self._portal_cm.__enter__()
        self.mgr = OffloadingQueueManager(self.handlers, capacity=128)
        self._mgr_cm = self.portal.wrap_async_context_manager(self.mgr)
        self._mgr_cm.__enter__()
        self.stop = self.portal.call(anyio.Event)
        self.futures = [
            self.portal.start_task_soon(self.producer, 1),
            self.portal.start_task_soon(self.producer, 2),
            self.portal.start_task_soon(self.waiter),
            self.portal.start_task_soon(self.consumer),
        ]

    async def producer(self, seed: int) -> None:
        rng = random.Random(seed)
        faults, weights = list(MIX), list(MIX.values())
        while not self.stop.is_set():
            plan = rng.choice(self.plans)
            fault = rng.choices(faults, weights)[0]
            timeout = 0.01 if fault is Fault.LOST else None
            try:
                jid = await self.mgr.submit(plan.spec(fault), timeout=timeout)
            except InvalidTransferError:
                continue
            self.ledger.accepted(jid, fault, timed=timeout is not None, nbytes=plan.nbytes)
            self.counters.jobs["async-submit"] += 1

    async def waiter(self) -> None:
        plan = self.plans[0]
        while not self.stop.is_set():
            ids = [await self.mgr.submit(plan.spec(Fault.OK)) for _ in range(16)]
            for jid in ids:
                self.ledger.accepted(jid, Fault.OK, nbytes=plan.nbytes)
            try:
                self.ledger.collected(await self.mgr.wait(ids, timeout=60))
            except UnknownJobError:
                pass  # the async-for consumer took one of them first; it records it
            self.counters.jobs["async-wait"] += len(ids)

    async def consumer(self) -> None:
        async for result in self.mgr:
            self.ledger.collected([result])

    def tasks(self) -> int:
        return int(self.portal.call(count_trio_tasks))

    def close(self) -> None:
        self.portal.call(self.stop.set)
        for f in self.futures[:3]:
            f.result(timeout=60)
        self.ledger.collected(self.portal.call(self.mgr.aclose))  # ends the consumer too
        self.futures[3].result(timeout=60)
        self._mgr_cm.__exit__(None, None, None)
        self._portal_cm.__exit__(None, None, None)


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--json", help="write the samples and summary to this file")
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="trace Python allocations (slow) and print where memory grew after warm-up",
    )
    args = parser.parse_args()
    if args.tracemalloc:
        tracemalloc.start(8)
    snapshot: tracemalloc.Snapshot | None = None

    counters = Counters()
    # the sync engine: host copies, the device handler on the fake runtime, a faulty route
    host_layout = build_layout("flash-attention", host_empty, num_blocks=64, num_layers=4)
    host_tier = HostTier.for_layout(host_layout, 32)
    runtime = FakeRuntime(Medium.NPU)
    dev_layout = build_layout("flashinfer", runtime.empty, num_blocks=64, num_layers=4)
    dev_tier = pinned_host_tier(runtime, dev_layout, 32)
    store, load = make_device_handlers(
        runtime,
        dev_layout,
        dev_tier,
        DeviceHandlerConfig(strategy=CopyStrategy.STAGED, staging_bytes=12 * dev_layout.slot_bytes),
    )
    faulty_plan = FaultPlan(Medium.GPU, Medium.CPU)
    sync_ledger = Ledger()
    engine = SyncOffloadingEngine(
        [
            HostCopyHandler(host_layout, host_tier, workers=2),
            store,
            load,
            FaultyHandler(faulty_plan, workers=2, delay=0.0002),
        ],
        capacity=256,
    )
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=round_trips,
            args=("sync-host", engine, host_layout, Medium.CPU, 32, stop, counters),
            name="soak-host",
        ),
        threading.Thread(
            target=round_trips,
            args=("sync-device", engine, dev_layout, Medium.NPU, 32, stop, counters),
            kwargs={"after_each": runtime.batch_calls.clear},
            name="soak-device",
        ),
        threading.Thread(
            target=faulty_batches,
            args=(engine, faulty_plan, sync_ledger, stop, counters),
            name="soak-faulty",
        ),
    ]
    side = AsyncSide(counters)
    for t in threads:
        t.start()

    samples: list[dict[str, Any]] = []
    sources = ["sync-host", "sync-device", "sync-faulty", "async-submit", "async-wait"]
    print(
        f"soak, {date.today().isoformat()}, {platform.node()} {platform.machine()}, "
        f"Python {platform.python_version()}, {args.minutes} min, every {args.interval} s"
    )
    header = (
        f"{'t (s)':>6} "
        + " ".join(f"{s:>12}" for s in sources)
        + f" {'RSS MiB':>8} {'blocks k':>8} {'threads':>7} {'engine':>6} {'tasks':>5} {'fds':>4}"
        + f" {'open':>5} {'cpu %':>5} {'load':>5} {'jobs/cpu-s':>10}"
    )
    print(
        "jobs/s per source; blocks: Python memory blocks held; threads: all / the engine's; "
        "tasks: trio loop; open: jobs open in the ledgers; cpu: this process; load: 1-min"
    )
    print(header)
    t0 = time.monotonic()
    last = Counter(counters.jobs)
    last_t = t0
    cpu0 = os.times()
    last_cpu = cpu0.user + cpu0.system
    end = t0 + args.minutes * 60
    while True:
        now = time.monotonic()
        if now >= end:
            break
        stop.wait(min(args.interval, end - now))  # the sampler's own pace, not a result wait
        now = time.monotonic()
        jobs = Counter(counters.jobs)
        rates = {s: (jobs[s] - last[s]) / (now - last_t) for s in sources}
        done = sum(jobs[s] - last[s] for s in sources)
        times = os.times()
        cpu = times.user + times.system
        cpu_pct = 100 * (cpu - last_cpu) / (now - last_t)
        per_cpu_s = done / max(cpu - last_cpu, 1e-9)
        last, last_t, last_cpu = jobs, now, cpu
        sample = {
            "t": round(now - t0, 1),
            "jobs_per_s": {s: round(v, 1) for s, v in rates.items()},
            "rss_mib": round(rss_mib(), 1),
            # memory blocks the interpreter holds (not gc.get_objects(): its references
            # to half-built tuples in other threads break their construction)
            "objects": sys.getallocatedblocks(),
            "cpu_pct": round(cpu_pct),
            "load1": round(os.getloadavg()[0], 2),
            "jobs_per_cpu_s": round(per_cpu_s),
            "threads": threading.active_count(),
            "engine_threads": len(engine_threads()),
            "tasks": side.tasks(),
            "fds": open_fds(),
            "open_jobs": sync_ledger.open_count + side.ledger.open_count,
        }
        samples.append(sample)
        if args.tracemalloc and snapshot is None:
            snapshot = tracemalloc.take_snapshot()
        print(
            f"{sample['t']:>6.0f} "
            + " ".join(f"{rates[s]:>12,.0f}" for s in sources)
            + f" {sample['rss_mib']:>8.1f} {sample['objects'] / 1000:>8.0f}"
            f" {sample['threads']:>7} {sample['engine_threads']:>6}"
            f" {sample['tasks']:>5} {sample['fds']:>4} {sample['open_jobs']:>5}"
            f" {sample['cpu_pct']:>5} {sample['load1']:>5.2f} {sample['jobs_per_cpu_s']:>10,}",
            flush=True,
        )

    if snapshot is not None:
        grown = tracemalloc.take_snapshot().compare_to(snapshot, "traceback")
        print("\nallocations that grew after warm-up (tracemalloc):")
        for stat in grown[:12]:
            print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8,} blocks")
            for line in stat.traceback.format()[-8:]:
                print("      " + line)
    stop.set()
    for t in threads:
        t.join(60)
    sync_ledger.collected(engine.close(timeout=5))
    side.close()
    dev_tier.release()
    runtime.close()
    wall = time.monotonic() - t0

    steady = samples[1:] or samples
    rss = [s["rss_mib"] for s in steady]
    threads_seen = {s["threads"] for s in steady}
    engine_seen = {s["engine_threads"] for s in steady}
    tasks_seen = {s["tasks"] for s in steady}
    fds_seen = {s["fds"] for s in steady}
    rss_growth = rss[-1] - rss[0]
    objs = [s["objects"] for s in steady]
    per_cpu = [s["jobs_per_cpu_s"] for s in steady]
    reports = {"sync": sync_ledger.report(), "async": side.ledger.report()}
    totals = Counter(counters.jobs)
    problems = list(counters.errors)
    for name, rep in reports.items():
        if not rep.clean:
            problems.append(f"{name} ledger: {rep}")
    if counters.corrupt:
        problems.append(f"{counters.corrupt} corrupt blocks")
    if len(threads_seen) > 1 or len(engine_seen) > 1:
        problems.append(f"thread counts changed: {sorted(threads_seen)} / {sorted(engine_seen)}")
    if len(tasks_seen) > 1:
        problems.append(f"task counts changed: {sorted(tasks_seen)}")
    if rss_growth > max(32.0, 0.1 * rss[0]):
        problems.append(f"RSS grew by {rss_growth:.1f} MiB")
    if objs[-1] > 1.1 * objs[0] + 10_000:
        problems.append(f"Python memory blocks grew from {objs[0]:,} to {objs[-1]:,}")
    if len(fds_seen) > 1:
        problems.append(f"open descriptors changed: {sorted(fds_seen)}")
    leftover_threads = [t.name for t in engine_threads()]
    if leftover_threads:
        problems.append(f"engine threads left after close: {leftover_threads}")
    rate_rows = {
        s: {
            "min": min(x["jobs_per_s"][s] for x in steady),
            "median": statistics.median(x["jobs_per_s"][s] for x in steady),
            "max": max(x["jobs_per_s"][s] for x in steady),
        }
        for s in sources
    }
    summary = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "wall_s": round(wall, 1),
        "jobs_total": dict(totals),
        "jobs_per_s_after_warmup": rate_rows,
        "rss_mib": {"first": rss[0], "last": rss[-1], "min": min(rss), "max": max(rss)},
        "python_blocks": {"first": objs[0], "last": objs[-1], "min": min(objs), "max": max(objs)},
        "jobs_per_cpu_s": {
            "min": min(per_cpu),
            "median": statistics.median(per_cpu),
            "max": max(per_cpu),
            "first_half_median": statistics.median(per_cpu[: max(1, len(per_cpu) // 2)]),
            "second_half_median": statistics.median(per_cpu[len(per_cpu) // 2 :]),
        },
        "load1": [s["load1"] for s in samples],
        "threads": sorted(threads_seen),
        "engine_threads": sorted(engine_seen),
        "trio_tasks": sorted(tasks_seen),
        "fds": sorted(fds_seen),
        "blocks_checked": counters.checked,
        "corrupt_blocks": counters.corrupt,
        "ledgers": {
            name: {
                "jobs": rep.jobs,
                "results": rep.results,
                "lost": rep.lost,
                "duplicates": rep.duplicates,
                "impossible": rep.wrong,
                "outcomes": rep.outcomes,
            }
            for name, rep in reports.items()
        },
        "problems": problems,
        "samples": samples,
    }
    print()
    print(f"jobs finished: {sum(totals.values()):,} in {wall:.0f} s ({dict(totals)})")
    for s, row in rate_rows.items():
        print(
            f"  {s:<13} jobs/s after warm-up: min {row['min']:,.0f}  median "
            f"{row['median']:,.0f}  max {row['max']:,.0f}"
        )
    print(
        f"RSS after warm-up: {rss[0]:.1f} -> {rss[-1]:.1f} MiB (min {min(rss):.1f}, max "
        f"{max(rss):.1f}); threads {sorted(threads_seen)}; engine threads {sorted(engine_seen)}; "
        f"trio tasks {sorted(tasks_seen)}; fds {sorted(fds_seen)}"
    )
    print(
        f"Python memory blocks after warm-up: {objs[0]:,} -> {objs[-1]:,} (min {min(objs):,}, "
        f"max {max(objs):,})"
    )
    pc = summary["jobs_per_cpu_s"]
    print(
        f"jobs per CPU-second after warm-up: min {pc['min']:,}  median {pc['median']:,.0f}  "
        f"max {pc['max']:,}; first-half median {pc['first_half_median']:,.0f}, second-half "
        f"median {pc['second_half_median']:,.0f}"
    )
    print(f"blocks checked {counters.checked:,}, corrupt {counters.corrupt}")
    for name, rep in reports.items():
        print(
            f"{name} ledger: jobs {rep.jobs:,}, results {rep.results:,}, lost {rep.lost}, "
            f"duplicates {rep.duplicates}, impossible {rep.wrong}, outcomes {rep.outcomes}"
        )
    for p in problems[:20]:
        print("PROBLEM:", p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    print("PASS" if not problems else "FAIL")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
