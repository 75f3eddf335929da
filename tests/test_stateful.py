"""Stateful property tests: random interleavings of the engine's calls, checked for
exactly-once delivery, bounded calls, and a clean close.

Two hypothesis state machines drive an engine whose handlers inject faults
(:mod:`offload_engine.testing`): jobs that succeed, fail, raise in a worker or at launch,
misreport, are refused at submit, or are never reported (and end by timeout or close).

* :class:`FacadeMachine` drives a :class:`SyncOffloadingEngine` from three client threads:
  each rule hands one call to one client, so calls from different threads overlap (submit,
  blocking submit, duplicate ids, cancel, wait, drain, stats, close from several threads).
* :class:`AsyncMachine` drives an :class:`OffloadingQueueManager` hosted in an anyio blocking
  portal (asyncio or trio): ``await submit``, ``await wait``, ``async for``, ``aclose`` (also
  twice at once) on the loop, and the thread-safe calls from the driving thread.

Invariants, checked throughout and at teardown: every accepted job gets exactly one result
and that result is possible for the job's fault (:class:`~offload_engine.testing.Ledger`);
every call returns within its bound; after close no engine thread or task is left and later
calls raise ``EngineClosedError``.

CI runs a few seconds of examples; ``--run-slow`` runs the long variants.
"""

from __future__ import annotations

import functools
import itertools
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from offload_engine import (
    DuplicateJobIdError,
    EngineBrokenError,
    EngineClosedError,
    EngineNotRunningError,
    InvalidTransferError,
    Medium,
    NoHandlerError,
    OffloadingQueueManager,
    QueueFullError,
    SyncOffloadingEngine,
    UnknownJobError,
)
from offload_engine.testing import (
    FakeHandler,
    Fault,
    FaultPlan,
    FaultyHandler,
    Ledger,
    call_in_thread,
    engine_threads,
)

BOUND = 5.0  # seconds: slack any single call may take beyond its own timeout
CLIENTS = 3
EXPLICIT_IDS = 1 << 40  # explicit job ids live above the automatic ones

PLANS = (FaultPlan(Medium.GPU, Medium.CPU), FaultPlan(Medium.CPU, Medium.GPU))
CRASH_PLAN = FaultPlan(Medium.NPU, Medium.CPU)  # a route whose launch crashes (issue 16, 5)
FAILED_START = (Medium.REMOTE, Medium.CPU)  # a pair whose handler's start() raises (16, 3)
faults = st.sampled_from(list(Fault))
# inf and huge values mean "no timeout" (issue 16, 8)
timeouts = st.none() | st.sampled_from([0.001, 0.01, 0.05, math.inf, 1e300])
short_waits = st.sampled_from([0.0, 0.005, 0.02])
# Which live job a call targets depends on timing, so rules draw indices (never the ids
# themselves: hypothesis needs draws that do not depend on the engine's state).
picks = st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4)
Job = tuple[int, Fault, float | None, bool]  # route, fault, timeout, explicit id
batches = st.lists(
    st.tuples(st.integers(0, 1), faults, timeouts, st.booleans()), min_size=1, max_size=12
)


def pick(ids: list[int], indices: list[int]) -> list[int]:
    """Distinct members of ``ids`` chosen by ``indices`` (empty if ``ids`` is)."""
    if not ids:
        return []
    return list(dict.fromkeys(ids[i % len(ids)] for i in indices))


class RouteCrash(BaseException):
    """Not an Exception: it crashes the engine's task for its route."""


class CrashingHandler(FaultyHandler):
    """Every launch raises :class:`RouteCrash`: the engine breaks."""

    def launch(self, job: Any) -> None:
        raise RouteCrash(f"job {job.job_id} crashed its route")


class StartFails(FaultyHandler):
    def start(self, context: Any) -> None:
        raise RuntimeError("start failed on purpose")


def make_handlers() -> list[FaultyHandler]:
    # an ordered two-worker route (results held back in launch order), an unordered one,
    # and one that crashes the engine when the crash rule submits to it
    return [
        FaultyHandler(PLANS[0], workers=2, ordered=True, max_inflight=4, delay=0.001),
        FaultyHandler(PLANS[1], workers=1, ordered=False, max_inflight=8),
        CrashingHandler(CRASH_PLAN, workers=1),
    ]


def check_stats(stats: Any) -> str | None:
    for h in stats.handlers:
        if h.queued + h.in_flight > h.capacity or min(h.queued, h.in_flight) < 0:
            return f"queue bounds broken: {h}"
        if h.succeeded + h.failed + h.queued + h.in_flight > h.submitted:
            return f"more outcomes than jobs: {h}"
        if h.cancelled + h.timed_out > h.failed or h.abandoned > h.failed:
            return f"failure counters disagree: {h}"
    return None


class Client:
    """A thread that runs the calls a state machine hands it, one at a time, timing each."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: queue.SimpleQueue[tuple[str, Callable[[], None], float] | None] = (
            queue.SimpleQueue()
        )
        self.errors: list[str] = []
        self.current = "idle"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.calls.get()
            if item is None:
                return
            label, call, bound = item
            self.current = label
            t0 = time.monotonic()
            try:
                call()
            except BaseException:  # noqa: BLE001 - reported to the driving thread
                self.errors.append(f"{self.name} {label}:\n{traceback.format_exc()}")
            took = time.monotonic() - t0
            if took > bound:
                self.errors.append(f"{self.name} {label} took {took:.2f}s (bound {bound:.2f}s)")
            self.current = "idle"

    def give(self, label: str, call: Callable[[], None], bound: float = BOUND) -> None:
        self.calls.put((label, call, bound))

    def sync(self, timeout: float) -> None:
        """Return once every call handed so far has run; fail if one is stuck."""
        done = threading.Event()
        self.give("sync", done.set)
        if not done.wait(timeout):
            raise AssertionError(f"{self.name} stuck in {self.current!r} for over {timeout}s")

    def stop(self, timeout: float) -> None:
        self.calls.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"{self.name} did not stop: stuck in {self.current!r}")


class EngineModel:
    """What both machines share: the ledger, explicit-id allocation, closing state."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.kinds: dict[int, tuple[int, Fault, bool]] = {}  # explicit id -> (route, fault, timed)
        self.resubmitted: set[int] = set()
        self._ids = itertools.count(EXPLICIT_IDS)
        self.closing = False  # set before any close call is issued
        self.broken = False  # set before the crash rule submits its job
        self.threads_before = set(engine_threads())

    def new_id(self, route: int, fault: Fault, timed: bool) -> int:
        jid = next(self._ids)
        self.kinds[jid] = (route, fault, timed)
        return jid

    @staticmethod
    def lost_timeout(
        route: int, fault: Fault, timeout: float | None, default: float | None
    ) -> float | None:
        """A lost job on the ordered route would hold back every later result until close,
        so it gets a timeout there; on the unordered route it may wait for close."""
        if fault is Fault.LOST and route == 0:
            if timeout is None and default is None:
                return 0.05
            if timeout is not None and timeout >= 1e9:  # inf: no timeout, not the default
                return 0.05
        return timeout

    def accepted(self, jid: int, fault: Fault, timed: bool) -> None:
        self.ledger.accepted(jid, fault, timed=timed, nbytes=PLANS[0].nbytes)

    def closed_ok(self, exc: BaseException) -> None:
        """An EngineClosedError is fine once a close was issued, an EngineBrokenError once
        the crash rule ran; either is a bug before."""
        if isinstance(exc, EngineClosedError) and self.closing:
            return
        if isinstance(exc, EngineBrokenError) and self.broken:
            return
        raise exc

    def verify_clean(self, tasks_running: int) -> None:
        report = self.ledger.report()
        assert report.clean, report
        assert tasks_running == 0, f"{tasks_running} engine tasks outlived close"
        left = [t.name for t in engine_threads() if t not in self.threads_before]
        assert left == [], f"engine threads outlived close: {left}"


# --------------------------------------------------------------------------- sync facade


class FacadeMachine(RuleBasedStateMachine):
    """Calls from several threads on the sync facade."""

    def __init__(self) -> None:
        super().__init__()
        self.model = EngineModel()
        self.engine: SyncOffloadingEngine | None = None
        self.clients: list[Client] = []
        self.closed = False
        self.submits = 0

    @initialize(
        capacity=st.sampled_from([2, 8, 64]),
        default_timeout=st.none() | st.just(0.05),
        backend=st.sampled_from(["asyncio", "trio"]),
    )
    def start(self, capacity: int, default_timeout: float | None, backend: str) -> None:
        self.default_timeout = default_timeout
        self.engine = SyncOffloadingEngine(
            make_handlers(),
            capacity=capacity,
            default_timeout=default_timeout,
            backend=backend,  # type: ignore[arg-type]
        )
        self.clients = [Client(f"client-{i}") for i in range(CLIENTS)]

    def running(self) -> bool:
        return self.engine is not None and not self.closed

    @property
    def eng(self) -> SyncOffloadingEngine:
        if self.engine is None:  # pragma: no cover - rules run after start
            raise AssertionError("not started")
        return self.engine

    def _submit_call(
        self,
        route: int,
        fault: Fault,
        timeout: float | None,
        jid: int | None,
        *,
        blocking: bool,
        resubmit: bool = False,
    ) -> Callable[[], None]:
        engine, model = self.eng, self.model
        spec = PLANS[route].spec(fault)
        timed = timeout is not None or self.default_timeout is not None

        def call() -> None:
            try:
                if blocking:
                    got = engine.submit(spec, job_id=jid, timeout=timeout, wait_timeout=0.02)
                else:
                    got = engine.submit_nowait(spec, job_id=jid, timeout=timeout)
            except QueueFullError:
                return
            except InvalidTransferError:
                if fault is not Fault.REFUSED:
                    raise
                return
            except DuplicateJobIdError:
                # a fresh id collides only with a resubmission of it that ran first
                if not resubmit and jid not in model.resubmitted:
                    raise
                return
            except EngineNotRunningError as exc:
                model.closed_ok(exc)
                return
            if fault is Fault.REFUSED:
                raise AssertionError(f"a refused job was accepted as {got}")
            if jid is not None and got != jid:
                raise AssertionError(f"asked for id {jid}, got {got}")
            model.accepted(got, fault, timed)

        return call

    @rule(client=st.integers(0, CLIENTS - 1), batch=batches, blocking=st.booleans())
    @precondition(running)
    def submit(self, client: int, batch: list[Job], blocking: bool) -> None:
        """A batch of jobs from one client thread, while the others do other things."""
        calls = []
        for route, fault, asked, explicit in batch:
            timeout = self.model.lost_timeout(route, fault, asked, self.default_timeout)
            timed = timeout is not None or self.default_timeout is not None
            jid = self.model.new_id(route, fault, timed) if explicit else None
            calls.append(self._submit_call(route, fault, timeout, jid, blocking=blocking))

        def call() -> None:
            for c in calls:
                c()

        self.submits += 1
        self.clients[client].give(f"submit x{len(batch)}", call, bound=len(batch) * BOUND)

    @rule(client=st.integers(0, CLIENTS - 1), index=st.integers(0, 15))
    @precondition(lambda self: self.running() and self.model.kinds)
    def resubmit_an_explicit_id(self, client: int, index: int) -> None:
        """The same id again: refused while live, accepted (same kind) once collected."""
        [jid] = pick(sorted(self.model.kinds)[-16:], [index])
        route, fault, timed = self.model.kinds[jid]
        self.model.resubmitted.add(jid)
        timeout = 0.05 if timed and self.default_timeout is None else None
        self.clients[client].give(
            "resubmit",
            self._submit_call(route, fault, timeout, jid, blocking=False, resubmit=True),
        )

    @rule(client=st.integers(0, CLIENTS - 1), indices=picks)
    @precondition(running)
    def cancel(self, client: int, indices: list[int]) -> None:
        [jid] = pick(self.model.ledger.open_ids(), indices[:1]) or [10**15]
        engine, model = self.eng, self.model

        def call() -> None:
            try:
                if engine.cancel(jid):
                    model.ledger.cancel_confirmed(jid)
            except UnknownJobError:
                pass  # collected meanwhile (or never submitted)
            except EngineNotRunningError as exc:
                model.closed_ok(exc)

        self.clients[client].give("cancel", call)

    @rule(client=st.integers(0, CLIENTS - 1), indices=picks, timeout=short_waits)
    @precondition(running)
    def wait(self, client: int, indices: list[int], timeout: float) -> None:
        ids = pick(self.model.ledger.open_ids(), indices)
        if not ids:
            return
        engine, model = self.eng, self.model

        def call() -> None:
            try:
                results = engine.wait(ids, timeout=timeout)
            except (TimeoutError, UnknownJobError):
                return  # still running / collected or claimed by another client
            except EngineNotRunningError as exc:
                model.closed_ok(exc)
                return
            if [r.job_id for r in results] != ids:
                raise AssertionError(f"wait({ids}) returned {results}")
            model.ledger.collected(results)

        self.clients[client].give("wait", call, bound=timeout + BOUND)

    @rule(client=st.integers(0, CLIENTS - 1))
    @precondition(running)
    def get_finished(self, client: int) -> None:
        engine, model = self.eng, self.model

        def call() -> None:
            try:
                model.ledger.collected(engine.get_finished())
            except EngineNotRunningError as exc:
                model.closed_ok(exc)

        self.clients[client].give("get_finished", call)

    @rule(client=st.integers(0, CLIENTS - 1))
    @precondition(running)
    def stats(self, client: int) -> None:
        engine = self.eng

        def call() -> None:
            problem = check_stats(engine.stats())
            if problem:
                raise AssertionError(problem)

        self.clients[client].give("stats", call)

    @rule()
    @precondition(running)
    def sync_clients(self) -> None:
        for c in self.clients:
            c.sync(BOUND * 2)

    @rule(
        closers=st.integers(1, CLIENTS),
        cancel_queued=st.booleans(),
        timeout=st.sampled_from([0.0, 0.01, 0.1]),
        racing=st.booleans(),
    )
    @precondition(lambda self: self.running() and self.submits >= 4)
    def close(self, closers: int, cancel_queued: bool, timeout: float, racing: bool) -> None:
        """Close from one or several client threads at once, racing the calls handed out
        before (or once they ran)."""
        if not racing:
            for c in self.clients:
                c.sync(BOUND * 2)
        self.model.closing = True
        engine, ledger = self.eng, self.model.ledger

        def call() -> None:
            ledger.collected(engine.close(cancel_queued=cancel_queued, timeout=timeout))
            if not engine.closed:
                raise AssertionError("close() returned on an open engine")

        for c in self.clients[:closers]:
            c.give("close", call, bound=timeout + BOUND)
        for c in self.clients:
            c.sync(timeout + BOUND * 2)
        self.closed = True

    @rule(client=st.integers(0, CLIENTS - 1))
    @precondition(lambda self: self.running() and self.submits >= 4 and not self.model.broken)
    def crash_a_route(self, client: int) -> None:
        """A launch raises a BaseException: the engine breaks; its calls say so, and close
        still returns within its bound (issue 16, 5)."""
        self.model.broken = True  # from now on, any submit may get EngineBrokenError
        engine, model = self.eng, self.model

        def call() -> None:
            try:
                jid = engine.submit_nowait(CRASH_PLAN.spec(Fault.OK))
            except EngineNotRunningError as exc:
                model.closed_ok(exc)
                return
            model.ledger.accepted(jid, Fault.LAUNCH_RAISES, timed=True, nbytes=PLANS[0].nbytes)

        self.clients[client].give("crash", call)

    @rule()
    @precondition(lambda self: self.closed)
    def calls_after_close_raise(self) -> None:
        """Each call from a thread of its own: a new thread may reuse the ident of the
        exited loop thread, and must not pass for it (issue 16, 6)."""
        engine = self.eng
        for call in (
            lambda: engine.submit_nowait(PLANS[0].spec(Fault.OK)),
            lambda: engine.submit(PLANS[0].spec(Fault.OK)),
            engine.get_finished,
            lambda: engine.wait([0], timeout=0),
            lambda: engine.cancel(0),
            lambda: engine.manager.wait_blocking([0], timeout=0),
        ):
            with pytest.raises(EngineClosedError):
                call_in_thread(call)
        assert call_in_thread(engine.close) == []
        assert engine.close() == []
        assert engine.stats().state == "closed"

    @invariant()
    def no_client_failed(self) -> None:
        for c in self.clients:
            assert not c.errors, "\n".join(c.errors)

    def teardown(self) -> None:
        if self.engine is None:
            return
        try:
            for c in self.clients:
                c.sync(BOUND * 2)
            if not self.closed:
                self.model.closing = True
                self.model.ledger.collected(self.engine.close(timeout=0.01))
            for c in self.clients:
                c.stop(BOUND)
            for c in self.clients:
                assert not c.errors, "\n".join(c.errors)
            with pytest.raises(EngineClosedError):
                self.engine.submit_nowait(PLANS[0].spec(Fault.OK))
            self.model.verify_clean(self.engine.manager._tasks.running)
        finally:
            self.engine.close(timeout=0)  # idempotent; stops the loop if a check failed


# --------------------------------------------------------------------------- async API


class AsyncMachine(RuleBasedStateMachine):
    """The async API on the engine's own loop, and thread-safe calls from the driver."""

    backend = "asyncio"

    def __init__(self) -> None:
        super().__init__()
        self.model = EngineModel()
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal(self.backend)
        )
        self.portal = self._portal_cm.__enter__()
        self.mgr: OffloadingQueueManager | None = None
        self._mgr_cm: AbstractContextManager[OffloadingQueueManager] | None = None
        self.closed = False
        self.default_timeout: float | None = None
        self.submits = 0

    def run(
        self, fn: Callable[..., Any], *args: Any, bound: float = BOUND, checkpoint: bool = True
    ) -> Any:
        """Run ``await fn(*args)`` on the loop; fail if it takes longer than ``bound``. On
        trio, also fail unless it executed a checkpoint (issue 16: every public ``await``
        of the engine is one, even when it need not wait)."""

        async def bounded() -> Any:
            with anyio.move_on_after(bound):
                if checkpoint and self.backend == "trio":
                    import trio.testing

                    with trio.testing.assert_checkpoints():
                        return await fn(*args)
                return await fn(*args)
            raise AssertionError(f"{fn} did not return within {bound}s")

        return self.portal.call(bounded)

    @initialize(capacity=st.sampled_from([2, 8, 64]), default_timeout=st.none() | st.just(0.05))
    def start(self, capacity: int, default_timeout: float | None) -> None:
        self.default_timeout = default_timeout
        mgr = OffloadingQueueManager(
            make_handlers(), capacity=capacity, default_timeout=default_timeout
        )
        self._mgr_cm = self.portal.wrap_async_context_manager(mgr)
        self.mgr = self._mgr_cm.__enter__()

    def running(self) -> bool:
        return self.mgr is not None and not self.closed

    @property
    def m(self) -> OffloadingQueueManager:
        if self.mgr is None:  # pragma: no cover
            raise AssertionError("not started")
        return self.mgr

    def _submit_one(self, route: int, fault: Fault, timeout: float | None, how: str) -> None:
        timeout = self.model.lost_timeout(route, fault, timeout, self.default_timeout)
        timed = timeout is not None or self.default_timeout is not None
        spec, mgr = PLANS[route].spec(fault), self.m
        try:
            if how == "await":  # on the loop; waits for room, gives up after a while

                async def submit() -> int | None:
                    with anyio.move_on_after(0.02):
                        return await mgr.submit(spec, timeout=timeout)
                    return None

                jid = self.run(submit)
            elif how == "nowait-on-loop":

                async def nowait() -> int:
                    return mgr.submit_nowait(spec, timeout=timeout)

                jid = self.run(nowait, checkpoint=False)
            elif how == "blocking":
                jid = mgr.submit_blocking(spec, timeout=timeout, wait_timeout=0.02)
            else:
                jid = mgr.submit_nowait(spec, timeout=timeout)
        except QueueFullError:
            return
        except InvalidTransferError:
            assert fault is Fault.REFUSED
            return
        except EngineBrokenError:
            assert self.model.broken
            return
        assert fault is not Fault.REFUSED
        if jid is not None:
            self.model.accepted(jid, fault, timed)

    @rule(batch=batches, how=st.sampled_from(["nowait", "nowait-on-loop", "await", "blocking"]))
    @precondition(running)
    def submit(self, batch: list[Job], how: str) -> None:
        """``submit_nowait`` from this (foreign) thread or the loop, ``await submit`` on the
        loop, or ``submit_blocking`` from this thread."""
        for route, fault, timeout, _ in batch:
            self._submit_one(route, fault, timeout, how)
        self.submits += 1

    @rule()
    @precondition(lambda self: self.running() and self.submits >= 4 and not self.model.broken)
    def crash_a_route(self) -> None:
        """A launch raises a BaseException: the route's jobs fail, the engine is broken
        (issue 16, 5); later submits say so and close stays bounded."""
        self.model.broken = True
        jid = self.m.submit_nowait(CRASH_PLAN.spec(Fault.OK))
        self.model.ledger.accepted(jid, Fault.LAUNCH_RAISES, timed=True, nbytes=PLANS[0].nbytes)

    @rule()
    @precondition(running)
    def register_a_handler_whose_start_raises(self) -> None:
        """Registration on the running engine is rolled back (issue 16, 3)."""
        mgr = self.m
        bad = StartFails(FaultPlan(*FAILED_START))

        async def register() -> None:
            # the start error, or EngineBrokenError (a RuntimeError too) once a crash
            # submitted by the crash rule has happened
            with pytest.raises(RuntimeError) as info:
                mgr.register(bad)
            if not self.model.broken:
                assert not isinstance(info.value, EngineBrokenError)

        self.run(register, checkpoint=False)
        spec = FaultPlan(*FAILED_START).spec(Fault.OK)
        refused = (EngineBrokenError, NoHandlerError) if self.model.broken else NoHandlerError
        with pytest.raises(refused):
            mgr.submit_nowait(spec)

    @rule(closers=st.integers(1, 3))
    def close_a_never_started_engine(self, closers: int) -> None:
        """Concurrent closes of an engine that never started, whose handler's close
        awaits: all return (issue 16, 4)."""

        class SlowClose(FakeHandler):
            async def aclose(self) -> None:
                await anyio.sleep(0.001)

        other = OffloadingQueueManager([SlowClose()])

        async def close_all() -> list[list[Any]]:
            out: list[list[Any]] = []

            async def one() -> None:
                out.append(await other.aclose())

            async with anyio.create_task_group() as tg:
                for _ in range(closers):
                    tg.start_soon(one)
            return out

        assert self.run(close_all) == [[]] * closers
        assert other.closed

    @rule(indices=picks)
    @precondition(running)
    def cancel(self, indices: list[int]) -> None:
        ids = pick(self.model.ledger.open_ids(), indices[:1])
        if not ids:
            return
        [jid] = ids
        # one driver collects everything, so an open id is live: cancel never raises here
        if self.m.cancel(jid):
            self.model.ledger.cancel_confirmed(jid)

    @rule(indices=picks, timeout=short_waits, blocking=st.booleans())
    @precondition(running)
    def wait(self, indices: list[int], timeout: float, blocking: bool) -> None:
        ids = pick(self.model.ledger.open_ids(), indices)
        if not ids:
            return
        try:
            if blocking:
                results = self.m.wait_blocking(ids, timeout=timeout)
            else:
                wait = functools.partial(self.m.wait, ids, timeout=timeout)
                results = self.run(wait, bound=timeout + BOUND)
        except TimeoutError:
            return
        assert [r.job_id for r in results] == ids
        self.model.ledger.collected(results)

    @rule(most=st.integers(1, 8))
    @precondition(running)
    def async_for(self, most: int) -> None:
        async def take() -> list[Any]:
            got: list[Any] = []
            with anyio.move_on_after(0.01):
                async for result in self.m:
                    got.append(result)
                    if len(got) == most:
                        break
            return got

        self.model.ledger.collected(self.run(take))

    @rule()
    @precondition(running)
    def get_finished(self) -> None:
        self.model.ledger.collected(self.m.get_finished())
        problem = check_stats(self.m.stats())
        assert problem is None, problem

    @rule(
        cancel_queued=st.booleans(), timeout=st.sampled_from([0.0, 0.01, 0.1]), twice=st.booleans()
    )
    @precondition(lambda self: self.running() and self.submits >= 4)
    def aclose(self, cancel_queued: bool, timeout: float, twice: bool) -> None:
        """Close on the loop, once or by two tasks at once (the second gets ``[]``)."""
        self.model.closing = True
        mgr = self.m

        async def close_all() -> list[list[Any]]:
            out: list[list[Any]] = []

            async def one() -> None:
                out.append(await mgr.aclose(cancel_queued=cancel_queued, timeout=timeout))

            async with anyio.create_task_group() as tg:
                for _ in range(2 if twice else 1):
                    tg.start_soon(one)
            return out

        batches = self.run(close_all, bound=timeout + BOUND)
        for batch in batches:
            self.model.ledger.collected(batch)
        assert sum(1 for b in batches if b) <= 1, "two closes returned results"
        assert mgr.closed
        self.closed = True

    @rule()
    @precondition(lambda self: self.closed)
    def calls_after_close_raise(self) -> None:
        mgr, spec = self.m, PLANS[0].spec(Fault.OK)
        for call in (
            lambda: mgr.submit_nowait(spec),
            lambda: mgr.submit_blocking(spec),
            mgr.get_finished,
            lambda: mgr.wait_blocking([0], timeout=0),
            lambda: mgr.cancel(0),
        ):
            with pytest.raises(EngineClosedError):
                call()
        with pytest.raises(EngineClosedError):
            self.run(functools.partial(mgr.submit, spec))
        assert self.run(mgr.aclose) == []

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                if not self.closed:
                    self.model.closing = True
                    close = functools.partial(self.m.aclose, timeout=0.01)
                    self.model.ledger.collected(self.run(close))
                assert self._mgr_cm is not None
                self._mgr_cm.__exit__(None, None, None)
                with pytest.raises(EngineClosedError):
                    self.m.submit_nowait(PLANS[0].spec(Fault.OK))
                with pytest.raises(EngineClosedError):
                    self.m.get_finished()
                self.model.verify_clean(self.m._tasks.running)
        finally:
            self._portal_cm.__exit__(None, None, None)


class TrioAsyncMachine(AsyncMachine):
    backend = "trio"


# --------------------------------------------------------------------------- the tests


def machine_settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


MACHINES = [FacadeMachine, AsyncMachine, TrioAsyncMachine]
IDS = ["facade", "async-asyncio", "async-trio"]


@pytest.mark.parametrize("machine", MACHINES, ids=IDS)
def test_random_interleavings_deliver_exactly_once(machine: type) -> None:
    run_state_machine_as_test(machine, settings=machine_settings(12, 40))


@pytest.mark.slow
@pytest.mark.parametrize("machine", MACHINES, ids=IDS)
def test_random_interleavings_deliver_exactly_once_long(machine: type) -> None:
    run_state_machine_as_test(machine, settings=machine_settings(300, 120))
