"""Transfer cases on one rig: GB/s against blocks per job, and job latency.

:func:`run_rig_cases` drives any :class:`~offload_engine.bench.rigs.Rig`
through the sync facade, as a serving loop would:

* **sweep**: for each direction and each blocks-per-job size, jobs of that
  size with ``plan.depth`` in flight; GB/s is bytes moved over the wall time
  from the first submit to the last result. Each point is repeated
  ``plan.repeats`` times, interleaved with the other points; the median
  repeat counts;
* **latency**: jobs of ``plan.latency_blocks`` blocks, one at a time
  (depth 1) and with a queue (depth 16); every job's submit->result latency.

Block ids are random, and the jobs in flight at one time never share a block.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from offload_engine.bench import (
    BenchPlan,
    CaseResults,
    LatencySeries,
    SweepPoint,
    first_failure,
    percentile,
    run_window,
)
from offload_engine.bench.rigs import Rig
from offload_engine.engine.sync import SyncOffloadingEngine
from offload_engine.vocabulary import TransferResult, TransferSpec

Tick = Callable[[str], None]

DIRECTIONS = ("store", "load")


def _specs(rig: Rig, direction: str, n: int, count: int, seed: int) -> list[TransferSpec]:
    """``count`` jobs of ``n`` blocks; any ``pool // n`` consecutive ones are disjoint."""
    rng = np.random.default_rng(seed)
    cache_pool, tier_pool = rig.layout.num_blocks, rig.tier.num_blocks
    cache_perm = rng.permutation(cache_pool)
    tier_perm = rng.permutation(tier_pool)
    cache_segments, tier_segments = cache_pool // n, tier_pool // n
    specs = []
    for j in range(count):
        c = cache_perm[(j % cache_segments) * n : (j % cache_segments + 1) * n]
        t = tier_perm[(j % tier_segments) * n : (j % tier_segments + 1) * n]
        specs.append(rig.store(c, t) if direction == "store" else rig.load(t, c))
    return specs


def _max_depth(rig: Rig, n: int, depth: int) -> int:
    return max(1, min(depth, rig.layout.num_blocks // n, rig.tier.num_blocks // n))


def _checked(results: list[TransferResult]) -> list[TransferResult]:
    error = first_failure(results)
    if error is not None:
        raise error
    return results


def run_rig_cases(
    rig: Rig,
    plan: BenchPlan,
    *,
    variant: str = "",
    tick: Tick = lambda _what: None,
) -> CaseResults:
    """Run the sweep and the latency runs on ``rig``; a failed job raises its error."""
    out = CaseResults(sweep=[], latency=[])
    pool = min(rig.layout.num_blocks, rig.tier.num_blocks)
    with SyncOffloadingEngine(rig.handlers, thread_name="offload-engine-bench") as engine:
        for direction in DIRECTIONS:  # warm-up: threads, allocator, caches
            warm = _specs(rig, direction, plan.latency_blocks, 2 * plan.depth, seed=1)
            _checked(run_window(engine, warm, plan.depth)[0])
        runs: dict[tuple[str, int], list[tuple[list[TransferResult], float]]] = {}
        for _ in range(plan.repeats):  # interleaved, so a slow spell hits every point alike
            for direction in DIRECTIONS:
                for n in plan.blocks_per_job:
                    if n > pool:
                        tick(f"{direction} {n} blocks/job: skipped, pool holds {pool}")
                        continue
                    depth = _max_depth(rig, n, plan.depth)
                    specs = _specs(rig, direction, n, plan.jobs_for(n, rig.block_bytes), seed=n)
                    results, wall = run_window(engine, specs, depth)
                    runs.setdefault((direction, n), []).append((_checked(results), wall))
                    rate = sum(r.bytes_moved for r in results) / wall / 1e9
                    tick(f"{rig.strategy} {direction} {n} blocks/job: {rate:.2f} GB/s")
        for (direction, n), done in runs.items():
            lat = [r.latency * 1e3 for results, _ in done for r in results]
            first = done[0][0]
            out.sweep.append(
                SweepPoint(
                    medium=rig.medium,
                    strategy=rig.strategy,
                    variant=variant,
                    direction=direction,
                    blocks_per_job=n,
                    block_bytes=rig.block_bytes,
                    depth=_max_depth(rig, n, plan.depth),
                    jobs=len(first),
                    bytes_moved=sum(r.bytes_moved for r in first),
                    wall_s=tuple(wall for _, wall in done),
                    p50_ms=percentile(lat, 50),
                    p99_ms=percentile(lat, 99),
                )
            )
        n = plan.latency_blocks
        for direction in DIRECTIONS:
            for depth in plan.latency_depths:
                specs = _specs(rig, direction, n, plan.latency_jobs, seed=1000 + depth)
                results, _ = run_window(engine, specs, _max_depth(rig, n, depth))
                series = LatencySeries(
                    medium=rig.medium,
                    strategy=rig.strategy,
                    variant=variant,
                    direction=direction,
                    blocks_per_job=n,
                    depth=_max_depth(rig, n, depth),
                    latencies_ms=tuple(r.latency * 1e3 for r in _checked(results)),
                )
                out.latency.append(series)
                tick(
                    f"{rig.strategy} {direction} latency, depth {depth}: p50 {series.p50_ms:.2f} ms"
                )
    return out
