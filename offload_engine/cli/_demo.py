"""``offload-engine demo``: a serving loop in miniature, through the sync facade."""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from offload_engine.bench import percentile
from offload_engine.bench.cuda import open_rig
from offload_engine.bench.rigs import Rig, RigShape
from offload_engine.cli._console import progress_bar
from offload_engine.engine.sync import SyncOffloadingEngine
from offload_engine.vocabulary import TransferResult

STEPS = 2000
QUICK_STEPS = 200
CACHE_BLOCKS = 1024
MAX_BLOCKS_PER_JOB = CACHE_BLOCKS // 32


class DemoTierBook:
    """What a scheduler knows about the tier: free blocks, readable stores, pins.

    Like a serving engine's offloading manager, it lets a load read only blocks
    whose store has completed, never evicts blocks a load is reading, and never
    aims two in-flight loads at one destination block.
    """

    def __init__(self, tier_blocks: int, cache_range: range) -> None:
        self.free: deque[int] = deque(range(tier_blocks))
        self.readable: deque[tuple[list[int], list[int]]] = deque()  # (tier ids, source ids)
        self.pins: dict[int, int] = {}
        self.dst_free: deque[int] = deque(cache_range)

    def take_free(self, n: int) -> list[int] | None:
        """``n`` tier blocks to store into, evicting the oldest unpinned stores.

        The newest readable store is never evicted: it is the next prefix hit, so a
        step always has a block to load once one store has completed. ``None`` when
        in-flight stores and pinned blocks hold too much of the tier.
        """
        for entry in list(self.readable)[:-1]:
            if len(self.free) >= n:
                break
            if not any(self.pins.get(t) for t in entry[0]):
                self.readable.remove(entry)
                self.free.extend(entry[0])
        if len(self.free) < n:
            return None
        return [self.free.popleft() for _ in range(n)]

    def store_done(self, tiers: list[int], sources: list[int], ok: bool) -> None:
        if ok:
            self.readable.append((tiers, sources))
        else:
            self.free.extend(tiers)

    def pick_hit(self, n: int) -> tuple[list[int], list[int], list[int]] | None:
        """The newest readable store as a prefix hit, pinned, and ``n`` free destinations;
        ``None`` before any store has completed, or while in-flight loads hold the
        destinations."""
        if not self.readable or len(self.dst_free) < n:
            return None
        tiers, sources = self.readable[-1]
        for t in tiers:
            self.pins[t] = self.pins.get(t, 0) + 1
        dsts = [self.dst_free.popleft() for _ in range(n)]
        return tiers, sources, dsts

    def load_done(self, tiers: list[int], dsts: list[int]) -> None:
        for t in tiers:
            self.pins[t] -= 1
        self.dst_free.extend(dsts)


@dataclass
class DirectionTally:
    """Results of one direction."""

    jobs: int = 0
    failed: int = 0
    bytes_moved: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def add(self, r: TransferResult) -> None:
        self.jobs += 1
        self.failed += not r.success
        self.bytes_moved += r.bytes_moved
        self.latencies_ms.append(r.latency * 1e3)


@dataclass
class DemoReport:
    """What one demo run measured and checked."""

    steps: int
    blocks_per_job: int
    block_bytes: int
    wall_s: float = 0.0
    caller_cpu_s: float = 0.0  # the stepping thread only
    process_cpu_s: float = 0.0  # every thread: the engine's loop and the copy threads too
    store: DirectionTally = field(default_factory=DirectionTally)
    load: DirectionTally = field(default_factory=DirectionTally)
    loads_checked: int = 0  # successful loads, each checked when its result arrived
    checked: int = 0  # loaded blocks compared bytewise with their sources
    corrupt: int = 0
    check_cpu_s: float = 0.0  # stepping-thread CPU spent comparing (left out of caller_cpu_s)

    @property
    def ok(self) -> bool:
        """No failed job, at least one loaded block checked, and none corrupt."""
        return self.store.failed + self.load.failed == 0 and self.checked > 0 and not self.corrupt


def check_demo_sizes(tier_blocks: int, cache_blocks: int, blocks_per_job: int) -> None:
    """Raise :class:`ValueError` unless every step can store and load ``blocks_per_job``.

    A step stores into free tier blocks while the newest completed store stays
    readable, and loads into the upper half of the cache: the tier must hold two
    jobs' blocks, the half cache one job's.
    """
    if blocks_per_job < 1:
        raise ValueError(f"blocks_per_job must be positive, got {blocks_per_job}")
    if tier_blocks < 2 * blocks_per_job or cache_blocks // 2 < blocks_per_job:
        raise ValueError(
            f"{blocks_per_job} blocks per job need a tier of at least {2 * blocks_per_job} "
            f"blocks and a cache of at least {2 * blocks_per_job} "
            f"(got {tier_blocks} and {cache_blocks})"
        )


def run_demo(
    rig: Rig,
    *,
    steps: int,
    blocks_per_job: int,
    max_outstanding: int,
    on_step: Callable[[], None] = lambda: None,
) -> DemoReport:
    """Each step stores ``blocks_per_job`` new blocks and loads a prefix hit of as many.

    Stores read KV-cache blocks from the lower half of the cache, loads write
    the upper half, so every load can be checked against its sources: when a
    load's result arrives, and before its destination blocks can be reused,
    each destination block is compared byte for byte with the block it was
    stored from. The comparisons' CPU time is counted apart from the step's.

    A step waits for the oldest job while more than ``max_outstanding`` are in
    flight, and also whenever its store or its load cannot start: when in-flight
    stores hold the free tier blocks, when no store has completed yet, or when
    in-flight loads hold the destination blocks. So every step stores and loads,
    whatever ``max_outstanding`` is; the tier and the cache bound how many jobs
    are really in flight.
    """
    per_job, nb = blocks_per_job, rig.layout.num_blocks
    check_demo_sizes(rig.tier.num_blocks, nb, per_job)
    half = nb // 2
    book = DemoTierBook(tier_blocks=rig.tier.num_blocks, cache_range=range(half, nb))
    rng = np.random.default_rng(0)
    pending: dict[int, tuple[str, list[int], list[int], list[int]]] = {}
    report = DemoReport(steps, per_job, rig.block_bytes)

    def settle(batch: list[TransferResult]) -> None:
        for r in batch:
            kind, tiers, sources, dsts = pending.pop(r.job_id)
            if kind == "store":
                report.store.add(r)
                book.store_done(tiers, sources, r.success)
            else:
                report.load.add(r)
                if r.success:
                    c = time.thread_time()
                    report.corrupt += rig.mismatched(dsts, sources)
                    report.checked += len(dsts)
                    report.loads_checked += 1
                    report.check_cpu_s += time.thread_time() - c
                book.load_done(tiers, dsts)

    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    with SyncOffloadingEngine(rig.handlers) as engine:

        def wait_oldest() -> bool:
            """Settle the oldest job in flight; False when none is."""
            if not pending:
                return False
            settle(engine.wait([next(iter(pending))]))
            return True

        for _ in range(steps):
            tiers = book.take_free(per_job)
            while tiers is None and wait_oldest():
                tiers = book.take_free(per_job)
            if tiers is not None:
                sources = rng.choice(half, size=per_job, replace=False).tolist()
                jid = engine.submit(rig.store(sources, tiers))
                pending[jid] = ("store", tiers, sources, [])
            hit = book.pick_hit(per_job)
            while hit is None and wait_oldest():
                hit = book.pick_hit(per_job)
            if hit is not None:
                tiers, sources, dsts = hit
                jid = engine.submit(rig.load(tiers, dsts))
                pending[jid] = ("load", tiers, sources, dsts)
            settle(engine.get_finished())
            while len(pending) > max_outstanding:
                # a real step computes for a while; here the oldest job sets the pace
                wait_oldest()
            on_step()
        settle(engine.wait(list(pending)))
    report.wall_s = time.perf_counter() - t0
    report.caller_cpu_s = time.thread_time() - c0 - report.check_cpu_s
    report.process_cpu_s = time.process_time() - p0 - report.check_cpu_s
    return report


def _row(name: str, t: DirectionTally, wall: float) -> tuple[str, ...]:
    if not t.jobs:
        return (name, "0", "0", "0.00", "-", "-", "-")
    return (
        name,
        f"{t.jobs:,}",
        str(t.failed),
        f"{t.bytes_moved / 1e9:.2f}",
        f"{t.bytes_moved / wall / 1e9:.2f}" if wall > 0 else "-",
        f"{percentile(t.latencies_ms, 50):.2f}",
        f"{percentile(t.latencies_ms, 99):.2f}",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    out = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    shape = RigShape(num_layers=args.layers, num_blocks=CACHE_BLOCKS, tier_blocks=CACHE_BLOCKS // 2)
    rig, notes = open_rig(args.device, shape, workers=args.workers)
    try:
        out.print(
            f"demo: {steps:,} steps, each storing {args.blocks_per_job} new blocks and loading "
            f"a prefix hit of {args.blocks_per_job}; {rig.block_bytes / 1024:.0f} KiB per block; "
            f"{rig.description}",
            markup=False,
        )
        for note in notes:
            out.print(f"note: {note}", markup=False)
        with progress_bar(err) as progress:
            task = progress.add_task("steps", total=steps)
            report = run_demo(
                rig,
                steps=steps,
                blocks_per_job=args.blocks_per_job,
                max_outstanding=args.max_outstanding,
                on_step=lambda: progress.advance(task),
            )
    finally:
        rig.close()

    wall = report.wall_s
    jobs = report.store.jobs + report.load.jobs
    table = Table(
        title=f"{rig.medium}: {steps:,} steps in {wall:.2f} s, {jobs / wall:,.0f} jobs/s",
        title_justify="left",
    )
    for col in ("direction", "jobs", "failed", "GB moved", "GB/s", "p50 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "direction" else "right")
    table.add_row(*_row("store", report.store, wall))
    table.add_row(*_row("load", report.load, wall))
    both = DirectionTally(
        report.store.jobs + report.load.jobs,
        report.store.failed + report.load.failed,
        report.store.bytes_moved + report.load.bytes_moved,
        report.store.latencies_ms + report.load.latencies_ms,
    )
    table.add_row(*_row("both", both, wall), end_section=True)
    out.print(table)
    out.print(
        "GB/s: bytes moved over the run's wall time; p50/p99: submit -> result latency of a job",
        markup=False,
    )
    out.print(
        f"CPU per step: {report.caller_cpu_s / steps * 1e3:.3f} ms in the stepping thread, "
        f"{report.process_cpu_s / steps * 1e3:.3f} ms in the whole process (engine loop and "
        "copy threads included; the integrity checks left out)",
        markup=False,
    )
    out.print(
        f"integrity: every load checked when it completed: {report.loads_checked:,} loads, "
        f"{report.checked:,} blocks compared byte for byte with their sources "
        f"({report.check_cpu_s:.2f} s CPU), {report.corrupt} corrupt",
        markup=False,
    )
    if not report.ok:
        why = (
            "no loaded block to check"
            if report.checked == 0
            else f"{both.failed} failed jobs, {report.corrupt} corrupt blocks"
        )
        err.print(f"offload-engine demo: FAILED: {why}", markup=False)
        return 1
    return 0
