"""Regression tests for the nine defects of issue 16 (an independent black-box probe).

Each test names its defect and fails on the code before its fix. The fuzz
(tests/test_fuzz.py) and stateful (tests/test_stateful.py) suites cover each defect's
class; these pin the instances the probe reported.
"""

from __future__ import annotations

import array
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from offload_engine import (
    CacheBlocks,
    ConfigError,
    EngineBrokenError,
    EngineClosedError,
    HandlerContext,
    HandlerRegistrationError,
    HostCopyHandler,
    HostTier,
    KVLayout,
    LaunchedJob,
    LayoutError,
    Medium,
    NoHandlerError,
    OffloadingQueueManager,
    SyncOffloadingEngine,
    TransferError,
    TransferSpec,
    UnknownJobError,
    WrongThreadError,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
)
from offload_engine.host.handler import HostPlan
from offload_engine.testing import (
    FakeHandler,
    assert_exactly_once,
    cache_block_bytes,
    call_in_thread,
    random_host_cache,
)

STORE = TransferSpec(gpu_blocks([1]), cpu_blocks([1]))
BOUND = 10.0  # seconds: any call here returns far sooner, or it hangs


# ------------------------------------------------------------------- 1 aliasing


def id_buffers() -> Iterator[tuple[str, Any, Callable[[int], None]]]:
    """Writable id buffers of every accepted kind: (name, buffer, set element 0)."""
    t64 = torch.tensor([1, 2], dtype=torch.int64)
    yield "torch int64", t64, lambda v: t64.__setitem__(0, v)
    t32 = torch.tensor([1, 2], dtype=torch.int32)
    yield "torch int32", t32, lambda v: t32.__setitem__(0, v)
    aq = array.array("q", [1, 2])
    yield "array('q')", aq, lambda v: aq.__setitem__(0, v)
    ai = array.array("i", [1, 2])
    yield "array('i')", ai, lambda v: ai.__setitem__(0, v)
    raw = bytearray(np.array([1, 2], dtype=np.int64).tobytes())
    mv = memoryview(raw).cast("q")
    yield "memoryview", mv, lambda v: mv.__setitem__(0, v)
    for dtype in (np.int64, np.int32, np.int16, np.uint8, np.uint64):
        arr = np.array([1, 2], dtype=dtype)
        yield f"numpy {np.dtype(dtype).name}", arr, lambda v, arr=arr: arr.__setitem__(0, v)
    strided = np.array([1, 9, 2, 9], dtype=np.int64)[::2]  # a non-contiguous view
    yield "numpy strided view", strided, lambda v: strided.__setitem__(0, v)
    lst = [1, 2]
    yield "list", lst, lambda v: lst.__setitem__(0, v)


@pytest.mark.parametrize("case", list(id_buffers()), ids=lambda c: c[0])
def test_1_specs_never_alias_the_callers_id_buffer(
    case: tuple[str, Any, Callable[[int], None]],
) -> None:
    """Regression: ``host_cache_blocks(torch.tensor([1]))`` (and array.array, memoryview)
    kept a view of the caller's memory; writing 7 into it changed ``spec.block_ids``."""
    _, buf, set0 = case
    specs = [host_cache_blocks(buf), cpu_blocks(buf), CacheBlocks(Medium.GPU, buf)]
    set0(7)
    for spec in specs:
        assert spec.block_ids.tolist() == [1, 2]
        assert not spec.block_ids.flags.writeable
        with pytest.raises(ValueError):
            spec.block_ids[0] = 5


class GatedHostHandler(HostCopyHandler):
    """A host handler whose worker waits for ``gate`` before each copy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def execute(self, job: LaunchedJob[HostPlan]) -> int:
        if not self.gate.wait(BOUND):
            raise TimeoutError("gate never opened")
        return super().execute(job)


@pytest.mark.parametrize("kind", ["torch", "array", "numpy"])
def test_1_rewriting_the_id_buffer_after_submit_does_not_change_the_copy(kind: str) -> None:
    """Regression: in a real HostCopyHandler run, the job submitted for cache block 1
    copied block 7 (the caller rewrote its id buffer after submit) and reported success."""
    _, layout = random_host_cache(num_blocks=8, num_layers=2)
    tier = HostTier.for_layout(layout, 4)
    tier.memory.zero_()
    handler = GatedHostHandler(layout, tier)
    buf: Any = {
        "torch": torch.tensor([1]),
        "array": array.array("q", [1]),
        "numpy": np.array([1]),
    }[kind]
    with SyncOffloadingEngine([handler]) as engine:
        job = engine.submit_nowait(TransferSpec(host_cache_blocks(buf), cpu_blocks([2])))
        buf[0] = 7  # the serving engine reuses its id buffer for the next step
        handler.gate.set()
        [result] = engine.wait([job], timeout=BOUND)
    assert result.success, result.error
    slot = tier.memory[2, : layout.slot_bytes].numpy().tobytes()
    assert slot == cache_block_bytes(layout, 1)
    assert slot != cache_block_bytes(layout, 7)
    tier.release()


# ------------------------------------------------------------------- 2 caller code under the lock


def test_2_wait_on_an_iterable_that_submits_does_not_deadlock() -> None:
    """Regression: ``e.wait(e.submit_nowait(spec) for _ in range(2))`` consumed the
    iterable under the engine's lock; the submits inside it locked the whole engine up."""
    with SyncOffloadingEngine([FakeHandler()]) as engine:
        results = call_in_thread(lambda: engine.wait(engine.submit_nowait(STORE) for _ in range(2)))
        assert [r.success for r in results] == [True, True]
        assert call_in_thread(engine.get_finished) == []


@pytest.mark.anyio
async def test_2_async_wait_on_an_iterable_that_calls_the_engine() -> None:
    async with OffloadingQueueManager([FakeHandler()]) as mgr:

        def ids() -> Iterator[int]:
            mgr.get_finished()
            mgr.stats()
            yield mgr.submit_nowait(STORE)

        with anyio.fail_after(BOUND):
            [r] = await mgr.wait(ids())
        assert r.success


# ------------------------------------------------------------------- 3 start() raises


class StartFails(FakeHandler):
    def start(self, context: HandlerContext) -> None:
        raise RuntimeError("no device")


@pytest.mark.anyio
async def test_3_a_handler_whose_start_raises_is_rolled_back() -> None:
    """Regression: after ``register()`` re-raised the handler's start error, jobs for its
    pair were still accepted (never launched), and ``aclose()`` waited forever."""
    bad = StartFails(Medium.NPU, Medium.CPU)
    async with OffloadingQueueManager([FakeHandler()]) as mgr:
        with pytest.raises(RuntimeError, match="no device"):
            mgr.register(bad)
        with pytest.raises(NoHandlerError):
            mgr.submit_nowait(TransferSpec(CacheBlocks(Medium.NPU, [1]), cpu_blocks([1])))
        assert len(mgr.handlers) == 1
        [r] = await mgr.wait([mgr.submit_nowait(STORE)])  # the other route still serves
        assert r.success
        with anyio.fail_after(BOUND):
            assert await mgr.aclose() == []
    # rolled back entirely: the handler may now serve another engine
    OffloadingQueueManager([bad])


# ------------------------------------------------------------------- 4 two closes, never started


class SlowClose(FakeHandler):
    async def aclose(self) -> None:
        await anyio.sleep(0.01)  # a handler whose close awaits
        await super().aclose()


@pytest.mark.anyio
async def test_4_two_concurrent_acloses_of_a_never_started_manager_both_return() -> None:
    """Regression: the second ``aclose()`` waited on an event nobody ever set."""
    mgr = OffloadingQueueManager([SlowClose()])
    out: list[list[Any]] = []

    async def close() -> None:
        out.append(await mgr.aclose())

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            tg.start_soon(close)
    assert out == [[], []]
    assert mgr.closed


# ------------------------------------------------------------------- 5 BaseException at launch


class Crash(BaseException):
    """Not an Exception: the route task did not catch it."""


class LaunchCrashes(FakeHandler):
    def launch(self, job: LaunchedJob[int]) -> None:
        if job.job_id == 1:
            raise Crash("launch crashed")
        super().launch(job)


def test_5_a_base_exception_from_launch_breaks_the_engine_and_close_stays_bounded() -> None:
    """Regression: the job never got a result, submits said EngineClosedError instead of
    EngineBrokenError, and ``close(timeout=1)`` was still blocked after 5 s."""
    other = FakeHandler(Medium.NPU, Medium.CPU, manual=True)
    engine = SyncOffloadingEngine([LaunchCrashes(manual=True), other])
    first = engine.submit_nowait(STORE)  # job 0: launched, held
    crashing = engine.submit_nowait(STORE)
    assert crashing == 1
    [r] = call_in_thread(lambda: engine.wait([crashing], timeout=BOUND))
    assert isinstance(r.error, TransferError)
    assert isinstance(r.error.__cause__, Crash)
    with pytest.raises(EngineBrokenError) as info:
        engine.submit_nowait(STORE)
    assert isinstance(info.value.__cause__, Crash)
    assert isinstance(engine.manager.crash, Crash)
    [r0] = engine.wait([first], timeout=BOUND)  # the crashed route's jobs all failed
    assert isinstance(r0.error, TransferError)
    npu = TransferSpec(CacheBlocks(Medium.NPU, [1]), cpu_blocks([1]))
    with pytest.raises(EngineBrokenError):
        engine.submit_nowait(npu)
    t0 = time.monotonic()
    leftovers = call_in_thread(lambda: engine.close(timeout=0.2))
    assert time.monotonic() - t0 < 5
    assert leftovers == []


@pytest.mark.anyio
async def test_5_async_crash_fails_the_routes_jobs_and_close_returns() -> None:
    async with OffloadingQueueManager([LaunchCrashes(manual=True)]) as mgr:
        ids = [mgr.submit_nowait(STORE) for _ in range(4)]  # 0 held, 1 crashes, 2-3 queued
        with anyio.fail_after(BOUND):
            results = await mgr.wait(ids)
        assert all(isinstance(r.error, TransferError) for r in results)
        with pytest.raises(EngineBrokenError):
            await mgr.submit(STORE)
        with anyio.fail_after(BOUND):
            assert await mgr.aclose(timeout=0.1) == []


# ------------------------------------------------------------------- 6 thread identity


def test_6_after_close_a_new_thread_is_not_taken_for_the_loop_thread() -> None:
    """Regression: a new thread reused the exited loop thread's ident, so ``close()``
    raised WrongThreadError instead of returning [], and ``wait_blocking`` raised
    WrongThreadError instead of EngineClosedError."""
    engine = SyncOffloadingEngine([FakeHandler()])
    engine.close()
    for _ in range(3):  # a new thread usually reuses the ident at once
        assert call_in_thread(engine.close) == []
        with pytest.raises(EngineClosedError):
            call_in_thread(lambda: engine.manager.wait_blocking([0]))
        with pytest.raises(EngineClosedError):
            call_in_thread(engine.get_finished)


# ------------------------------------------------------------------- 7 handler lifecycle


def host_handler() -> tuple[HostCopyHandler, HostTier]:
    _, layout = random_host_cache(num_blocks=4, num_layers=1)
    tier = HostTier.for_layout(layout, 4)
    return HostCopyHandler(layout, tier), tier


def test_7_a_handler_serves_one_engine_at_a_time() -> None:
    """Regression: one HostCopyHandler was accepted by two live engines; closing the
    first stopped the second one's worker, so its jobs timed out and its close blocked."""
    handler, tier = host_handler()
    spec = TransferSpec(host_cache_blocks([1]), cpu_blocks([1]))
    with SyncOffloadingEngine([handler]) as first:
        with pytest.raises(HandlerRegistrationError, match="another engine"):
            SyncOffloadingEngine([handler])
        with pytest.raises(HandlerRegistrationError, match="another engine"):
            OffloadingQueueManager([handler])
        [r] = first.wait([first.submit_nowait(spec)], timeout=BOUND)
        assert r.success
    tier.release()


def test_7_a_closed_handler_is_refused() -> None:
    """Regression: an already-closed handler was accepted by a new engine, and every job
    then failed with ``IndexError('tuple index out of range')``."""
    handler, tier = host_handler()
    SyncOffloadingEngine([handler]).close()
    with pytest.raises(HandlerRegistrationError, match="closed"):
        SyncOffloadingEngine([handler])
    fake = FakeHandler()
    anyio.run(OffloadingQueueManager([fake]).aclose)  # closed without ever starting
    with pytest.raises(HandlerRegistrationError, match="closed"):
        OffloadingQueueManager([fake])
    tier.release()


def test_7_an_engine_that_never_ran_lets_its_handlers_go() -> None:
    handler = FakeHandler()
    with pytest.raises(HandlerRegistrationError):
        OffloadingQueueManager([handler, handler])  # a second handler for the same pair
    unused = OffloadingQueueManager([handler])  # the failed constructor let it go
    del unused  # never started, garbage: the handler is free again
    import gc

    gc.collect()
    with SyncOffloadingEngine([handler]) as engine:
        [r] = engine.wait([engine.submit_nowait(STORE)], timeout=BOUND)
        assert r.success


# ------------------------------------------------------------------- 8 timeouts


@pytest.mark.parametrize("huge", [math.inf, 1e10, 1e300])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_8_infinite_and_huge_timeouts_mean_no_bound(huge: float, backend: str) -> None:
    """Regression: ``wait(..., timeout=inf)`` and ``submit(..., wait_timeout=inf)`` raised
    ``OverflowError: timestamp out of range`` (so did 1e10 and 1e300)."""
    fake = FakeHandler(manual=True)
    with SyncOffloadingEngine(
        [fake],
        capacity=1,
        default_timeout=huge,
        backend=backend,  # type: ignore[arg-type]
    ) as engine:
        job = engine.submit_nowait(STORE, timeout=huge)
        fake.wait_launched_blocking(1)
        waiter = threading.Thread(target=lambda: got.extend(engine.wait([job], timeout=huge)))
        got: list[Any] = []
        submitter_out: list[int] = []
        submitter = threading.Thread(
            target=lambda: submitter_out.append(engine.submit(STORE, wait_timeout=huge))
        )
        waiter.start()
        submitter.start()
        fake.complete(job)  # makes the result and the room both waited for
        waiter.join(BOUND)
        submitter.join(BOUND)
        assert not waiter.is_alive() and not submitter.is_alive()
        assert [r.success for r in got] == [True]
        fake.wait_launched_blocking(2)
        fake.complete(submitter_out[0])
        [r] = engine.wait(submitter_out, timeout=huge)
        assert r.success
        assert engine.manager.stats().handlers[0].timed_out == 0


class CloseFromWorker(HostCopyHandler):
    """Calls ``engine.close()`` from inside ``execute``, on its worker thread."""

    engine: SyncOffloadingEngine | None = None
    raised: BaseException | None = None

    def execute(self, job: LaunchedJob[HostPlan]) -> int:
        assert self.engine is not None
        try:
            self.engine.close(timeout=0.5)
        except WrongThreadError as exc:
            self.raised = exc
        return super().execute(job)


def test_8_close_from_a_handler_worker_thread_is_refused() -> None:
    """Regression: ``close()`` from inside a handler's ``execute`` never returned without a
    timeout, and took 2.5 s with ``timeout=0.5``."""
    _, layout = random_host_cache(num_blocks=4, num_layers=1)
    tier = HostTier.for_layout(layout, 4)
    handler = CloseFromWorker(layout, tier)
    engine = SyncOffloadingEngine([handler])
    handler.engine = engine
    t0 = time.monotonic()
    job = engine.submit_nowait(TransferSpec(host_cache_blocks([1]), cpu_blocks([1])))
    [r] = engine.wait([job], timeout=BOUND)
    assert time.monotonic() - t0 < 2
    assert r.success
    assert isinstance(handler.raised, WrongThreadError)
    assert not engine.closed
    engine.close()
    tier.release()


# ------------------------------------------------------------------- 9 validation


def test_9_validation_gaps_get_typed_errors_naming_the_argument() -> None:
    with pytest.raises(LayoutError, match="num_blocks"):
        KVLayout.from_block_tensors([torch.zeros(0, 8)])
    with pytest.raises(LayoutError, match="num_blocks"):  # found by the long fuzz run
        KVLayout.flash_attention([torch.zeros(2, 0, 4)])
    with pytest.raises(TypeError, match="k_layers"):
        KVLayout.separate_kv(torch.zeros(4, 8), torch.zeros(4, 8))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="v_layers"):
        KVLayout.separate_kv([torch.zeros(4, 8)], torch.zeros(4, 8))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="default_timeout"):
        SyncOffloadingEngine(default_timeout=True)  # type: ignore[arg-type]
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ConfigError, match="default_timeout"):
            SyncOffloadingEngine(default_timeout=bad)
    layout = KVLayout.from_block_tensors([torch.zeros(4, 8)])
    for blocks in (2**40, 2**62):  # torch's allocation failure; its size overflow
        with pytest.raises(ConfigError, match="num_blocks"):
            HostTier.for_layout(layout, blocks)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.anyio
async def test_every_public_await_is_a_checkpoint(anyio_backend: str) -> None:
    """Regression: ``await wait(...)`` on results already in, or that raised at once, never
    yielded: 2,000 of them in a row starved a ready task."""

    async def yields(call: Callable[[], Any]) -> None:
        """``await call()`` checks for cancellation and lets other tasks run."""
        if anyio_backend == "trio":
            import trio.testing

            with trio.testing.assert_checkpoints():
                try:
                    await call()
                except (UnknownJobError, ValueError):
                    pass
            return
        ran = [False]

        async def bystander() -> None:
            ran[0] = True

        tg.start_soon(bystander)  # ready: runs at the caller's first yield
        try:
            await call()
        except (UnknownJobError, ValueError):
            pass
        assert ran[0], f"{call} did not yield to the loop"

    async with anyio.create_task_group() as tg:
        mgr = OffloadingQueueManager([FakeHandler()])
        await yields(mgr.__aenter__)
        ready = [mgr.submit_nowait(STORE) for _ in range(2)]
        await mgr.wait(ready[:1])  # launched in order: both are in once the first is
        await yields(lambda: mgr.wait(ready[1:]))  # results already in
        await yields(lambda: mgr.wait([10**9]))  # raises at once
        await yields(lambda: mgr.wait([]))
        await yields(lambda: mgr.submit(STORE))  # room in the queue
        await yields(mgr.results().__anext__)  # the result of that submit, already in
        await yields(mgr.aclose)
        await yields(mgr.aclose)  # already closed
        await yields(lambda: mgr.__aexit__(None, None, None))


@pytest.mark.anyio
async def test_a_cancelled_aclose_still_closes_and_keeps_the_results() -> None:
    async with OffloadingQueueManager([FakeHandler()]) as mgr:
        job = mgr.submit_nowait(STORE)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await mgr.aclose()
        assert scope.cancelled_caught
        assert mgr.closed
        assert [r.job_id for r in mgr.leftover_results] == [job]


@pytest.mark.anyio
async def test_a_loop_of_ready_waits_does_not_starve_other_tasks() -> None:
    async with OffloadingQueueManager([FakeHandler()], capacity=4096) as mgr:
        ticks = [0]
        done = [False]

        async def ticker() -> None:
            while not done[0]:
                ticks[0] += 1
                await anyio.lowlevel.checkpoint()

        ids = [mgr.submit_nowait(STORE) for _ in range(2000)]
        await mgr.wait(ids[-1:])  # an ordered route: every result is in now
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for j in ids[:-1]:
                await mgr.wait([j])  # ready at once
            done[0] = True
        assert ticks[0] >= 1000, f"the ready task ran {ticks[0]} times in 2000 awaits"


def test_exactly_once_still_holds_after_the_fixes() -> None:
    """A smoke run of the fixed paths together: iterable waits, huge timeouts, reuse."""
    fake = FakeHandler()
    with SyncOffloadingEngine([fake], default_timeout=math.inf) as engine:
        submitted: list[int] = []

        def ids() -> Iterator[int]:
            for _ in range(50):
                j = engine.submit_nowait(STORE, timeout=1e300)
                submitted.append(j)
                yield j

        results = call_in_thread(lambda: engine.wait(ids(), timeout=math.inf))
    assert_exactly_once(submitted, results)
