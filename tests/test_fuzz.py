"""Fuzzing the public entry points with invalid values.

Every invalid input gets a typed error (an ``OffloadError`` subclass, or ``TypeError`` /
``ValueError`` where documented), never a crash or a hang, and the engine keeps serving valid
jobs afterwards.
"""

from __future__ import annotations

import math

import anyio
import pytest

from offload_engine import (
    EngineClosedError,
    EngineNotStartedError,
    HandlerRegistrationError,
    OffloadingQueueManager,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.testing import FakeHandler, assert_exactly_once

STORE = TransferSpec(gpu_blocks([1, 2]), cpu_blocks([3, 4]))
BOUND = 10.0


@pytest.mark.parametrize(
    ("bad", "error"),
    [(math.nan, ValueError), ("1", TypeError), (True, TypeError), (object(), TypeError)],
)
def test_bad_wait_timeouts_are_refused_instead_of_hanging(bad: object, error: type) -> None:
    """Regression: ``wait(ids, timeout=nan)`` and ``submit(..., wait_timeout=nan)`` blocked
    forever (NaN compares false with every deadline); ``True`` waited one second."""
    fake = FakeHandler(manual=True)
    with SyncOffloadingEngine([fake], capacity=1) as engine:
        j = engine.submit_nowait(STORE)
        fake.wait_launched_blocking(1)
        with pytest.raises(error):
            engine.wait([j], timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(error):
            engine.submit(STORE, wait_timeout=bad)  # type: ignore[arg-type]
        fake.complete(j)
        [r] = engine.wait([j], timeout=BOUND)  # the refused wait left no claim behind
        assert r.success


@pytest.mark.parametrize(("bad", "error"), [(math.nan, ValueError), ("x", TypeError)])
def test_a_bad_close_timeout_is_refused_before_the_engine_closes(bad: object, error: type) -> None:
    """Regression: ``close(timeout="x")`` closed the engine, failed its jobs, then raised, so
    their results were never delivered to anyone."""
    fake = FakeHandler(manual=True, max_inflight=1)
    engine = SyncOffloadingEngine([fake])
    ids = [engine.submit_nowait(STORE) for _ in range(3)]
    fake.wait_launched_blocking(1)
    with pytest.raises(error):
        engine.close(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(error):
        engine.manager.wait_blocking(ids, timeout=bad)  # type: ignore[arg-type]
    assert not engine.closed and engine.stats().state == "running"
    fake.complete(ids[0])
    fake.wait_launched_blocking(2)
    fake.complete(ids[1])
    leftovers = engine.close(cancel_queued=True, timeout=0.01)
    assert_exactly_once(ids, leftovers)
    assert [r.success for r in leftovers] == [True, True, False]


@pytest.mark.anyio
async def test_aclose_refuses_a_bad_timeout_and_stays_usable() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        j = mgr.submit_nowait(STORE)
        for bad in (math.nan, "soon", True):
            with pytest.raises((TypeError, ValueError)):
                await mgr.aclose(timeout=bad)  # type: ignore[arg-type]
            with pytest.raises((TypeError, ValueError)):
                await mgr.wait([j], timeout=bad)  # type: ignore[arg-type]
        assert mgr.state == "running"
        await fake.wait_launched(1)
        fake.complete(j)
        [r] = await mgr.wait([j], timeout=BOUND)
        assert r.success


@pytest.mark.anyio
async def test_calls_in_the_wrong_state_get_state_errors() -> None:
    """Regression: ``cancel`` on a closed (or never started) manager raised
    ``UnknownJobError`` instead of the state error every other call raises."""
    mgr = OffloadingQueueManager([FakeHandler()])
    for call in (lambda: mgr.submit_nowait(STORE), mgr.get_finished, lambda: mgr.cancel(0)):
        with pytest.raises(EngineNotStartedError):
            call()
    async with mgr:
        [r] = await mgr.wait([mgr.submit_nowait(STORE)], timeout=BOUND)
        assert r.success
    for call in (
        lambda: mgr.submit_nowait(STORE),
        lambda: mgr.submit_blocking(STORE),
        mgr.get_finished,
        lambda: mgr.wait_blocking([0]),
        lambda: mgr.cancel(0),
    ):
        with pytest.raises(EngineClosedError):
            await anyio.to_thread.run_sync(call)  # blocking calls refuse the loop thread
    with pytest.raises(EngineClosedError):
        await mgr.submit(STORE)
    with pytest.raises(EngineClosedError):
        await mgr.wait([0])


@pytest.mark.parametrize("attr", ["src", "dst"])
@pytest.mark.parametrize("bad", [None, "GPU", 3])
def test_a_handler_without_media_is_refused_with_a_registration_error(
    attr: str, bad: object
) -> None:
    """Regression: building the HandlerRegistrationError's message formatted the handler's
    repr, which formats its media, so an AttributeError escaped instead."""
    handler = FakeHandler()
    setattr(handler, attr, bad)
    with pytest.raises(HandlerRegistrationError, match="must be Medium members"):
        OffloadingQueueManager([handler])
