"""Handlers that let the submitting thread launch: order, threads and close."""

from __future__ import annotations

import threading

import pytest

from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.engine.handler import LaunchedJob
from offload_engine.testing import FakeHandler

STORE = TransferSpec(gpu_blocks([1]), cpu_blocks([2]))


class SubmitterLaunched(FakeHandler):
    """Reports at launch; records which thread launched each job; can hold one
    launch until ``gate`` is set."""

    launch_in_submitter = True

    def __init__(self, hold: int | None = None) -> None:
        super().__init__()
        self.hold = hold
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.threads: dict[int, str] = {}

    def launch(self, job: LaunchedJob[int]) -> None:
        self.threads[job.job_id] = threading.current_thread().name
        if job.job_id == self.hold:
            self.entered.set()
            self.gate.wait()
        super().launch(job)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_idle_route_launches_on_the_submitting_thread(backend: str) -> None:
    handler = SubmitterLaunched()
    with SyncOffloadingEngine([handler], backend=backend, thread_name="loop") as engine:
        ids = [engine.submit_nowait(STORE) for _ in range(3)]
        assert all(r.success for r in engine.wait(ids))
    assert handler.launched == ids
    assert set(handler.threads.values()) == {threading.current_thread().name}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_jobs_submitted_during_a_launch_queue_behind_it_in_order(backend: str) -> None:
    handler = SubmitterLaunched(hold=0)
    with SyncOffloadingEngine([handler], backend=backend, thread_name="loop") as engine:
        first = threading.Thread(target=engine.submit_nowait, args=(STORE,), kwargs={"job_id": 0})
        first.start()
        assert handler.entered.wait(10)
        later = [engine.submit_nowait(STORE, job_id=j) for j in (1, 2)]
        # job 0 holds the route's launch: the later jobs wait in the queue
        assert handler.launched == []
        handler.gate.set()
        first.join()
        assert all(r.success for r in engine.wait([0, *later]))
    assert handler.launched == [0, 1, 2]
    assert handler.threads[0] == first.name
    assert handler.threads[1] == handler.threads[2] == "loop"


def test_close_waits_for_a_launch_in_a_submitting_thread() -> None:
    handler = SubmitterLaunched(hold=0)
    engine = SyncOffloadingEngine([handler], thread_name="loop")
    first = threading.Thread(target=engine.submit_nowait, args=(STORE,), kwargs={"job_id": 0})
    first.start()
    assert handler.entered.wait(10)
    closed: list[object] = []
    closer = threading.Thread(target=lambda: closed.extend(engine.close(timeout=0.05)))
    closer.start()
    # the job is abandoned after 0.05 s, but the handler is not closed under the launch
    closer.join(0.5)
    assert closer.is_alive() and not handler.closed
    handler.gate.set()
    first.join()
    closer.join()
    assert handler.closed
    [result] = closed
    assert not result.success  # abandoned at close: its launch outlived the timeout


class InterruptedLaunch(SubmitterLaunched):
    """The submitting thread is interrupted inside ``launch``."""

    def launch(self, job: LaunchedJob[int]) -> None:
        raise KeyboardInterrupt


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_interrupt_inside_a_submitter_launch_fails_the_job_and_close_returns(
    backend: str,
) -> None:
    handler = InterruptedLaunch()
    engine = SyncOffloadingEngine([handler], backend=backend, thread_name="loop")
    with pytest.raises(KeyboardInterrupt):
        engine.submit_nowait(STORE, job_id=7)
    # the interrupt reached the caller; the job still got its one result, and the
    # route's launch bookkeeping was released, so close does not wait on it
    [result] = engine.close(timeout=10)
    assert result.job_id == 7 and not result.success
    assert handler.closed
