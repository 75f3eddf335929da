"""How long the engine holds up a Python thread that launches kernels (CUDA).

A serving worker's forward pass is a Python thread launching kernels one after
another; every engine thread that takes the GIL, and every driver call that
holds the driver's lock, delays that thread's next launch. This pass measures
the delays from the launching thread's side, which is what the model feels:

* the thread launches a small kernel (``x.add_(1)`` on 1,024 floats, on a
  side stream) in a loop for ``seconds`` and stamps the clock after each launch;
* every ``poll_every`` launches it calls the engine as a serving loop would: it
  collects finished jobs without blocking (``get_finished``) and submits a new
  store and a new load of ``blocks`` blocks when the previous one has finished
  (so one store and one load are always in flight, and the engine never refuses
  a job);
* a *gap* is the time between two consecutive stamps. Gaps that include the
  thread's own engine call are left out: what remains is launch time plus
  whatever other threads took from it.

Per (strategy, blocks) the pass reports the gap distribution (median, 99th and
99.9th percentile, maximum) beside the same loop with no engine (``none``),
and the number of gaps more than 50 µs longer than the no-engine median, per
second. A launcher that held the GIL (or the driver) for more than 50 µs at a
time shows there. The KV cache is the step pass's (32 layers, 2 MiB blocks of
64 KiB regions, :meth:`KVLayout.flash_attention`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from offload_engine import KVLayout, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.bench.step import LAUNCH_MODES
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes.base import DeviceRuntime

#: the variant with no engine: the launching thread's own gaps
NONE = "none"
#: a gap this much longer than the no-engine median counts as a hold-up
HOLD_US = 50.0


@dataclass(frozen=True)
class GapPlan:
    """What :func:`run_gap_pass` measures."""

    blocks: tuple[int, ...] = (8, 64, 512)  # per job, each way
    #: ``<strategy>`` or ``<strategy>/<launch mode>`` (a key of
    #: :data:`~offload_engine.bench.step.LAUNCH_MODES`)
    strategies: tuple[str, ...] = ("auto", "dma", "auto/submitter-polled")
    seconds: float = 1.0  # of launches per variant and round
    reps: int = 3  # rounds, variants interleaved
    poll_every: int = 32  # launches between the thread's engine calls

    @property
    def variants(self) -> tuple[str, ...]:
        return (NONE, *self.strategies)


@dataclass(frozen=True)
class GapRow:
    """One (strategy, blocks) over every round: gap percentiles in µs, the hold-ups
    (gaps over the no-engine median plus :data:`HOLD_US`) per second, jobs per second."""

    variant: str
    blocks: int
    p50_us: float
    p99_us: float
    p999_us: float
    max_us: float
    holdups_per_s: float
    jobs_per_s: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _Pump:
    """Keeps one store and one load of ``k`` blocks in flight on ``engine``."""

    def __init__(self, engine: SyncOffloadingEngine, k: int, half: int, seed: int = 0) -> None:
        self.engine, self.k, self.half = engine, k, half
        self.rng = np.random.default_rng(seed)
        self.store: int | None = None
        self.load: int | None = None
        self.jobs = 0

    def _pick(self, offset: int) -> Any:
        return self.rng.choice(self.half, size=self.k, replace=False) + offset

    def __call__(self) -> None:
        for r in self.engine.get_finished():
            if not r.success:
                raise RuntimeError(f"a transfer failed: {r.error}")
            self.jobs += 1
            if r.job_id == self.store:
                self.store = None
            elif r.job_id == self.load:
                self.load = None
        h = self.half
        if self.store is None:
            self.store = self.engine.submit_nowait(
                TransferSpec(gpu_blocks(self._pick(0)), cpu_blocks(self._pick(0)))
            )
        if self.load is None:
            self.load = self.engine.submit_nowait(
                TransferSpec(cpu_blocks(self._pick(h)), gpu_blocks(self._pick(h)))
            )

    def drain(self) -> None:
        pending = [j for j in (self.store, self.load) if j is not None]
        for r in self.engine.wait(pending):
            if not r.success:
                raise RuntimeError(f"a transfer failed: {r.error}")
        self.store = self.load = None


def launch_gaps(
    x: torch.Tensor, seconds: float, poll_every: int, poll: Callable[[], None]
) -> np.ndarray:
    """The gaps (ns) between consecutive kernel launches on ``x`` over ``seconds``,
    leaving out each gap that includes a call of ``poll``."""
    clock = time.perf_counter_ns
    cap = int(seconds * 1_000_000) + poll_every  # far more than a launch per µs
    stamps = np.zeros(cap, dtype=np.int64)
    end = clock() + int(seconds * 1e9)
    i = 0
    while i < cap:
        x.add_(1)
        stamps[i] = clock()
        i += 1
        if i % poll_every == 0:
            poll()  # the next gap (ending at stamps[i]) includes it
            if stamps[i - 1] > end:
                break
    gaps = np.diff(stamps[:i])  # gaps[j] ends at stamps[j + 1]
    keep = (np.arange(1, i) % poll_every) != 0
    kept: np.ndarray = gaps[keep]
    return kept


def _row(
    variant: str, k: int, gaps: np.ndarray, base_us: float, seconds: float, jobs: int
) -> GapRow:
    us = gaps / 1e3
    p50, p99, p999 = np.percentile(us, [50, 99, 99.9])
    return GapRow(
        variant=variant,
        blocks=k,
        p50_us=float(p50),
        p99_us=float(p99),
        p999_us=float(p999),
        max_us=float(us.max()),
        holdups_per_s=float((us > base_us + HOLD_US).sum() / seconds),
        jobs_per_s=jobs / seconds,
    )


def run_gap_pass(
    runtime: DeviceRuntime,
    plan: GapPlan | None = None,
    *,
    tick: Callable[[str], None] = lambda what: None,
) -> list[GapRow]:
    """One row per (variant, blocks) of ``plan``; the ``none`` variant's rows repeat
    for every ``blocks`` so each table row has its baseline."""
    plan = plan or GapPlan()
    device = runtime.device
    cache_blocks = 2 * max(plan.blocks)
    layers = [
        torch.zeros(2, cache_blocks, 16, 8, 128, device=device, dtype=torch.bfloat16)
        for _ in range(32)
    ]
    layout = KVLayout.flash_attention(layers)
    tier = pinned_host_tier(runtime, layout, cache_blocks)
    x = torch.zeros(1024, device=device)
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    engines: dict[str, SyncOffloadingEngine] = {}
    try:
        for s in plan.strategies:
            strategy, _, mode = s.partition("/")
            config = DeviceHandlerConfig(
                strategy=CopyStrategy(strategy), **LAUNCH_MODES[mode or "loop"]
            )
            engines[s] = SyncOffloadingEngine(
                list(make_device_handlers(runtime, layout, tier, config))
            )
        rows: list[GapRow] = []
        with torch.cuda.stream(side):
            launch_gaps(x, 0.2, plan.poll_every, lambda: None)  # warm up
            for k in plan.blocks:
                gaps: dict[str, list[np.ndarray]] = {v: [] for v in plan.variants}
                jobs = dict.fromkeys(plan.variants, 0)
                for _ in range(plan.reps):
                    for v in plan.variants:
                        tick(f"gaps {k} blocks {v}")
                        if v == NONE:
                            gaps[v].append(
                                launch_gaps(x, plan.seconds, plan.poll_every, lambda: None)
                            )
                            continue
                        pump = _Pump(engines[v], k, cache_blocks // 2)
                        gaps[v].append(launch_gaps(x, plan.seconds, plan.poll_every, pump))
                        pump.drain()
                        jobs[v] += pump.jobs
                    side.synchronize()
                seconds = plan.seconds * plan.reps
                base = float(np.median(np.concatenate(gaps[NONE]))) / 1e3
                for v in plan.variants:
                    rows.append(_row(v, k, np.concatenate(gaps[v]), base, seconds, jobs[v]))
        return rows
    finally:
        for e in engines.values():
            e.close()
        tier.release()


def format_gap_rows(rows: Sequence[GapRow]) -> list[str]:
    """The rows as a text table, one line per (blocks, variant)."""
    out = [
        f"{'blocks':>6} {'variant':>22} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>8} "
        f"{'hold-ups/s':>10} {'jobs/s':>7}"
    ]
    for r in rows:
        out.append(
            f"{r.blocks:6} {r.variant:>22} {r.p50_us:7.1f} {r.p99_us:7.1f} {r.p999_us:7.1f} "
            f"{r.max_us:8.1f} {r.holdups_per_s:10.1f} {r.jobs_per_s:7.0f}"
        )
    out.append(
        f"µs between a Python thread's kernel launches (its own engine calls left out); "
        f"hold-ups: gaps over the no-engine median + {HOLD_US:.0f} µs"
    )
    return out
