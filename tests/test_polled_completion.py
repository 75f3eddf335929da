"""Polled completion: a device job found finished by the caller's own poll.

With ``polled_completion`` a device handler reports a finished job when the
engine polls it (``get_finished``, a deadline coming due), and hands its jobs to
the watcher thread only while someone waits (``wait``, ``results``, close, a
full queue, a route out of room). ``FakeRuntime(inline=True)`` does the device
work at launch, so with ``submitter_launch`` a job is done when ``submit``
returns and the tests need no waiting to know it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from offload_engine import (
    ConfigError,
    OffloadingQueueManager,
    SyncOffloadingEngine,
    TransferError,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.plan import DevicePlan
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.testing import FakeDeviceError, FakeRuntime, build_layout, cache_block_bytes

POLLED = {"polled_completion": True, "submitter_launch": True}


@pytest.fixture
def inline() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime(inline=True)
    yield runtime
    runtime.close()


@pytest.fixture
def threaded() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


class _SpyQueue:
    """The watcher's queue, noting the id of every job put on it."""

    def __init__(self, real: Any, seen: list[int]) -> None:
        self.real = real
        self.seen = seen

    def put(self, item: object) -> None:
        job_id = getattr(item, "job_id", None)
        if job_id is not None:
            self.seen.append(job_id)
        self.real.put(item)

    def get(self) -> object:
        return self.real.get()


class Pair:
    """A store and load handler pair over a small flash-attention cache, with a
    record of every job handed to a watcher thread and of the launching threads."""

    def __init__(self, runtime: Any, empty: Any = None, **config: Any) -> None:
        empty = runtime.empty if empty is None else empty
        self.layout = build_layout("flash-attention", empty, num_blocks=8)
        self.tier = pinned_host_tier(runtime, self.layout, 8)
        cfg = DeviceHandlerConfig(
            strategy=config.pop("strategy", CopyStrategy.STAGED),
            staging_bytes=4 * self.layout.slot_bytes,
            **config,
        )
        self.store, self.load = make_device_handlers(runtime, self.layout, self.tier, cfg)
        self.watched: list[int] = []
        self.launched_on: list[str] = []
        for handler in (self.store, self.load):
            self._spy(handler)

    def _spy(self, handler: DeviceCopyHandler) -> None:
        enqueue = handler._enqueue

        def spied_enqueue(plan: DevicePlan) -> None:
            self.launched_on.append(threading.current_thread().name)
            enqueue(plan)

        handler._enqueue = spied_enqueue  # type: ignore[method-assign]
        start = handler.start

        def spied_start(context: Any) -> None:
            start(context)
            handler._launcher.watch_q = _SpyQueue(handler._launcher.watch_q, self.watched)  # type: ignore[assignment]

        handler.start = spied_start  # type: ignore[method-assign]

    @property
    def handlers(self) -> list[DeviceCopyHandler]:
        return [self.store, self.load]

    def release(self) -> None:
        self.tier.release()


def test_the_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="polled_completion"):
        DeviceHandlerConfig(polled_completion=1)  # type: ignore[arg-type]


class _NoQueryRuntime(FakeRuntime):
    """A runtime written before ``DeviceRuntime.query`` existed."""

    query = DeviceRuntime.query  # type: ignore[assignment]


def test_a_runtime_without_query_refuses_polled_completion_only() -> None:
    runtime = _NoQueryRuntime()
    try:
        with pytest.raises(ConfigError, match="non-blocking event query"):
            Pair(runtime, polled_completion=True)
        pair = Pair(runtime)  # the watcher thread needs no query
        assert not pair.store.polled_completion
        pair.release()
    finally:
        runtime.close()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_get_finished_reports_polled_jobs_and_no_other_thread_takes_part(
    inline: FakeRuntime, backend: str
) -> None:
    pair = Pair(inline, **POLLED)
    try:
        with SyncOffloadingEngine(pair.handlers, backend=backend) as engine:
            stored = engine.submit_nowait(TransferSpec(gpu_blocks([1, 2]), cpu_blocks([5, 3])))
            [r] = engine.get_finished()
            assert (r.job_id, r.success) == (stored, True)
            loaded = engine.submit_nowait(TransferSpec(cpu_blocks([5, 3]), gpu_blocks([6, 7])))
            [r] = engine.get_finished()
            assert (r.job_id, r.success) == (loaded, True)
            assert engine.get_finished() == []
        assert pair.watched == []  # the watcher threads never saw a job
        here = threading.current_thread().name
        assert pair.launched_on == [here, here]  # nor did the loop or launcher threads
        assert [cache_block_bytes(pair.layout, b) for b in (6, 7)] == [
            cache_block_bytes(pair.layout, b) for b in (1, 2)
        ]
    finally:
        pair.release()


def test_a_device_error_is_reported_by_the_poll_and_later_jobs_run(inline: FakeRuntime) -> None:
    pair = Pair(inline, strategy=CopyStrategy.DMA, **POLLED)
    try:
        with SyncOffloadingEngine(pair.handlers) as engine:
            inline.fail_next("copy")
            bad = engine.submit_nowait(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
            good = engine.submit_nowait(TransferSpec(gpu_blocks([2]), cpu_blocks([2])))
            r_bad, r_good = engine.get_finished()
        assert r_bad.job_id == bad and isinstance(r_bad.error, TransferError)
        assert isinstance(r_bad.error.__cause__, FakeDeviceError)
        assert r_good.job_id == good and r_good.success
        assert pair.tier.memory[2].numpy().tobytes() == cache_block_bytes(pair.layout, 2)
        assert pair.watched == []
    finally:
        pair.release()


@pytest.mark.parametrize("launch", [{}, {"submitter_launch": True}])
def test_wait_and_close_fall_back_to_the_watcher(threaded: FakeRuntime, launch: Any) -> None:
    pair = Pair(threaded, polled_completion=True, **launch)
    try:
        engine = SyncOffloadingEngine(pair.handlers)
        try:
            ids = [
                engine.submit_nowait(TransferSpec(gpu_blocks([b]), cpu_blocks([b])))
                for b in range(3)
            ]
            assert all(r.success for r in engine.wait(ids))
            later = [
                engine.submit_nowait(TransferSpec(cpu_blocks([b]), gpu_blocks([4 + b])))
                for b in range(3)
            ]
        finally:
            leftover = engine.close()  # nobody polls: close waits for them through the watcher
        assert sorted(r.job_id for r in leftover if r.success) == later
        for b in range(3):
            assert cache_block_bytes(pair.layout, 4 + b) == cache_block_bytes(pair.layout, b)
    finally:
        pair.release()


def test_a_deadline_coming_due_polls_first(inline: FakeRuntime) -> None:
    pair = Pair(inline, **POLLED)
    polled_by_timer = threading.Event()
    poll = pair.store.poll

    def spied_poll() -> None:
        poll()
        if threading.current_thread().name == "offload-engine-loop":
            polled_by_timer.set()

    pair.store.poll = spied_poll  # type: ignore[method-assign]
    try:
        with SyncOffloadingEngine(pair.handlers) as engine:
            job = engine.submit_nowait(TransferSpec(gpu_blocks([1]), cpu_blocks([1])), timeout=0.05)
            # done on the device, never polled by the caller: the timer polls at the
            # deadline, and the job is reported finished, not timed out
            assert polled_by_timer.wait(10)
            [r] = engine.get_finished()
        assert (r.job_id, r.success) == (job, True)
    finally:
        pair.release()


def test_a_submit_waiting_for_room_polls_and_watches(inline: FakeRuntime) -> None:
    pair = Pair(inline, **POLLED)
    try:
        with SyncOffloadingEngine(pair.handlers, capacity=1) as engine:
            first = engine.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
            # the first job is done but unreported, and holds the only place
            second = engine.submit(TransferSpec(gpu_blocks([2]), cpu_blocks([2])), wait_timeout=10)
            assert [r.job_id for r in engine.wait([first, second])] == [first, second]
    finally:
        pair.release()


def test_a_route_out_of_room_gets_its_jobs_reported(inline: FakeRuntime) -> None:
    pair = Pair(inline, max_inflight=1, **POLLED)
    launched = threading.Event()
    enqueue = pair.store._enqueue

    def spied(plan: DevicePlan) -> None:
        enqueue(plan)
        if threading.current_thread().name == "offload-engine-loop":
            launched.set()

    pair.store._enqueue = spied  # type: ignore[method-assign]
    try:
        with SyncOffloadingEngine(pair.handlers) as engine:
            first = engine.submit_nowait(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
            # queued behind the first job, which is done but unpolled: the route task
            # polls (and watches) to make room, then launches it on the loop
            second = engine.submit_nowait(TransferSpec(gpu_blocks([2]), cpu_blocks([2])))
            assert launched.wait(10)
            results = engine.get_finished()
        assert [(r.job_id, r.success) for r in results] == [(first, True), (second, True)]
    finally:
        pair.release()


@pytest.mark.anyio
async def test_async_wait_results_and_full_submit_on_both_loops(inline: FakeRuntime) -> None:
    pair = Pair(inline, **POLLED)
    try:
        async with OffloadingQueueManager(pair.handlers, capacity=1) as mgr:
            first = await mgr.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
            [r] = await mgr.wait([first])
            assert r.success
            second = await mgr.submit(TransferSpec(gpu_blocks([2]), cpu_blocks([2])))
            with anyio.fail_after(10):  # waits for room the unpolled second job holds
                third = await mgr.submit(TransferSpec(gpu_blocks([3]), cpu_blocks([3])))
            seen = []
            with anyio.fail_after(10):
                async for result in mgr:
                    seen.append(result.job_id)
                    if len(seen) == 2:
                        break
            assert seen == [second, third]
    finally:
        pair.release()
