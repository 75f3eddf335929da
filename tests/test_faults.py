"""Fault injection: handlers that raise, misreport or hang; close under load; a full queue.

Each case ends with a failed result for exactly the jobs the fault hits, while the other jobs
complete, and nothing hangs: every wait is bounded and the close is bounded.
"""

from __future__ import annotations

import math

import pytest

from offload_engine import (
    Medium,
    SyncOffloadingEngine,
    ThreadPoolHandler,
    TransferError,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.handler import LaunchedJob
from offload_engine.testing import assert_exactly_once

STORE = TransferSpec(gpu_blocks([1, 2]), cpu_blocks([3, 4]))
BOUND = 10.0  # seconds; no step of a fault test may take longer


class ScriptedPool(ThreadPoolHandler[int]):
    """A thread-pool handler whose ``execute`` returns or raises what the test scripts,
    per job id; unscripted jobs succeed with 2 bytes."""

    src = Medium.GPU
    dst = Medium.CPU

    def __init__(self, script: dict[int, object], *, workers: int = 1) -> None:
        super().__init__(workers=workers, thread_name="offload-engine-test-pool")
        self.script = script

    def prepare(self, spec: TransferSpec) -> int:
        return 2

    def execute(self, job: LaunchedJob[int]) -> int:
        action = self.script.get(job.job_id, 2)
        if isinstance(action, BaseException):
            raise action
        return action  # type: ignore[return-value]


BAD_BYTE_COUNTS: list[object] = [None, "x", -5, math.nan, math.inf, object()]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_malformed_success_report_fails_the_job_and_the_worker_survives(workers: int) -> None:
    """Regression: ``execute`` returning a bad byte count made ``job.succeed`` raise in the
    worker thread. The worker died and the job never got a result (close hung without a
    timeout)."""
    script: dict[int, object] = dict(enumerate(BAD_BYTE_COUNTS))
    engine = SyncOffloadingEngine([ScriptedPool(script, workers=workers)])
    try:
        bad = [engine.submit_nowait(STORE, job_id=j) for j in script]
        good = [engine.submit_nowait(STORE, job_id=100 + i) for i in range(2 * workers)]
        results = engine.wait(bad + good, timeout=BOUND)
    finally:
        leftovers = engine.close(timeout=BOUND)
    assert leftovers == []
    assert_exactly_once(bad + good, results)
    by_id = {r.job_id: r for r in results}
    for j in bad:
        r = by_id[j]
        assert not r.success and r.bytes_moved == 0
        assert isinstance(r.error, TransferError)
        assert "invalid byte count" in str(r.error)
    assert all(by_id[j].success and by_id[j].bytes_moved == 2 for j in good)


def test_a_failure_reported_with_a_non_exception_still_fails_the_job() -> None:
    class Sloppy(ScriptedPool):
        def execute(self, job: LaunchedJob[int]) -> int:
            if job.job_id == 0:
                job.fail("disk on fire")  # type: ignore[arg-type]
                return 2  # the later success report is ignored: one result per job
            return super().execute(job)

    engine = SyncOffloadingEngine([Sloppy({})])
    try:
        ids = [engine.submit_nowait(STORE, job_id=j) for j in range(3)]
        results = engine.wait(ids, timeout=BOUND)
    finally:
        assert engine.close(timeout=BOUND) == []
    first, *rest = results
    assert not first.success and isinstance(first.error, TransferError)
    assert isinstance(first.error.__cause__, TypeError)
    assert "disk on fire" in str(first.error.__cause__)
    assert all(r.success for r in rest)
