"""A handler may name how each job's bytes moved: the result carries the name and
HandlerStats counts successful jobs by it."""

from __future__ import annotations

from offload_engine import (
    HandlerStats,
    Medium,
    SyncOffloadingEngine,
    TransferResult,
    TransferSpec,
    cpu_blocks,
)
from offload_engine.engine.handler import LaunchedJob, TransferHandler


class Naming(TransferHandler[int]):
    """Succeeds at once, naming the strategies it was given in turn."""

    src, dst = Medium.CPU, Medium.CPU

    def __init__(self, *strategies: object) -> None:
        self.strategies = list(strategies)

    def prepare(self, spec: TransferSpec) -> int:
        return 1

    def launch(self, job: LaunchedJob[int]) -> None:
        job.succeed(1, strategy=self.strategies.pop(0))  # type: ignore[arg-type]


def run(handler: Naming, jobs: int) -> tuple[list[TransferResult], HandlerStats]:
    with SyncOffloadingEngine([handler]) as engine:
        spec = TransferSpec(cpu_blocks([0]), cpu_blocks([1]))
        results = engine.wait([engine.submit(spec) for _ in range(jobs)])
        return results, engine.stats().handlers[0]


def test_results_and_stats_carry_the_strategy_each_job_took() -> None:
    results, stats = run(Naming("dma", "staged", "dma", None), 4)
    assert [r.strategy for r in results] == ["dma", "staged", "dma", None]
    assert stats.by_strategy == (("dma", 2), ("staged", 1))
    assert (stats.jobs_by("dma"), stats.jobs_by("staged"), stats.jobs_by("kernel")) == (2, 1, 0)


def test_a_handler_that_names_no_strategy_counts_none() -> None:
    [r], stats = run(Naming(None), 1)
    assert r.success and r.strategy is None
    assert stats.by_strategy == () and stats.jobs_by("dma") == 0


def test_a_strategy_that_is_no_str_fails_the_job() -> None:
    [r], stats = run(Naming(3), 1)
    assert not r.success and r.strategy is None
    assert "strategy=3" in str(r.error)
    assert stats.by_strategy == () and stats.failed == 1
