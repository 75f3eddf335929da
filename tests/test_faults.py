"""Fault injection: handlers that raise, misreport or hang; close under load; a full queue.

Each case ends with a failed result for exactly the jobs the fault hits, while the other jobs
complete, and nothing hangs: every wait is bounded and the close is bounded.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Iterator

import anyio
import pytest
import torch

from offload_engine import (
    EngineBrokenError,
    HostCopyHandler,
    HostTier,
    JobCancelledError,
    JobTimeoutError,
    KVLayout,
    Medium,
    OffloadingQueueManager,
    QueueFullError,
    SyncOffloadingEngine,
    ThreadPoolHandler,
    TransferError,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.engine.handler import LaunchedJob
from offload_engine.testing import (
    FakeHandler,
    FakeRuntime,
    Fault,
    FaultPlan,
    FaultyHandler,
    InjectedFault,
    Ledger,
    assert_exactly_once,
    build_layout,
    cache_block_bytes,
)

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


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class GatedHost(HostCopyHandler):
    """Host copies that wait at a gate before moving bytes."""

    def __init__(self, layout: KVLayout, tier: HostTier, *, workers: int) -> None:
        super().__init__(layout, tier, workers=workers)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def execute(self, job: LaunchedJob) -> int:  # type: ignore[type-arg]
        self.entered.set()
        self.gate.wait(BOUND)
        return super().execute(job)


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


# --------------------------------------------------------------------------- mixed faults

MIXED = [Fault.OK, Fault.INSTANT, Fault.FAIL, Fault.RAISE, Fault.LAUNCH_RAISES, Fault.BAD_REPORT]


def check_exact(result: TransferResult, fault: Fault) -> None:
    """No timeouts, cancels or close here: each fault has exactly one outcome."""
    if fault.can_succeed:
        assert result.success and result.bytes_moved == PLAN.nbytes, result
        return
    assert not result.success and isinstance(result.error, TransferError), result
    if fault is Fault.BAD_REPORT:
        assert "invalid byte count" in str(result.error)
    else:
        assert isinstance(result.error.__cause__, InjectedFault), result


PLAN = FaultPlan(Medium.GPU, Medium.CPU)


@pytest.mark.anyio
@pytest.mark.parametrize("ordered", [True, False])
async def test_launch_and_worker_faults_fail_only_their_jobs(ordered: bool) -> None:
    rng = random.Random(7)
    handler = FaultyHandler(PLAN, workers=3, ordered=ordered, max_inflight=5, delay=0.001)
    faults: dict[int, Fault] = {}
    async with OffloadingQueueManager([handler], capacity=8) as mgr:
        for _ in range(300):
            fault = rng.choice(MIXED)
            faults[await mgr.submit(PLAN.spec(fault))] = fault  # waits for room
        results = await mgr.wait(list(faults), timeout=BOUND)
        for r in results:
            check_exact(r, faults[r.job_id])
        stats = mgr.stats().handlers[0]
        assert stats.failed == sum(not f.can_succeed for f in faults.values())
        assert (stats.queued, stats.in_flight) == (0, 0)
    injected = handler.injected
    assert injected.get(Fault.LAUNCH_RAISES, 0) == sum(
        f is Fault.LAUNCH_RAISES for f in faults.values()
    )


def test_faults_from_many_threads_fail_only_their_jobs() -> None:
    handlers = [
        FaultyHandler(PLAN, workers=2, delay=0.0005),
        FaultyHandler(FaultPlan(Medium.CPU, Medium.GPU), workers=1, ordered=False),
    ]
    ledger = Ledger()
    errors: list[BaseException] = []

    def producer(seed: int, engine: SyncOffloadingEngine) -> None:
        rng = random.Random(seed)
        try:
            ids = []
            for _ in range(250):
                h = rng.choice(handlers)
                fault = rng.choice(MIXED)
                jid = engine.submit(h.plan.spec(fault), wait_timeout=BOUND)
                ledger.accepted(jid, fault, nbytes=PLAN.nbytes)
                ids.append((jid, fault))
            results = engine.wait([j for j, _ in ids], timeout=BOUND)
            ledger.collected(results)
            for r, (_, fault) in zip(results, ids, strict=True):
                check_exact(r, fault)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    with SyncOffloadingEngine(handlers, capacity=16) as engine:
        threads = [threading.Thread(target=producer, args=(s, engine)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND * 3)
    if errors:
        raise errors[0]
    report = ledger.report()
    assert report.clean and report.jobs == report.results == 1000, report


def test_lost_completions_end_by_timeout_or_at_close() -> None:
    """A job its handler never reports (a completion that never comes) times out; one without
    a timeout is abandoned at close, and close does not hang on it. The others complete."""
    handler = FaultyHandler(PLAN, workers=2, ordered=False)
    with SyncOffloadingEngine([handler]) as engine:
        timed = engine.submit_nowait(PLAN.spec(Fault.LOST), timeout=0.05)
        untimed = engine.submit_nowait(PLAN.spec(Fault.LOST))
        ok = [engine.submit_nowait(PLAN.spec(Fault.OK)) for _ in range(20)]
        results = engine.wait([timed, *ok], timeout=BOUND)
        assert isinstance(results[0].error, JobTimeoutError)
        assert all(r.success for r in results[1:])
        t0 = time.monotonic()
        [left] = engine.close(timeout=0.05)
        assert time.monotonic() - t0 < BOUND / 2
    assert left.job_id == untimed and isinstance(left.error, JobCancelledError)


# --------------------------------------------------------------------------- close under load


@pytest.mark.anyio
@pytest.mark.parametrize("cancel_queued", [False, True])
async def test_close_during_in_flight_transfers(cancel_queued: bool) -> None:
    """Close while copies are running (held at a gate) and more jobs are queued: in-flight
    jobs finish and move their bytes, queued ones run (or are cancelled), nothing is lost."""
    layout = build_layout("flash-attention", host_empty, num_blocks=32)
    tier = HostTier.for_layout(layout, 32)
    handler = GatedHost(layout, tier, workers=2)
    mgr = OffloadingQueueManager([handler])
    async with mgr:
        ids = [
            mgr.submit_nowait(TransferSpec(host_cache_blocks([b]), cpu_blocks([b])))
            for b in range(12)
        ]
        results: list[TransferResult] = []

        async def closer() -> None:
            results.extend(await mgr.aclose(cancel_queued=cancel_queued))

        async with anyio.create_task_group() as tg:
            await anyio.to_thread.run_sync(handler.entered.wait, BOUND)
            tg.start_soon(closer)
            await anyio.wait_all_tasks_blocked()
            assert mgr.state == "closing"  # the close waits for the in-flight copies
            launched = mgr.stats().handlers[0].in_flight
            assert launched == handler.max_inflight
            handler.gate.set()
    assert_exactly_once(ids, results)
    done = [r.job_id for r in results if r.success]
    if cancel_queued:
        assert len(done) == launched  # exactly the jobs in flight when close began
        assert all(isinstance(r.error, JobCancelledError) for r in results if not r.success)
    else:
        assert done == ids
    for b in done:
        assert bytes(tier.block(b).numpy().tobytes()) == cache_block_bytes(layout, b)


# --------------------------------------------------------------------------- a full queue


def test_a_full_queue_under_load_from_threads() -> None:
    """Capacity 4, four threads: blocking submits wait for room, non-blocking ones get
    QueueFullError and drain results before retrying; the cap is never exceeded and every
    job gets one result."""
    handler = FaultyHandler(PLAN, workers=2, max_inflight=2)
    ledger = Ledger()
    full = [0]
    peak = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def producer(seed: int, engine: SyncOffloadingEngine) -> None:
        rng = random.Random(seed)
        try:
            for i in range(150):
                fault = rng.choice([Fault.OK, Fault.OK, Fault.FAIL])
                if i % 2:
                    jid = engine.submit(PLAN.spec(fault), wait_timeout=BOUND)
                else:
                    while True:
                        try:
                            jid = engine.submit_nowait(PLAN.spec(fault))
                            break
                        except QueueFullError:
                            with lock:
                                full[0] += 1
                            ledger.collected(engine.get_finished())
                ledger.accepted(jid, fault, nbytes=PLAN.nbytes)
                h = engine.stats().handlers[0]
                with lock:
                    peak[0] = max(peak[0], h.queued + h.in_flight)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    with SyncOffloadingEngine([handler], capacity=4) as engine:
        threads = [threading.Thread(target=producer, args=(s, engine)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND * 6)
        ledger.collected(engine.get_finished())
        ledger.collected(engine.close(timeout=BOUND))
    if errors:
        raise errors[0]
    report = ledger.report()
    assert report.clean and report.jobs == 600, report
    assert full[0] > 0, "the queue never filled up"
    assert 0 < peak[0] <= 4


@pytest.mark.anyio
async def test_a_full_queue_under_load_from_tasks() -> None:
    handler = FaultyHandler(PLAN, workers=2, max_inflight=2)
    got: list[int] = []
    async with OffloadingQueueManager([handler], capacity=3) as mgr:

        async def producer() -> None:
            for _ in range(50):
                got.append(await mgr.submit(PLAN.spec(Fault.OK)))

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(producer)
            results = await mgr.wait(got)
    assert len(got) == 400 and all(r.success for r in results)
    assert_exactly_once(got, results)


# --------------------------------------------------------------------------- device faults


@pytest.fixture
def device() -> Iterator[tuple[FakeRuntime, KVLayout, HostTier]]:
    runtime = FakeRuntime()
    layout = build_layout("flash-attention", runtime.empty, num_blocks=32)
    tier = pinned_host_tier(runtime, layout, 32)
    yield runtime, layout, tier
    tier.release()
    runtime.close()


@pytest.mark.parametrize(
    ("kind", "strategy"), [("copy", CopyStrategy.DMA), ("kernel", CopyStrategy.STAGED)]
)
def test_a_failed_device_copy_fails_only_its_job_under_load(
    device: tuple[FakeRuntime, KVLayout, HostTier], kind: str, strategy: CopyStrategy
) -> None:
    """The fault hits whichever copy the runtime enqueues next (a store or a load, from
    the jobs in flight): exactly that job fails, every other one moves the right bytes."""
    runtime, layout, tier = device
    cfg = DeviceHandlerConfig(strategy=strategy, staging_bytes=4 * layout.slot_bytes, streams=3)
    store, load = make_device_handlers(runtime, layout, tier, cfg)
    with SyncOffloadingEngine([store, load]) as engine:
        for r in engine.wait(
            [engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b]))) for b in range(8)],
            timeout=BOUND,
        ):
            assert r.success
        stores = {
            engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b]))): b for b in range(8, 14)
        }
        runtime.fail_next(kind)
        stores |= {
            engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b]))): b for b in range(14, 20)
        }
        loads = {
            engine.submit(TransferSpec(cpu_blocks([b]), gpu_blocks([b + 20]))): b for b in range(8)
        }
        results = engine.wait([*stores, *loads], timeout=BOUND)
    failed = [r for r in results if not r.success]
    assert len(failed) == 1, failed
    assert isinstance(failed[0].error, TransferError)
    for r in results:
        if not r.success:
            continue
        if r.job_id in stores:
            b = stores[r.job_id]
            assert bytes(tier.block(b).numpy().tobytes()) == cache_block_bytes(layout, b)
        else:
            b = loads[r.job_id]
            assert cache_block_bytes(layout, b + 20) == cache_block_bytes(layout, b)


def test_a_hung_device_copy_times_out_and_close_does_not_hang(
    device: tuple[FakeRuntime, KVLayout, HostTier],
) -> None:
    """A copy whose event never completes: its job times out, the jobs chained behind it in
    the same direction time out too, the other direction keeps working, and close returns
    within the handler's close_timeout with every result kept. (The hang hits whichever
    copy the runtime enqueues next: a store's or a load's.)"""
    runtime, layout, tier = device
    cfg = DeviceHandlerConfig(strategy=CopyStrategy.DMA, close_timeout=0.3)
    store, load = make_device_handlers(runtime, layout, tier, cfg)
    engine = SyncOffloadingEngine([store, load])
    for r in engine.wait(
        [engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b]))) for b in range(4)],
        timeout=BOUND,
    ):
        assert r.success
    runtime.hang_next("copy")
    stores = {
        engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b])), timeout=0.3): b
        for b in range(4, 8)
    }
    loads = {
        engine.submit(TransferSpec(cpu_blocks([b]), gpu_blocks([b + 8])), timeout=0.3): b
        for b in range(4)
    }
    results = engine.wait([*stores, *loads], timeout=BOUND)
    failed = {r.job_id for r in results if not r.success}
    assert failed and all(isinstance(r.error, JobTimeoutError) for r in results if not r.success)
    hung_stores = bool(failed & set(stores))
    assert not (failed & set(loads) and hung_stores), "both directions failed"
    for r in results:  # the other direction moved its bytes
        if r.job_id in loads and hung_stores:
            b = loads[r.job_id]
            assert r.success and cache_block_bytes(layout, b + 8) == cache_block_bytes(layout, b)
        if r.job_id in stores and not hung_stores:
            b = stores[r.job_id]
            assert r.success
            assert bytes(tier.block(b).numpy().tobytes()) == cache_block_bytes(layout, b)
    # a job without a timeout, stuck behind the hung copy: abandoned at close
    untimed = engine.submit(
        TransferSpec(gpu_blocks([9]), cpu_blocks([9]))
        if hung_stores
        else TransferSpec(cpu_blocks([0]), gpu_blocks([30]))
    )
    threads = [*store._launcher.threads, *load._launcher.threads]
    t0 = time.monotonic()
    with pytest.raises(EngineBrokenError, match="hung"):
        engine.close(timeout=0.1)
    assert time.monotonic() - t0 < BOUND / 2
    [left] = engine.leftover_results
    assert left.job_id == untimed and isinstance(left.error, JobCancelledError)
    runtime.release_hangs()
    for t in threads:
        t.join(BOUND)
    assert not any(t.is_alive() for t in threads)


# --------------------------------------------------------------------------- the kit itself


def test_the_ledger_catches_lost_duplicate_unexpected_and_impossible_results() -> None:
    def ok(jid: int) -> TransferResult:
        return TransferResult(jid, True, PLAN.nbytes, 0.0)

    def failed(jid: int, error: BaseException) -> TransferResult:
        return TransferResult(jid, False, 0, 0.0, error)

    ledger = Ledger()
    ledger.collected([ok(1)])  # a result recorded before its submission: fine
    for jid in (1, 2, 3, 4, 5):
        ledger.accepted(jid, Fault.OK, nbytes=PLAN.nbytes)
    ledger.accepted(6, Fault.LOST, nbytes=PLAN.nbytes)
    ledger.accepted(7, Fault.FAIL, nbytes=PLAN.nbytes)
    ledger.cancel_confirmed(5)
    ledger.collected([ok(2), ok(3), ok(3)])  # 3 twice
    ledger.collected([failed(5, JobCancelledError("job 5 cancelled while queued"))])
    ledger.collected([ok(6)])  # a lost job cannot succeed
    ledger.collected([failed(7, JobTimeoutError("job 7"))])  # no timeout was given
    ledger.collected([ok(99)])  # never accepted
    # 4 never gets a result
    report = ledger.report()
    assert (report.jobs, report.results) == (7, 8)
    assert (report.lost, report.duplicates, report.unexpected, report.wrong) == (1, 1, 1, 2)
    assert report.cancels_confirmed == report.cancelled_while_queued == 1
    assert not report.clean
    clean = Ledger()
    clean.accepted(1, Fault.FAIL, timed=True, nbytes=2)
    clean.collected([failed(1, JobTimeoutError("job 1"))])
    clean.accepted(1, Fault.FAIL, timed=True, nbytes=2)  # an id reused after collection
    clean.collected([failed(1, TransferError("job 1"))])
    assert clean.report().clean and clean.open_count == 0
