"""OffloadingQueueManager: routing, per-handler tasks, queues, timeouts, close.

Threads and loops
-----------------
The manager lives in one event loop (the caller's, or the sync facade's
private one). Its tasks, all on that loop: one per handler (launches queued
jobs) and one timer (expires deadlines). Every public method except the
``async`` ones may be called from **any** thread.

Concepts kept in their own private modules: the state under the engine's one
lock and the submit, report and settle transitions of a job
(:mod:`offload_engine.engine._core`), the job record and a route's queue and
counters (:mod:`offload_engine.engine._jobs`), waiting for room in a full
route (:mod:`offload_engine.engine._room`), the engine's tasks and their
supervision (:mod:`offload_engine.engine._tasks`), the handlers' wait hooks
(:mod:`offload_engine.engine._waits`), the deadline heap and wake-up batching.
This module keeps the public surface: registration, the lifecycle and close
sequence, submit, cancel and the ways to collect results.

Every wait of the engine on jobs (``wait``, ``wait_blocking``, ``async for``,
a submit waiting for room, a route out of room in flight, close) runs the
handlers' wait hooks around it, and ``get_finished`` and a deadline coming due
poll them; a submit that finds its route idle may launch the job itself. Both
are the handler contract's fast paths (:mod:`offload_engine.engine.handler`),
and with handlers that take neither, the same calls cost an empty loop.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel

from offload_engine._checks import check_int
from offload_engine._loop import LoopBridge
from offload_engine.engine._core import CLOSED, CLOSING, NEW, RUNNING, Core
from offload_engine.engine._jobs import QUEUED, Route
from offload_engine.engine._room import wait_for_room, wait_for_room_blocking
from offload_engine.engine._tasks import Tasks, route_main, timer_main
from offload_engine.engine.completions import (
    CompletionStore,
    check_job_id,
    check_job_timeout,
    check_wait_timeout,
)
from offload_engine.engine.handler import (
    LoopCaller,
    TransferHandler,
    claim_handler,
    registrable_pair,
    release_handler,
    retire_handler,
)
from offload_engine.engine.stats import EngineStats
from offload_engine.errors import (
    ConfigError,
    EngineBrokenError,
    EngineClosedError,
    EngineNotStartedError,
    HandlerRegistrationError,
    JobCancelledError,
    QueueFullError,
    UnknownJobError,
    WrongThreadError,
)
from offload_engine.vocabulary import Medium, TransferResult, TransferSpec


class _ResultIterator:
    """A plain async iterator (not a generator, so abandoning it with ``break``
    leaves nothing to finalize)."""

    __slots__ = ("_core", "_store")

    def __init__(self, core: Core, store: CompletionStore) -> None:
        self._core = core
        self._store = store

    def __aiter__(self) -> _ResultIterator:
        return self

    async def __anext__(self) -> TransferResult:
        await anyio.lowlevel.checkpoint()
        waits = self._core.waits
        waits.begin()
        try:
            result = await self._store.next_result()
        finally:
            waits.end()
        if result is None:
            raise StopAsyncIteration
        return result


@dataclass(frozen=True)
class _Context:
    call_soon: LoopCaller
    start_task: Callable[..., None]


class OffloadingQueueManager:
    """Routes transfer jobs to one handler per (source, destination) medium pair.

    Use it inside a running asyncio or trio loop::

        async with OffloadingQueueManager([handler], capacity=1024) as mgr:
            job = mgr.submit_nowait(spec)
            [result] = await mgr.wait([job])

    ``capacity`` caps queued + in-flight jobs per handler (backpressure):
    ``submit_nowait`` raises :class:`QueueFullError` at the cap and ``await
    submit`` waits. ``default_timeout`` (seconds) applies to jobs submitted
    without their own ``timeout``. Leaving the ``async with`` block drains
    every job (or, if the block raised, cancels queued jobs and drains the
    in-flight ones) and closes the handlers. Call :meth:`aclose` to choose.
    """

    def __init__(
        self,
        handlers: Iterable[TransferHandler[Any]] = (),
        *,
        capacity: int = 4096,
        default_timeout: float | None = None,
    ) -> None:
        check_int(capacity, "capacity", error=ValueError)
        default_timeout = check_job_timeout(
            default_timeout, what="default_timeout", error=ConfigError
        )
        core = self._core = Core(capacity, default_timeout)
        self._lock = core.lock
        self._store = core.store
        self._registering: set[tuple[Medium, Medium]] = set()
        self._bridge: LoopBridge | None = None
        self._tasks = Tasks(core)
        self._closed_event: anyio.Event | None = None
        #: results nobody collected when ``async with`` closed the engine, or when
        #: :meth:`aclose` raised a handler's close error
        self.leftover_results: tuple[TransferResult, ...] = ()
        try:
            for handler in handlers:
                self.register(handler)
        except BaseException:
            self._release_handlers()
            raise

    @property
    def crash(self) -> BaseException | None:
        """What crashed one of the engine's tasks (the engine is broken then), or None."""
        return self._core.crash

    # ------------------------------------------------------------ registration

    def register(self, handler: TransferHandler[Any]) -> None:
        """Add ``handler`` for its medium pair, before start or on the loop thread."""
        pair = registrable_pair(handler)
        core = self._core
        with self._lock:
            if core.state in (CLOSING, CLOSED):
                raise EngineClosedError("cannot register a handler on a closed engine")
            if core.crash is not None:
                raise EngineBrokenError("the engine is broken") from core.crash
            running = core.state == RUNNING
            if running and not self._on_loop():
                raise WrongThreadError("register handlers on a running engine from its loop thread")
            if pair in core.routes or pair in self._registering:
                held = core.routes.get(pair)
                raise HandlerRegistrationError(
                    f"a handler is already registered for {pair[0].value}->{pair[1].value}: "
                    f"{held.handler if held is not None else 'one being started'!r}"
                )
            claim_handler(handler, self)
            route = Route(handler, core.capacity)
            if not running:
                core.add_route_locked(pair, route)
                return
            # Started before it is routable: until start() returns, a submit for this
            # pair gets NoHandlerError, and if start() raises, nothing was accepted.
            self._registering.add(pair)
        bridge = self._bridge
        try:
            if bridge is None:  # pragma: no cover - running implies a bridge
                raise EngineNotStartedError("engine has no loop")
            handler.start(_Context(bridge.call_soon, self._tasks.spawn))
        except BaseException:
            with self._lock:
                self._registering.discard(pair)
            release_handler(handler, self)
            raise
        with self._lock:
            self._registering.discard(pair)
            core.add_route_locked(pair, route)
        self._tasks.spawn(route_main, core, route)

    @property
    def handlers(self) -> tuple[TransferHandler[Any], ...]:
        return tuple(r.handler for r in self._core.routes.values())

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> OffloadingQueueManager:
        await anyio.lowlevel.checkpoint()
        core = self._core
        with self._lock:
            if core.state != NEW:
                raise EngineClosedError(f"an engine starts once; this one is {core.state}")
            bridge = self._bridge = core.wakeups.bridge = LoopBridge()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tasks.group = tg
        started: list[TransferHandler[Any]] = []
        try:
            context = _Context(bridge.call_soon, self._tasks.spawn)
            for route in core.routes.values():
                route.handler.start(context)
                started.append(route.handler)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for handler in started:
                    retire_handler(handler)
                    await handler.aclose()
            self._release_handlers()  # those never started may serve another engine
            with self._lock:
                core.state = CLOSED
                self._store.close_locked()
            self._tasks.group = None
            await tg.__aexit__(None, None, None)
            raise
        with self._lock:
            core.state = RUNNING
        self._tasks.spawn(timer_main, core)
        for route in core.routes.values():
            self._tasks.spawn(route_main, core, route)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            closed_before = self._core.state in (CLOSING, CLOSED)
            results = await self.aclose(cancel_queued=exc is not None)
            if not closed_before:  # keep what an earlier, failed aclose left there
                self.leftover_results = tuple(results)
        finally:
            # Our tasks have stopped in aclose, so the group exits at once. It is
            # given no exception: the body's own exception propagates unwrapped.
            tg, self._tasks.group = self._tasks.group, None
            if tg is not None:
                await tg.__aexit__(None, None, None)
        return None

    async def aclose(
        self, *, cancel_queued: bool = False, timeout: float | None = None
    ) -> list[TransferResult]:
        """Stop accepting jobs, finish or cancel the rest, close the handlers.

        With ``cancel_queued`` the jobs not yet launched fail with
        :class:`JobCancelledError`; otherwise they run. In-flight jobs are
        always awaited, for at most ``timeout`` seconds; past that they get a
        failed result (abandoned). Returns every result nobody collected yet
        (results claimed by a running ``wait`` go to that waiter). Idempotent:
        a second call waits for the first and returns ``[]``.

        If a handler fails to close, the engine still ends closed and this
        raises the first such error; the results nobody collected are then
        kept in :attr:`leftover_results` rather than lost.
        """
        # checked before anything changes: a bad value must not close the engine and
        # then lose the results it was about to return
        timeout = check_wait_timeout(timeout)
        results = await self._aclose(cancel_queued, timeout)
        # A checkpoint on every path (an engine already closed returns at once). It
        # comes after the close, as trio's aclose() rule asks: a cancelled close has
        # still closed, and the results it could not return go to leftover_results.
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:
            if results:
                self.leftover_results = tuple(results)
            raise
        return results

    async def _aclose(self, cancel_queued: bool, timeout: float | None) -> list[TransferResult]:
        core = self._core
        with self._lock:
            state = core.state
            if state == CLOSED:
                return []
            if state == CLOSING:
                if self._closed_event is None:
                    self._closed_event = anyio.Event()
                closed_event = self._closed_event
            else:
                closed_event = None
                core.state = CLOSING
        if closed_event is not None:
            with anyio.CancelScope(shield=True):
                await closed_event.wait()
            return []
        if state == NEW:
            return await self._close_unstarted()
        with anyio.CancelScope(shield=True):
            try:
                await self._drain(cancel_queued, timeout)
            finally:
                # Whatever happened above, no job is left without a result and no
                # engine task outlives the close.
                leftovers, errors = await self._finish_close(timeout)
        if errors:
            self.leftover_results = tuple(leftovers)
            raise errors[0]
        return leftovers

    async def _drain(self, cancel_queued: bool, timeout: float | None) -> None:
        """Cancel the queued jobs if asked, then wait (at most ``timeout``) until
        every job has a result."""
        core = self._core
        waits = core.waits  # closing waits on every job
        waits.begin()
        try:
            with self._lock:
                if cancel_queued:
                    for route in core.routes.values():
                        while route.queue:
                            job = route.queue[0]
                            core.resolve_locked(
                                job, JobCancelledError(f"job {job.job_id} cancelled at close")
                            )
                for route in core.routes.values():
                    core.wake_route_locked(route)
                    # tasks and threads waiting for room wake up and find the engine closing
                    route.wake_room_locked(core.todo)
                idle = None
                if core.jobs:
                    idle = core.idle = anyio.Event()
            core.flush()
            if idle is not None:
                with anyio.move_on_after(timeout):
                    await idle.wait()
        finally:
            waits.end()

    async def _finish_close(
        self, timeout: float | None
    ) -> tuple[list[TransferResult], list[BaseException]]:
        """Abandon what is left, stop the tasks, close the handlers; the engine is
        closed then. Returns the results nobody collected and the handlers' close
        errors."""
        core = self._core
        with self._lock:
            core.abandon_all_locked(timeout)
            launches_done = None
            if core.submitter_launches:  # no handler closes under a launch
                launches_done = core.submitter_launches_done = anyio.Event()
        core.flush()
        if launches_done is not None:
            await launches_done.wait()
        await self._tasks.stop()
        errors = await self._close_handlers()
        with self._lock:
            core.state = CLOSED
            leftovers = self._store.drain_locked()
            core.add_todo(self._store.close_locked())
            core.add_todo(self._closed_event)
            self._closed_event = None
        core.flush()
        return leftovers, errors

    async def _close_unstarted(self) -> list[TransferResult]:
        with anyio.CancelScope(shield=True):
            errors = await self._close_handlers()
        with self._lock:
            self._core.state = CLOSED
            self._store.close_locked()
            closed_event, self._closed_event = self._closed_event, None
        if closed_event is not None:
            # No loop bridge exists before start: a second aclose() waiting on this
            # event runs on this same loop, so it is set here, directly.
            closed_event.set()
        if errors:
            raise errors[0]
        return []

    async def _close_handlers(self) -> list[BaseException]:
        errors: list[BaseException] = []
        for route in self._core.routes.values():
            retire_handler(route.handler)
            try:
                await route.handler.aclose()
            except Exception as exc:  # noqa: BLE001 - collected and re-raised after all closed
                errors.append(exc)
        return errors

    def _release_handlers(self) -> None:
        """Let every registered handler go to another engine (this one never ran them)."""
        for route in self._core.routes.values():
            release_handler(route.handler, self)

    @property
    def closed(self) -> bool:
        return self._core.state == CLOSED

    @property
    def state(self) -> str:
        """``new``, ``running``, ``closing`` or ``closed``."""
        return self._core.state

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and core.state in (RUNNING, CLOSING):
            warnings.warn(
                f"{type(self).__name__} was never closed: use 'async with' or aclose()",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )

    def _on_loop(self) -> bool:
        bridge = self._bridge
        return bridge is not None and bridge.in_loop_thread()

    # ------------------------------------------------------------ submit

    def submit_nowait(
        self, spec: TransferSpec, *, job_id: int | None = None, timeout: float | None = None
    ) -> int:
        """Queue ``spec``; return its job id. Never blocks; any thread.

        Raises :class:`QueueFullError` at capacity, and a typed error for bad
        input (no handler, bad ids, duplicate live id). Nothing is queued then.
        """
        core = self._core
        ticket = core.ticket(spec, job_id, timeout)
        with self._lock:
            entry = core.enqueue_locked(*ticket)
        return core.submitted(entry)

    async def submit(
        self, spec: TransferSpec, *, job_id: int | None = None, timeout: float | None = None
    ) -> int:
        """Queue ``spec``, waiting while the handler is at capacity. Loop thread only."""
        await anyio.lowlevel.checkpoint()  # every await is a checkpoint, even when not full
        if not self._on_loop():
            raise WrongThreadError(
                "await submit() on the engine's loop; use submit_nowait elsewhere"
            )
        core = self._core
        ticket = core.ticket(spec, job_id, timeout)
        try:
            with self._lock:
                entry = core.enqueue_locked(*ticket)
        except QueueFullError:
            entry = await wait_for_room(core, ticket)
        return core.submitted(entry)

    def submit_blocking(
        self,
        spec: TransferSpec,
        *,
        job_id: int | None = None,
        timeout: float | None = None,
        wait_timeout: float | None = None,
    ) -> int:
        """Queue ``spec`` from a thread other than the loop's, blocking while full.

        ``wait_timeout`` bounds the wait for room (then :class:`QueueFullError`).
        """
        if self._on_loop():
            raise WrongThreadError("submit_blocking would deadlock on the engine's loop thread")
        wait_timeout = check_wait_timeout(wait_timeout, what="wait_timeout")
        core = self._core
        ticket = core.ticket(spec, job_id, timeout)
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        try:
            with self._lock:
                entry = core.enqueue_locked(*ticket)
        except QueueFullError:
            entry = wait_for_room_blocking(core, ticket, deadline)
        return core.submitted(entry)

    def cancel(self, job_id: int) -> bool:
        """Cancel a queued job: True if it was queued and now has a cancelled
        result; False if it is already in flight or finished. Any thread."""
        job_id = check_job_id(job_id)  # a plain int: no caller code under the lock
        core = self._core
        with self._lock:
            if core.state == NEW:
                raise EngineNotStartedError("enter the engine ('async with') first")
            if core.state == CLOSED:
                raise EngineClosedError("the engine is closed; it has no jobs to cancel")
            job = core.jobs.get(job_id)
            if job is None:
                if self._store.is_live_locked(job_id):
                    return False
                raise UnknownJobError(f"job {job_id} is not live")
            if job.state != QUEUED:
                return False
            core.resolve_locked(job, JobCancelledError(f"job {job_id} cancelled while queued"))
        core.flush()
        return True

    # ------------------------------------------------------------ results

    def get_finished(self) -> list[TransferResult]:
        """Every result not yet collected, in finish order. Never blocks; any thread."""
        core = self._core
        if core.state == NEW:
            raise EngineNotStartedError("enter the engine ('async with') first")
        core.waits.poll()
        return self._store.drain()

    async def wait(
        self, job_ids: Iterable[int], *, timeout: float | None = None
    ) -> list[TransferResult]:
        """Await the results of ``job_ids`` (in that order) and collect them.

        Raises :class:`UnknownJobError` for an id that is not live, and
        ``TimeoutError`` if they are not all in within ``timeout`` seconds
        (the jobs go on; their results stay collectable).
        """
        # A checkpoint even when the results are already in (or the call fails at
        # once): a loop of such awaits must not starve the other tasks. It comes
        # first, so a cancellation there leaves every result where it was.
        await anyio.lowlevel.checkpoint()
        core = self._core
        if core.state == NEW:
            raise EngineNotStartedError("enter the engine ('async with') first")
        waits = core.waits
        waits.begin()
        try:
            return await self._store.wait(job_ids, timeout)
        finally:
            waits.end()

    def wait_blocking(
        self, job_ids: Iterable[int], *, timeout: float | None = None
    ) -> list[TransferResult]:
        """Like :meth:`wait`, blocking a thread other than the loop's."""
        if self._on_loop():
            raise WrongThreadError("wait_blocking would deadlock on the engine's loop thread")
        core = self._core
        if core.state == NEW:
            raise EngineNotStartedError("start the engine first")
        waits = core.waits
        waits.begin()
        try:
            return self._store.wait_blocking(job_ids, timeout)
        finally:
            waits.end()

    def __aiter__(self) -> AsyncIterator[TransferResult]:
        return self.results()

    def results(self) -> AsyncIterator[TransferResult]:
        """Results as they finish, until the engine is closed and empty.

        ``async for result in manager`` is the same. Iterators compete: each
        result goes to one of them (or to ``get_finished``/``wait``).
        """
        if self._core.state == NEW:
            raise EngineNotStartedError("enter the engine ('async with') first")
        return _ResultIterator(self._core, self._store)

    # ------------------------------------------------------------ introspection

    def stats(self) -> EngineStats:
        """A consistent snapshot of every handler's counters (also after close)."""
        core = self._core
        with self._lock:
            return EngineStats(
                state=core.state,
                handlers=tuple(r.snapshot() for r in core.routes.values()),
                results_ready=self._store.ready_count,
            )

    def __repr__(self) -> str:
        core = self._core
        with self._lock:
            routes = ", ".join(
                f"{r.label} queued={len(r.queue)} in_flight={len(r.inflight)}"
                for r in core.routes.values()
            )
            ready = self._store.ready_count
            state = core.state
        backend = f" {self._bridge.backend}" if self._bridge is not None else ""
        return f"<{type(self).__name__} {state}{backend} [{routes}] results_ready={ready}>"
