"""Transfer benchmarks behind ``offload-engine bench`` (and the demo's rigs).

Shared vocabulary of the cases:

* :class:`SweepPoint`: throughput of one (medium, strategy, direction,
  blocks per job) point, measured with a window of jobs in flight;
* :class:`LatencySeries`: the submit->result latency of every job of one
  (medium, strategy, direction, depth) run;
* :func:`run_window`: pushes a list of specs through an engine with at most
  ``depth`` jobs in flight and returns the results and the wall time.

The rigs (a cache, a tier and their handlers) live in
:mod:`offload_engine.bench.rigs`, the cases run on any rig in
:mod:`offload_engine.bench.transfers`, the engine-overhead cases in
:mod:`offload_engine.bench.overhead`, and the GPU hooks in
:mod:`offload_engine.bench.cuda`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from offload_engine.engine.sync import SyncOffloadingEngine
from offload_engine.vocabulary import TransferResult, TransferSpec


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 <= q <= 100) of ``values``; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def series_label(medium: str, strategy: str, variant: str) -> str:
    """``"host-copy (2 copy threads)"``, ``"dma (cuda:0)"``: strategy, then medium and variant."""
    detail = ", ".join(x for x in (medium if medium != "host" else "", variant) if x)
    return f"{strategy} ({detail})" if detail else strategy


@dataclass(frozen=True)
class SweepPoint:
    """Throughput of one batch of equal jobs, ``depth`` of them in flight at a time."""

    medium: str  # "host", or a device such as "cuda:0"
    strategy: str  # a copy strategy, as probe_runtimes() names it ("host-copy", "dma", ...)
    variant: str  # free-form detail shown in plot legends ("2 workers"); may be ""
    direction: str  # "store" (KV cache -> tier) or "load" (tier -> KV cache)
    blocks_per_job: int
    block_bytes: int
    depth: int  # jobs in flight
    jobs: int  # per repeat
    bytes_moved: int  # per repeat
    wall_s: tuple[float, ...]  # each repeat's first submit -> last result
    p50_ms: float  # submit -> result under this load, all repeats pooled
    p99_ms: float

    def _rate(self, wall: float) -> float:
        return self.bytes_moved / wall / 1e9 if wall > 0 else math.nan

    @property
    def gbps(self) -> float:
        """GB/s (10**9 bytes) of the median repeat: bytes moved over its wall time."""
        return self._rate(percentile(self.wall_s, 50))

    @property
    def gbps_min(self) -> float:
        return self._rate(max(self.wall_s))

    @property
    def gbps_max(self) -> float:
        return self._rate(min(self.wall_s))

    def as_dict(self) -> dict[str, object]:
        return {
            **self.__dict__,
            "wall_s": list(self.wall_s),
            "gbps": self.gbps,
            "gbps_min": self.gbps_min,
            "gbps_max": self.gbps_max,
        }


@dataclass(frozen=True)
class LatencySeries:
    """Submit->result latency of every job of one run, in milliseconds."""

    medium: str
    strategy: str
    variant: str
    direction: str
    blocks_per_job: int
    depth: int
    latencies_ms: tuple[float, ...]

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies_ms, 50)

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies_ms, 99)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {k: v for k, v in self.__dict__.items() if k != "latencies_ms"}
        out.update(
            jobs=len(self.latencies_ms),
            p50_ms=self.p50_ms,
            p99_ms=self.p99_ms,
            latencies_ms=list(self.latencies_ms),
        )
        return out


@dataclass(frozen=True)
class BenchPlan:
    """What the transfer cases measure; ``quick()`` is the CI-sized plan."""

    blocks_per_job: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    bytes_per_point: int = 256 << 20  # moved per repeat of a point (at least min_jobs jobs)
    min_jobs: int = 32
    repeats: int = 3  # of each sweep point, interleaved; the figures show the median
    depth: int = 16  # jobs in flight during the sweep
    latency_blocks: int = 8  # blocks per job of the latency runs
    latency_depths: tuple[int, ...] = (1, 16)  # one job at a time, and a loaded queue
    latency_jobs: int = 2000  # per direction and depth
    workers: int = 2  # host copy threads

    @classmethod
    def quick(cls, workers: int = 2) -> BenchPlan:
        return cls(
            blocks_per_job=(1, 8, 64),
            bytes_per_point=16 << 20,
            min_jobs=16,
            repeats=1,
            latency_jobs=100,
            workers=workers,
        )

    def jobs_for(self, blocks_per_job: int, block_bytes: int) -> int:
        """Jobs in one sweep point: enough to move ``bytes_per_point``."""
        return max(self.min_jobs, -(-self.bytes_per_point // (blocks_per_job * block_bytes)))

    @property
    def steps(self) -> int:
        """Progress units of one rig: sweep runs plus latency runs."""
        return 2 * len(self.blocks_per_job) * self.repeats + 2 * len(self.latency_depths)


@dataclass
class CaseResults:
    """What one medium's transfer cases produced."""

    sweep: list[SweepPoint]
    latency: list[LatencySeries]


def run_window(
    engine: SyncOffloadingEngine, specs: Sequence[TransferSpec], depth: int
) -> tuple[list[TransferResult], float]:
    """Submit ``specs`` in order, at most ``depth`` in flight; return results and wall time.

    The caller blocks on its oldest job whenever ``depth`` jobs are out, like a
    serving loop that waits for a flush. Results come back in submit order.
    """
    pending: deque[int] = deque()
    results: list[TransferResult] = []
    t0 = time.perf_counter()
    for spec in specs:
        while len(pending) >= depth:
            results.extend(engine.wait([pending.popleft()]))
        pending.append(engine.submit(spec))
    results.extend(engine.wait(list(pending)))
    return results, time.perf_counter() - t0


def first_failure(results: Sequence[TransferResult]) -> BaseException | None:
    """The error of the first failed result, or ``None`` if all succeeded."""
    for r in results:
        if not r.success:
            return r.error
    return None


__all__ = [
    "BenchPlan",
    "CaseResults",
    "LatencySeries",
    "SweepPoint",
    "first_failure",
    "percentile",
    "run_window",
    "series_label",
]
