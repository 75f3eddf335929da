"""SyncOffloadingEngine: a private loop thread behind plain methods."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from offload_engine import (
    EngineBrokenError,
    EngineClosedError,
    HostCopyHandler,
    JobCancelledError,
    Medium,
    QueueFullError,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
)
from offload_engine.testing import (
    FakeHandler,
    assert_exactly_once,
    cache_block_bytes,
    engine_threads,
    poisoned_tier,
    random_host_cache,
)

STORE = TransferSpec(gpu_blocks([1]), cpu_blocks([2]))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_submit_drain_wait_close(backend: str) -> None:
    with SyncOffloadingEngine([FakeHandler(latency=0.001)], backend=backend) as engine:
        assert len(engine_threads()) >= 1
        ids = [engine.submit_nowait(STORE) for _ in range(20)]
        results = engine.wait(ids[:10])
        assert [r.job_id for r in results] == ids[:10]
        rest = engine.wait(ids[10:])
        assert_exactly_once(ids, results + rest)
        assert engine.get_finished() == []
        assert backend in repr(engine)
    assert engine.closed
    assert engine_threads() == []


def test_host_round_trip_through_the_facade() -> None:
    _, layout = random_host_cache(num_blocks=16, seed=9)
    tier = poisoned_tier(layout, 8, factor=2)
    before = {b: cache_block_bytes(layout, b) for b in (2, 3)}
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)]) as engine:
        s = engine.submit_nowait(TransferSpec(host_cache_blocks([2, 3]), cpu_blocks([6])))
        [r] = engine.wait([s])
        assert r.success and r.bytes_moved == 2 * layout.slot_bytes
        ld = engine.submit_nowait(TransferSpec(cpu_blocks([6]), host_cache_blocks([10, 11])))
        [r2] = engine.wait([ld])
        assert r2.success
    assert cache_block_bytes(layout, 10) == before[2]
    assert cache_block_bytes(layout, 11) == before[3]


def test_get_finished_never_blocks_on_a_transfer() -> None:
    fake = FakeHandler(manual=True)
    with SyncOffloadingEngine([fake]) as engine:
        j = engine.submit_nowait(STORE)
        fake.wait_launched_blocking(1)
        t0 = time.perf_counter()
        assert engine.get_finished() == []
        assert time.perf_counter() - t0 < 0.5
        fake.complete(j)
        assert [r.job_id for r in engine.wait([j])] == [j]


def test_many_threads_submit_and_each_job_gets_one_result() -> None:
    with SyncOffloadingEngine([FakeHandler()], capacity=100_000) as engine:
        submitted: list[int] = []
        lock = threading.Lock()

        def producer() -> None:
            for _ in range(500):
                j = engine.submit_nowait(STORE)
                with lock:
                    submitted.append(j)

        threads = [threading.Thread(target=producer) for _ in range(4)]
        for t in threads:
            t.start()
        collected = []
        for t in threads:
            t.join()
        collected.extend(engine.get_finished())
        pending = sorted(set(submitted) - {r.job_id for r in collected})
        collected.extend(engine.wait(pending))
        assert_exactly_once(submitted, collected)


def test_blocking_submit_waits_for_room_and_nowait_raises() -> None:
    fake = FakeHandler(manual=True)
    with SyncOffloadingEngine([fake], capacity=1) as engine:
        a = engine.submit_nowait(STORE)
        with pytest.raises(QueueFullError):
            engine.submit_nowait(STORE)
        with pytest.raises(QueueFullError):
            engine.submit(STORE, wait_timeout=0.01)
        fake.wait_launched_blocking(1)
        threading.Timer(0.02, fake.complete, args=(a,)).start()
        b = engine.submit(STORE, wait_timeout=10)
        fake.wait_launched_blocking(2)
        fake.complete(b)
        assert len(engine.wait([a, b])) == 2


def test_wait_timeout_raises_and_close_cancels_queued() -> None:
    fake = FakeHandler(manual=True, max_inflight=1)
    engine = SyncOffloadingEngine([fake])
    a, b = engine.submit_nowait(STORE), engine.submit_nowait(STORE)
    with pytest.raises(TimeoutError):
        engine.wait([a], timeout=0.01)
    fake.wait_launched_blocking(1)
    threading.Timer(0.02, fake.complete, args=(a,)).start()
    leftovers = engine.close(cancel_queued=True)
    by_id = {r.job_id: r for r in leftovers}
    assert by_id[a].success
    assert isinstance(by_id[b].error, JobCancelledError)
    assert engine.close() == []
    for call in (
        engine.get_finished,
        lambda: engine.submit_nowait(STORE),
        lambda: engine.wait([a]),
    ):
        with pytest.raises(EngineClosedError):
            call()
    assert engine.stats().state == "closed"


def test_cancel_through_the_facade() -> None:
    fake = FakeHandler(manual=True, max_inflight=1)
    with SyncOffloadingEngine([fake]) as engine:
        a, b = engine.submit_nowait(STORE), engine.submit_nowait(STORE)
        fake.wait_launched_blocking(1)
        assert engine.cancel(b) is True
        assert engine.cancel(a) is False
        fake.complete(a)
        results = engine.wait([a, b])
        assert results[0].success and not results[1].success


def test_closing_with_a_hung_job_is_bounded() -> None:
    fake = FakeHandler(manual=True)
    engine = SyncOffloadingEngine([fake])
    engine.submit_nowait(STORE)
    fake.wait_launched_blocking(1)
    t0 = time.monotonic()
    [r] = engine.close(timeout=0.05)
    assert time.monotonic() - t0 < 5
    assert isinstance(r.error, JobCancelledError)
    assert engine_threads() == []


def test_an_engine_never_closed_warns_and_its_thread_can_still_be_stopped() -> None:
    engine = SyncOffloadingEngine([FakeHandler()])
    host = engine._host
    with pytest.warns(ResourceWarning, match="never closed"):
        del engine
        gc.collect()
    host.close()
    assert engine_threads() == []


def test_a_dead_loop_thread_is_reported_as_broken() -> None:
    engine = SyncOffloadingEngine([FakeHandler()])
    engine._host.close()  # the loop thread ends underneath the facade
    with pytest.raises(EngineBrokenError):
        engine.submit_nowait(STORE)
    engine.close()


def test_startup_failure_raises_and_leaves_no_thread() -> None:
    class Broken(FakeHandler):
        def start(self, context: object) -> None:  # type: ignore[override]
            raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="no device"):
        SyncOffloadingEngine([Broken(Medium.GPU, Medium.CPU)])
    assert engine_threads() == []


def test_bad_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend"):
        SyncOffloadingEngine([], backend="curio")  # type: ignore[arg-type]
