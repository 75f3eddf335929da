"""OffloadingQueueManager inside the caller's loop, on asyncio and trio."""

from __future__ import annotations

import math
import threading

import anyio
import pytest

from offload_engine import (
    ConfigError,
    DuplicateJobIdError,
    EngineClosedError,
    EngineNotStartedError,
    HandlerRegistrationError,
    JobCancelledError,
    JobTimeoutError,
    Medium,
    NoHandlerError,
    OffloadingQueueManager,
    QueueFullError,
    TransferError,
    TransferSpec,
    UnknownJobError,
    WrongThreadError,
    cpu_blocks,
    gpu_blocks,
    npu_blocks,
)
from offload_engine.engine.handler import LaunchedJob, hooks_waits
from offload_engine.testing import FakeHandler, FakeTransferFailure, assert_exactly_once

pytestmark = pytest.mark.anyio

STORE = TransferSpec(gpu_blocks([1, 2]), cpu_blocks([3, 4]))
LOAD = TransferSpec(cpu_blocks([3, 4]), gpu_blocks([1, 2]))


async def test_submit_and_wait_returns_one_result_per_job() -> None:
    async with OffloadingQueueManager([FakeHandler(bytes_per_block=10)]) as mgr:
        ids = [mgr.submit_nowait(STORE) for _ in range(5)]
        results = await mgr.wait(ids)
        assert [r.job_id for r in results] == ids
        assert all(r.success and r.bytes_moved == 20 and r.error is None for r in results)
        assert all(r.latency >= r.seconds >= 0 for r in results)
        assert mgr.get_finished() == []


async def test_jobs_are_routed_by_medium_pair() -> None:
    store, load = FakeHandler(Medium.GPU, Medium.CPU), FakeHandler(Medium.CPU, Medium.GPU)
    async with OffloadingQueueManager([store, load]) as mgr:
        a = mgr.submit_nowait(STORE)
        b = mgr.submit_nowait(LOAD)
        await mgr.wait([a, b])
        assert store.launched == [a]
        assert load.launched == [b]
        with pytest.raises(NoHandlerError, match="NPU->CPU"):
            mgr.submit_nowait(TransferSpec(npu_blocks([1]), cpu_blocks([1])))


async def test_three_ways_to_collect_results() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        a, b, c = (mgr.submit_nowait(STORE) for _ in range(3))
        await fake.wait_launched(3)
        fake.complete(a)
        assert [r.job_id for r in mgr.get_finished()] == [a]
        fake.complete(b)
        seen = []
        async for result in mgr:
            seen.append(result.job_id)
            if len(seen) == 1:
                fake.complete(c)
            if len(seen) == 2:
                break
        assert seen == [b, c]


async def test_job_ids_assigned_supplied_and_duplicates_refused() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        auto = mgr.submit_nowait(STORE)
        mine = mgr.submit_nowait(STORE, job_id=1000)
        assert mine == 1000
        with pytest.raises(DuplicateJobIdError, match="1000"):
            mgr.submit_nowait(STORE, job_id=1000)
        with pytest.raises(DuplicateJobIdError):
            mgr.submit_nowait(STORE, job_id=auto)
        for bad in ("7", 1.0, True, -1, 2**64):
            with pytest.raises((TypeError, ValueError)):
                mgr.submit_nowait(STORE, job_id=bad)  # type: ignore[arg-type]
        await fake.wait_launched(2)
        fake.complete_all()
        # finished but not collected: still live, still refused
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(DuplicateJobIdError):
            mgr.submit_nowait(STORE, job_id=1000)
        await mgr.wait([auto, mine])
        # collected: the id may be used again
        assert mgr.submit_nowait(STORE, job_id=1000) == 1000
        await fake.wait_launched(3)
        fake.complete_all()
        await mgr.wait([1000])
        # auto ids skip live ones
        mgr.submit_nowait(STORE, job_id=auto + 1)
        nxt = mgr.submit_nowait(STORE)
        assert nxt not in (auto, auto + 1)
        await fake.wait_launched(5)
        fake.complete_all()


async def test_wait_refuses_unknown_and_collected_ids() -> None:
    async with OffloadingQueueManager([FakeHandler()]) as mgr:
        with pytest.raises(UnknownJobError):
            await mgr.wait([42])
        j = mgr.submit_nowait(STORE)
        await mgr.wait([j])
        with pytest.raises(UnknownJobError, match="collected"):
            await mgr.wait([j])
        with pytest.raises(ValueError, match="repeat"):
            await mgr.wait([j, j])


async def test_wait_times_out_and_the_job_stays_collectable() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        j = mgr.submit_nowait(STORE)
        with pytest.raises(TimeoutError):
            await mgr.wait([j], timeout=0.01)
        fake.complete(j)
        [r] = await mgr.wait([j])
        assert r.success


async def test_backpressure_submit_nowait_raises_and_submit_waits() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake], capacity=2) as mgr:
        a = mgr.submit_nowait(STORE)
        b = mgr.submit_nowait(STORE)
        with pytest.raises(QueueFullError, match="capacity"):
            mgr.submit_nowait(STORE)
        assert mgr.stats().for_pair(Medium.GPU, Medium.CPU).submitted == 2
        got: list[int] = []

        async def late_submit() -> None:
            got.append(await mgr.submit(STORE))

        async with anyio.create_task_group() as tg:
            tg.start_soon(late_submit)
            await anyio.wait_all_tasks_blocked()
            assert got == []  # still waiting for room
            await fake.wait_launched(2)
            fake.complete(a)
        assert len(got) == 1
        await fake.wait_launched(3)
        fake.complete_all()
        assert len(await mgr.wait([b, got[0]])) == 2


async def test_ordered_handler_delivers_in_launch_order() -> None:
    fake = FakeHandler(manual=True, ordered=True)
    async with OffloadingQueueManager([fake]) as mgr:
        ids = [mgr.submit_nowait(STORE) for _ in range(4)]
        await fake.wait_launched(4)
        fake.complete_all(order=reversed(ids))
        assert [r.job_id for r in mgr.get_finished()] == ids


async def test_unordered_handler_delivers_as_completed() -> None:
    fake = FakeHandler(manual=True, ordered=False)
    async with OffloadingQueueManager([fake]) as mgr:
        ids = [mgr.submit_nowait(STORE) for _ in range(4)]
        await fake.wait_launched(4)
        fake.complete_all(order=list(reversed(ids)))
        assert [r.job_id for r in mgr.get_finished()] == list(reversed(ids))


async def test_early_finisher_waits_for_its_predecessor() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        a, b = mgr.submit_nowait(STORE), mgr.submit_nowait(STORE)
        await fake.wait_launched(2)
        fake.complete(b)
        assert mgr.get_finished() == []
        assert "in_flight=2" in repr(mgr)
        fake.complete(a)
        assert [r.job_id for r in mgr.get_finished()] == [a, b]


async def test_failures_and_exceptions_become_failed_results() -> None:
    fake = FakeHandler(fail={1}, raise_on_launch={2})
    async with OffloadingQueueManager([fake]) as mgr:
        ids = [mgr.submit_nowait(STORE, job_id=i) for i in range(4)]
        results = {r.job_id: r for r in await mgr.wait(ids)}
        assert results[0].success and results[3].success
        for jid in (1, 2):
            r = results[jid]
            assert not r.success and r.bytes_moved == 0
            assert isinstance(r.error, TransferError)
            assert isinstance(r.error.__cause__, FakeTransferFailure)
        stats = mgr.stats().for_pair(Medium.GPU, Medium.CPU)
        assert (stats.succeeded, stats.failed) == (2, 2)
        # the engine keeps serving
        [again] = await mgr.wait([mgr.submit_nowait(STORE)])
        assert again.success


async def test_timeouts_fail_queued_and_in_flight_jobs() -> None:
    fake = FakeHandler(manual=True, max_inflight=1)
    async with OffloadingQueueManager([fake]) as mgr:
        running = mgr.submit_nowait(STORE, timeout=0.05)
        queued = mgr.submit_nowait(STORE, timeout=0.05)
        other = mgr.submit_nowait(STORE)
        await fake.wait_launched(1)
        r1, r2 = await mgr.wait([running, queued])
        assert isinstance(r1.error, JobTimeoutError) and isinstance(r2.error, JobTimeoutError)
        # the timed-out in-flight job's slot is released, so the next job launches
        await fake.wait_launched(2)
        assert fake.launched == [running, other]
        fake.complete(running)  # a late report is ignored
        fake.complete(other)
        [r3] = await mgr.wait([other])
        assert r3.success
        stats = mgr.stats().for_pair(Medium.GPU, Medium.CPU)
        assert (stats.timed_out, stats.abandoned, stats.succeeded) == (2, 1, 1)


async def test_default_timeout_applies_and_bad_timeouts_are_refused() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake], default_timeout=0.02) as mgr:
        [r] = await mgr.wait([mgr.submit_nowait(STORE)])
        assert isinstance(r.error, JobTimeoutError)
        for bad in (0, -1, math.nan):
            with pytest.raises(ValueError):
                mgr.submit_nowait(STORE, timeout=bad)
        for wrong in ("1", True):  # wrong types: TypeError (True was taken as 1 s)
            with pytest.raises(TypeError):
                mgr.submit_nowait(STORE, timeout=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="default_timeout"):
        OffloadingQueueManager(default_timeout=0)
    with pytest.raises(TypeError, match="default_timeout"):
        OffloadingQueueManager(default_timeout=True)
    with pytest.raises(ValueError):
        OffloadingQueueManager(capacity=0)


async def test_cancel_queued_but_not_in_flight_jobs() -> None:
    fake = FakeHandler(manual=True, max_inflight=1)
    async with OffloadingQueueManager([fake]) as mgr:
        a, b = mgr.submit_nowait(STORE), mgr.submit_nowait(STORE)
        await fake.wait_launched(1)
        assert mgr.cancel(b) is True
        assert mgr.cancel(a) is False
        [rb] = await mgr.wait([b])
        assert isinstance(rb.error, JobCancelledError)
        with pytest.raises(UnknownJobError):
            mgr.cancel(b)
        fake.complete(a)
        await mgr.wait([a])
        assert fake.launched == [a]


async def test_close_drains_queued_and_in_flight_jobs() -> None:
    fake = FakeHandler(latency=0.01, max_inflight=1)
    mgr = OffloadingQueueManager([fake])
    async with mgr:
        ids = [mgr.submit_nowait(STORE) for _ in range(5)]
        leftovers = await mgr.aclose()
    assert_exactly_once(ids, leftovers)
    assert all(r.success for r in leftovers)
    assert fake.closed


async def test_close_cancels_queued_jobs_when_asked() -> None:
    fake = FakeHandler(manual=True, max_inflight=1)
    async with OffloadingQueueManager([fake]) as mgr:
        ids = [mgr.submit_nowait(STORE) for _ in range(4)]
        await fake.wait_launched(1)
        async with anyio.create_task_group() as tg:

            async def closer() -> None:
                results.extend(await mgr.aclose(cancel_queued=True))

            results: list = []
            tg.start_soon(closer)
            await anyio.wait_all_tasks_blocked()
            fake.complete(ids[0])
    assert_exactly_once(ids, results)
    by_id = {r.job_id: r for r in results}
    assert by_id[ids[0]].success
    assert all(isinstance(by_id[j].error, JobCancelledError) for j in ids[1:])
    assert fake.launched == [ids[0]]


async def test_close_timeout_abandons_a_hung_job_and_does_not_hang() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        j = mgr.submit_nowait(STORE)
        await fake.wait_launched(1)
        with anyio.fail_after(5):
            [r] = await mgr.aclose(timeout=0.01)
        assert isinstance(r.error, JobCancelledError)
        assert "abandoned" in str(r.error)
        assert mgr.stats().handlers[0].abandoned == 1
        assert r.job_id == j


async def test_after_close_every_call_raises_and_close_is_idempotent() -> None:
    mgr = OffloadingQueueManager([FakeHandler()])
    async with mgr:
        pass
    assert mgr.closed and mgr.state == "closed"
    assert await mgr.aclose() == []
    with pytest.raises(EngineClosedError):
        mgr.submit_nowait(STORE)
    with pytest.raises(EngineClosedError):
        await mgr.submit(STORE)
    with pytest.raises(EngineClosedError):
        mgr.get_finished()
    with pytest.raises(EngineClosedError):
        await mgr.wait([1])
    with pytest.raises(EngineClosedError):
        mgr.register(FakeHandler(Medium.CPU, Medium.GPU))
    with pytest.raises(EngineClosedError):
        async with mgr:
            pass
    assert mgr.stats().state == "closed"
    assert "closed" in repr(mgr)


async def test_waiter_keeps_its_results_across_close() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        a, b = mgr.submit_nowait(STORE), mgr.submit_nowait(STORE)
        got: list = []
        async with anyio.create_task_group() as tg:

            async def waiter() -> None:
                got.extend(await mgr.wait([a]))

            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            await fake.wait_launched(2)
            fake.complete_all()
            leftovers = await mgr.aclose()
    assert [r.job_id for r in got] == [a]
    assert [r.job_id for r in leftovers] == [b]


async def test_exit_with_an_exception_cancels_queued_jobs_and_reraises() -> None:
    fake = FakeHandler(manual=True, max_inflight=1)
    mgr = OffloadingQueueManager([fake], default_timeout=5)
    with pytest.raises(KeyError):
        async with mgr:
            a, b = mgr.submit_nowait(STORE), mgr.submit_nowait(STORE)
            await fake.wait_launched(1)
            fake.complete(a)
            raise KeyError("boom")
    by_id = {r.job_id: r for r in mgr.leftover_results}
    assert by_id[a].success
    assert isinstance(by_id[b].error, JobCancelledError)


async def test_calls_before_start_raise() -> None:
    mgr = OffloadingQueueManager([FakeHandler()])
    with pytest.raises(EngineNotStartedError):
        mgr.submit_nowait(STORE)
    with pytest.raises(EngineNotStartedError):
        mgr.get_finished()
    assert await mgr.aclose() == []
    assert mgr.closed


async def test_registering_twice_for_a_pair_is_refused() -> None:
    with pytest.raises(HandlerRegistrationError, match="already registered for GPU->CPU"):
        OffloadingQueueManager([FakeHandler(), FakeHandler()])
    with pytest.raises(HandlerRegistrationError):
        OffloadingQueueManager([object()])  # type: ignore[list-item]
    bad = FakeHandler(max_inflight=0)
    with pytest.raises(HandlerRegistrationError, match="max_inflight"):
        OffloadingQueueManager([bad])


async def test_register_on_a_running_engine() -> None:
    async with OffloadingQueueManager([FakeHandler()]) as mgr:
        load = FakeHandler(Medium.CPU, Medium.GPU)
        mgr.register(load)
        assert load.started
        [r] = await mgr.wait([mgr.submit_nowait(LOAD)])
        assert r.success
        with pytest.raises(HandlerRegistrationError):
            mgr.register(FakeHandler(Medium.CPU, Medium.GPU))
        errors: list[BaseException] = []

        def from_thread() -> None:
            try:
                mgr.register(FakeHandler(Medium.NPU, Medium.CPU))
            except WrongThreadError as exc:
                errors.append(exc)

        await anyio.to_thread.run_sync(from_thread)
        assert len(errors) == 1


async def test_submit_and_drain_from_other_threads() -> None:
    async with OffloadingQueueManager([FakeHandler(latency=0.001)], capacity=10_000) as mgr:
        submitted: list[int] = []
        lock = threading.Lock()

        def producer() -> None:
            for _ in range(200):
                j = mgr.submit_nowait(STORE)
                with lock:
                    submitted.append(j)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(anyio.to_thread.run_sync, producer)
        results = await mgr.wait(submitted)
        assert_exactly_once(submitted, results)
        with pytest.raises(WrongThreadError):
            mgr.wait_blocking([1])
        with pytest.raises(WrongThreadError):
            mgr.submit_blocking(STORE)
        j = mgr.submit_nowait(STORE)
        got = await anyio.to_thread.run_sync(lambda: mgr.wait_blocking([j], timeout=5))
        assert got[0].job_id == j


async def test_await_submit_refuses_other_threads() -> None:
    async with OffloadingQueueManager([FakeHandler()]) as mgr:

        def attempt() -> None:
            anyio.run(mgr.submit, STORE)

        with pytest.raises(WrongThreadError):
            await anyio.to_thread.run_sync(attempt)


async def test_stats_and_repr_show_state() -> None:
    fake = FakeHandler(manual=True, bytes_per_block=100)
    async with OffloadingQueueManager([fake], capacity=8) as mgr:
        assert "running" in repr(mgr)
        ids = [mgr.submit_nowait(STORE) for _ in range(3)]
        await fake.wait_launched(3)
        s = mgr.stats().for_pair(Medium.GPU, Medium.CPU)
        assert (s.submitted, s.in_flight, s.queued, s.capacity) == (3, 3, 0, 8)
        assert "GPU->CPU queued=0 in_flight=3" in repr(mgr)
        fake.complete_all()
        s2 = mgr.stats()
        assert (s2.submitted, s2.succeeded, s2.bytes_moved, s2.results_ready) == (3, 3, 600, 3)
        with pytest.raises(KeyError):
            s2.for_pair(Medium.NPU, Medium.CPU)
        await mgr.wait(ids)


async def test_a_started_manager_that_is_never_closed_warns() -> None:
    mgr = OffloadingQueueManager([FakeHandler()])
    async with mgr:
        with pytest.warns(ResourceWarning, match="never closed"):
            mgr.__del__()
    mgr.__del__()  # closed: silent (any warning would fail under filterwarnings=error)
    OffloadingQueueManager([FakeHandler()]).__del__()  # never started: silent


async def test_no_engine_task_outlives_close() -> None:
    before = len(anyio.get_running_tasks())
    fake = FakeHandler(latency=0.001)
    async with OffloadingQueueManager([fake, FakeHandler(Medium.CPU, Medium.GPU)]) as mgr:
        # one task per handler, the timer, and the fake's own timer task
        assert len(anyio.get_running_tasks()) == before + 4
        await mgr.wait([mgr.submit_nowait(STORE, timeout=5)])
    assert len(anyio.get_running_tasks()) == before


class _ReportedWhenPolled(FakeHandler):
    """Holds each finished job until polled, or reports it at once while someone
    waits: polled completion written on the contract's wait hooks alone."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.waiting = 0
        self.calls: list[str] = []

    def launch(self, job: LaunchedJob[int]) -> None:
        super().launch(job)
        if self.waiting:
            self.complete_all()

    def poll(self) -> None:
        self.calls.append("poll")
        self.complete_all()

    def begin_wait(self) -> None:
        self.calls.append("begin")
        self.waiting += 1
        self.complete_all()

    def end_wait(self) -> None:
        self.calls.append("end")
        self.waiting -= 1


async def test_a_handler_on_the_wait_hooks_alone_is_polled_and_hooked_around_each_wait() -> None:
    handler = _ReportedWhenPolled()
    assert hooks_waits(handler) and not hooks_waits(FakeHandler())
    async with OffloadingQueueManager([handler], capacity=1) as mgr:
        first = await mgr.submit(STORE)
        await handler.wait_launched(1)
        assert [r.job_id for r in mgr.get_finished()] == [first]
        assert handler.calls == ["poll"]
        second = await mgr.submit(STORE)
        await handler.wait_launched(2)
        with anyio.fail_after(10):  # the only place is held by a job only a hook reports
            third = await mgr.submit(STORE)
        assert handler.calls[1:] == ["begin", "end"]
        with anyio.fail_after(10):
            results = await mgr.wait([second, third])
        assert [r.job_id for r in results] == [second, third]
        assert handler.calls[3] == "begin" and handler.calls[-1] == "end"
        fourth = await mgr.submit(STORE)
        await handler.wait_launched(4)
    # close waits on the fourth job through the hooks, and ends that wait
    assert [r.job_id for r in mgr.leftover_results] == [fourth]
    assert handler.calls[-2:] == ["begin", "end"] and handler.waiting == 0
