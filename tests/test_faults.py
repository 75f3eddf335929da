"""Fault injection: handlers that raise, misreport or hang; close under load; a full queue.

Each case ends with a failed result for exactly the jobs the fault hits, while the other jobs
complete, and nothing hangs: every wait is bounded and the close is bounded.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from offload_engine import (
    EngineBrokenError,
    JobCancelledError,
    Medium,
    OffloadingQueueManager,
    SyncOffloadingEngine,
    ThreadPoolHandler,
    TransferError,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.handler import LaunchedJob
from offload_engine.testing import FakeHandler, assert_exactly_once

STORE = TransferSpec(gpu_blocks([1, 2]), cpu_blocks([3, 4]))
BOUND = 10.0  # seconds; no step of a fault test may take longer


class ScriptedPool(ThreadPoolHandler[int]):
    """A thread-pool handler whose ``execute`` returns or raises what the test scripts,
    per job id; unscripted jobs succeed with 2 bytes."""

    src = Medium.GPU
    dst = Medium.CPU

    def __init__(
        self, script: dict[int, object], *, workers: int = 1, close_timeout: float = 30.0
    ) -> None:
        super().__init__(
            workers=workers, thread_name="offload-engine-test-pool", close_timeout=close_timeout
        )
        self.script = script
        self.gate = threading.Event()  # jobs scripted as GATED wait for it
        self.entered = threading.Event()

    def prepare(self, spec: TransferSpec) -> int:
        return 2

    def execute(self, job: LaunchedJob[int]) -> int:
        action = self.script.get(job.job_id, 2)
        if action is GATED:
            self.entered.set()
            self.gate.wait(2 * BOUND)
            return 2
        if isinstance(action, BaseException):
            raise action
        return action  # type: ignore[return-value]


GATED = object()  # a script entry: the job waits in its worker until the gate opens
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


class FailsToClose(FakeHandler):
    async def aclose(self) -> None:
        await super().aclose()
        raise RuntimeError("cannot release the device")


def test_a_handler_that_fails_to_close_keeps_the_uncollected_results() -> None:
    """Regression: when a handler's ``aclose`` raised, ``close()`` raised it and the results
    nobody had collected were dropped: those jobs never got their result to anyone."""
    engine = SyncOffloadingEngine([FailsToClose(), FakeHandler(Medium.CPU, Medium.GPU)])
    ids = [engine.submit_nowait(STORE) for _ in range(4)]
    collected = engine.wait(ids[:1], timeout=BOUND)
    with pytest.raises(RuntimeError, match="cannot release"):
        engine.close()
    assert engine.closed and engine.stats().state == "closed"
    assert_exactly_once(ids, collected + list(engine.leftover_results))
    assert engine.close() == []  # idempotent, and it keeps the leftovers
    assert len(engine.leftover_results) == 3


@pytest.mark.anyio
async def test_async_with_keeps_the_uncollected_results_when_a_handler_fails_to_close() -> None:
    mgr = OffloadingQueueManager([FailsToClose()])
    with pytest.raises(RuntimeError, match="cannot release"):
        async with mgr:
            ids = [mgr.submit_nowait(STORE) for _ in range(3)]
            await mgr.wait(ids[:1], timeout=BOUND)
    assert mgr.closed
    assert sorted(r.job_id for r in mgr.leftover_results) == ids[1:]
    mgr2 = OffloadingQueueManager([FailsToClose()])
    async with mgr2:
        j = mgr2.submit_nowait(STORE)
        with pytest.raises(RuntimeError, match="cannot release"):
            await mgr2.aclose()
    # the second aclose in __aexit__ must not overwrite what the failed one kept
    assert [r.job_id for r in mgr2.leftover_results] == [j]


def test_close_does_not_hang_on_a_worker_stuck_in_a_job() -> None:
    """Regression: ``close(timeout=...)`` abandoned a job stuck in its worker, then waited
    for that worker to exit forever (or as long as the job took)."""
    pool = ScriptedPool({0: GATED}, workers=2, close_timeout=0.2)
    engine = SyncOffloadingEngine([pool])
    ids = [engine.submit_nowait(STORE, job_id=j) for j in range(4)]
    assert pool.entered.wait(BOUND)
    workers = list(pool._threads)
    t0 = time.monotonic()
    with pytest.raises(EngineBrokenError, match="still inside a job"):
        engine.close(timeout=0.05)
    assert time.monotonic() - t0 < BOUND / 2
    assert engine.closed
    by_id = {r.job_id: r for r in engine.leftover_results}
    assert sorted(by_id) == ids
    assert isinstance(by_id[0].error, JobCancelledError) and "abandoned" in str(by_id[0].error)
    assert all(by_id[j].success for j in ids[1:])  # the other worker ran the rest
    pool.gate.set()  # the stuck copy returns; its late report is ignored; the worker exits
    for t in workers:
        t.join(BOUND)
    assert not any(t.is_alive() for t in workers)
