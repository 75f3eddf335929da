"""OffloadingQueueManager: routing, per-handler tasks, queues, timeouts, close.

Threads and loops
-----------------
The manager lives in one event loop (the caller's, or the sync facade's
private one). Its tasks, all on that loop: one per handler (launches queued
jobs) and one timer (expires deadlines). Every public method except the
``async`` ones may be called from **any** thread.

One ``threading.Lock`` guards all mutable state: queues, in-flight tables,
counters and the result store. Sections under it are short and never await or
call a handler. Work that must happen on the loop (setting an anyio event to
wake a sleeping task) is collected under the lock and set after it, in one
batch (:mod:`offload_engine.engine._wakeups`).

Concepts kept in their own private modules: the job record and a route's
queue and counters (:mod:`offload_engine.engine._jobs`; a job reports through a
callable, not through the manager), the deadline heap
(:mod:`offload_engine.engine._deadlines`) and wake-up batching. This module keeps
registration, the lifecycle and close sequence, task supervision, and the
submit, report and settle transitions.

A sleeping task publishes the event it sleeps on (``route.wake``,
``store._changed``, ...) under the lock after re-checking its condition, and a
waker takes that event under the lock. So no wake-up is lost and no task polls.

Job life: ``QUEUED`` -> ``INFLIGHT`` -> resolved (an outcome is set) -> result
posted. Exactly one outcome wins: the handler's ``succeed``/``fail``, a
timeout, a cancel, or abandonment at close. Later reports are ignored.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.lowlevel

from offload_engine._checks import check_int
from offload_engine._loop import LoopBridge
from offload_engine.engine._deadlines import Deadlines
from offload_engine.engine._jobs import DONE, INFLIGHT, QUEUED, Job, Route
from offload_engine.engine._wakeups import Wakeups
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
    JobTimeoutError,
    NoHandlerError,
    QueueFullError,
    TransferError,
    UnknownJobError,
    WrongThreadError,
)
from offload_engine.vocabulary import Medium, TransferResult, TransferSpec

_NEW: Final = "new"
_RUNNING: Final = "running"
_CLOSING: Final = "closing"
_CLOSED: Final = "closed"

_now = time.perf_counter

# A route task launches this many jobs back to back before it lets other tasks run.
_LAUNCHES_PER_YIELD = 1024


class _ResultIterator:
    """A plain async iterator (not a generator, so abandoning it with ``break``
    leaves nothing to finalize)."""

    __slots__ = ("_manager", "_store")

    def __init__(self, manager: OffloadingQueueManager, store: CompletionStore) -> None:
        self._manager = manager
        self._store = store

    def __aiter__(self) -> _ResultIterator:
        return self

    async def __anext__(self) -> TransferResult:
        await anyio.lowlevel.checkpoint()
        manager = self._manager
        manager._poll()
        manager._watch(1)
        try:
            result = await self._store.next_result()
        finally:
            manager._watch(-1)
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
        self._lock = threading.Lock()
        self._space_cond = threading.Condition(self._lock)
        self._store = CompletionStore(self._lock)
        self._capacity = capacity
        self._default_timeout = default_timeout
        self._routes: dict[tuple[Medium, Medium], Route] = {}
        self._registering: set[tuple[Medium, Medium]] = set()
        self._jobs: dict[int, Job] = {}
        self._state = _NEW
        self._bridge: LoopBridge | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._scopes: list[anyio.CancelScope] = []
        self._tasks_running = 0
        self._tasks_done: anyio.Event | None = None
        self._wakeups = Wakeups(self._lock)
        self._todo = self._wakeups.todo  # the same list, tested on hot paths
        self._flush = self._wakeups.flush
        self._sync_space_waiters = 0
        self._deadlines = Deadlines()
        self._idle: anyio.Event | None = None
        # submitting threads inside a handler's launch, and what close awaits them with
        self._launching_here = 0
        self._here_done: anyio.Event | None = None
        # handlers that report a finished job only when polled, unless watched
        # (TransferHandler.polled_completion); replaced, never mutated
        self._polled: tuple[TransferHandler[Any], ...] = ()
        self._closed_event: anyio.Event | None = None
        #: results nobody collected when ``async with`` closed the engine, or when
        #: :meth:`aclose` raised a handler's close error
        self.leftover_results: tuple[TransferResult, ...] = ()
        #: what crashed one of the engine's tasks (the engine is broken then), or None
        self.crash: BaseException | None = None
        try:
            for handler in handlers:
                self.register(handler)
        except BaseException:
            self._release_handlers()
            raise

    # ------------------------------------------------------------ registration

    def register(self, handler: TransferHandler[Any]) -> None:
        """Add ``handler`` for its medium pair, before start or on the loop thread."""
        if not isinstance(handler, TransferHandler):
            raise HandlerRegistrationError(
                f"handlers implement TransferHandler, got {type(handler).__name__}"
            )
        try:
            pair = (handler.src, handler.dst)
        except AttributeError as exc:
            raise HandlerRegistrationError(f"{type(handler).__name__} lacks src/dst media") from exc
        if not all(isinstance(m, Medium) for m in pair):
            # not {handler!r}: a handler's repr formats its media, which are the problem
            raise HandlerRegistrationError(
                f"{type(handler).__name__}: src and dst must be Medium members, "
                f"got {pair[0]!r} -> {pair[1]!r}"
            )
        check_int(
            handler.max_inflight, f"{handler!r}: max_inflight", error=HandlerRegistrationError
        )
        with self._lock:
            if self._state in (_CLOSING, _CLOSED):
                raise EngineClosedError("cannot register a handler on a closed engine")
            if self.crash is not None:
                raise EngineBrokenError("the engine is broken") from self.crash
            running = self._state == _RUNNING
            if running and not self._on_loop():
                raise WrongThreadError("register handlers on a running engine from its loop thread")
            if pair in self._routes or pair in self._registering:
                held = self._routes.get(pair)
                raise HandlerRegistrationError(
                    f"a handler is already registered for {pair[0].value}->{pair[1].value}: "
                    f"{held.handler if held is not None else 'one being started'!r}"
                )
            claim_handler(handler, self)
            route = Route(handler, self._capacity)
            if not running:
                self._routes[pair] = route
                self._note_polled(handler)
                return
            # Started before it is routable: until start() returns, a submit for this
            # pair gets NoHandlerError, and if start() raises, nothing was accepted.
            self._registering.add(pair)
        bridge = self._bridge
        try:
            if bridge is None:  # pragma: no cover - running implies a bridge
                raise EngineNotStartedError("engine has no loop")
            handler.start(_Context(bridge.call_soon, self._spawn))
        except BaseException:
            with self._lock:
                self._registering.discard(pair)
            release_handler(handler, self)
            raise
        with self._lock:
            self._registering.discard(pair)
            self._routes[pair] = route
            self._note_polled(handler)
        self._spawn(self._route_main, route)

    def _note_polled(self, handler: TransferHandler[Any]) -> None:
        if handler.polled_completion:
            self._polled = (*self._polled, handler)

    def _poll(self) -> None:
        """Let every polled-completion handler report what has finished."""
        for handler in self._polled:
            handler.poll()

    def _watch(self, delta: int) -> None:
        """Someone starts (+1) or stops (-1) waiting: polled-completion handlers
        report unprompted meanwhile. Never under the lock."""
        for handler in self._polled:
            handler.watch(delta)

    @property
    def handlers(self) -> tuple[TransferHandler[Any], ...]:
        return tuple(r.handler for r in self._routes.values())

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> OffloadingQueueManager:
        await anyio.lowlevel.checkpoint()
        with self._lock:
            if self._state != _NEW:
                raise EngineClosedError(f"an engine starts once; this one is {self._state}")
            bridge = self._bridge = self._wakeups.bridge = LoopBridge()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        started: list[TransferHandler[Any]] = []
        try:
            context = _Context(bridge.call_soon, self._spawn)
            for route in self._routes.values():
                route.handler.start(context)
                started.append(route.handler)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for handler in started:
                    retire_handler(handler)
                    await handler.aclose()
            self._release_handlers()  # those never started may serve another engine
            with self._lock:
                self._state = _CLOSED
                self._store.close_locked()
            self._tg = None
            await tg.__aexit__(None, None, None)
            raise
        with self._lock:
            self._state = _RUNNING
        self._spawn(self._timer_main)
        for route in self._routes.values():
            self._spawn(self._route_main, route)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            closed_before = self._state in (_CLOSING, _CLOSED)
            results = await self.aclose(cancel_queued=exc is not None)
            if not closed_before:  # keep what an earlier, failed aclose left there
                self.leftover_results = tuple(results)
        finally:
            # Our tasks have stopped in aclose, so the group exits at once. It is
            # given no exception: the body's own exception propagates unwrapped.
            tg, self._tg = self._tg, None
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
        with self._lock:
            state = self._state
            if state == _CLOSED:
                return []
            if state == _CLOSING:
                if self._closed_event is None:
                    self._closed_event = anyio.Event()
                closed_event = self._closed_event
            else:
                closed_event = None
                self._state = _CLOSING
        if closed_event is not None:
            with anyio.CancelScope(shield=True):
                await closed_event.wait()
            return []
        if state == _NEW:
            return await self._close_unstarted()
        with anyio.CancelScope(shield=True):
            try:
                await self._drain(cancel_queued, timeout)
            finally:
                # Whatever happened above, no job is left without a result and no
                # engine task outlives the close.
                with self._lock:
                    self._abandon_all_locked(timeout)
                    here_done = None
                    if self._launching_here:  # no handler closes under a launch
                        here_done = self._here_done = anyio.Event()
                self._flush()
                if here_done is not None:
                    await here_done.wait()
                await self._stop_tasks()
                errors = await self._close_handlers()
                with self._lock:
                    self._state = _CLOSED
                    leftovers = self._store.drain_locked()
                    self._add_todo(self._store.close_locked())
                    self._add_todo(self._closed_event)
                    self._closed_event = None
                self._flush()
        if errors:
            self.leftover_results = tuple(leftovers)
            raise errors[0]
        return leftovers

    async def _drain(self, cancel_queued: bool, timeout: float | None) -> None:
        # closing waits for every job: polled handlers report unprompted from now on
        self._watch(1)
        with self._lock:
            if cancel_queued:
                for route in self._routes.values():
                    while route.queue:
                        job = route.queue[0]
                        self._resolve_locked(
                            job, JobCancelledError(f"job {job.job_id} cancelled at close")
                        )
            for route in self._routes.values():
                self._wake_route_locked(route)
                # tasks waiting for room wake up and find the engine closing
                self._add_todo(route.space)
                route.space = None
            self._space_cond.notify_all()
            idle = None
            if self._jobs:
                idle = self._idle = anyio.Event()
        self._flush()
        if idle is not None:
            with anyio.move_on_after(timeout):
                await idle.wait()

    def _abandon_all_locked(self, timeout: float | None) -> None:
        for job in list(self._jobs.values()):
            self._resolve_locked(
                job,
                JobCancelledError(
                    f"job {job.job_id} abandoned at close: unfinished after {timeout}s"
                ),
            )

    async def _close_unstarted(self) -> list[TransferResult]:
        with anyio.CancelScope(shield=True):
            errors = await self._close_handlers()
        with self._lock:
            self._state = _CLOSED
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
        for route in self._routes.values():
            retire_handler(route.handler)
            try:
                await route.handler.aclose()
            except Exception as exc:  # noqa: BLE001 - collected and re-raised after all closed
                errors.append(exc)
        return errors

    def _release_handlers(self) -> None:
        """Let every registered handler go to another engine (this one never ran them)."""
        for route in self._routes.values():
            release_handler(route.handler, self)

    @property
    def closed(self) -> bool:
        return self._state == _CLOSED

    @property
    def state(self) -> str:
        """``new``, ``running``, ``closing`` or ``closed``."""
        return self._state

    def __del__(self) -> None:
        if getattr(self, "_state", _CLOSED) in (_RUNNING, _CLOSING):
            warnings.warn(
                f"{type(self).__name__} was never closed: use 'async with' or aclose()",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )

    # ------------------------------------------------------------ tasks

    def _spawn(self, fn: Any, *args: Any) -> None:
        tg = self._tg
        if tg is None:  # pragma: no cover - only called while running
            raise EngineNotStartedError("engine has no task group")
        scope = anyio.CancelScope()
        self._scopes.append(scope)
        self._tasks_running += 1
        tg.start_soon(self._task, scope, fn, *args)

    async def _task(self, scope: anyio.CancelScope, fn: Any, *args: Any) -> None:
        try:
            with scope:
                await fn(*args)
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            # Anything else would escape into the task group, cancel the host's body
            # and leave jobs without results. The engine is broken instead: it
            # refuses new jobs, a crashed route's jobs fail now, and close still
            # works within its timeout.
            route = args[0] if args and isinstance(args[0], Route) else None
            self._crashed(exc, route)
        finally:
            self._tasks_running -= 1
            if self._tasks_running == 0 and self._tasks_done is not None:
                self._tasks_done.set()

    def _crashed(self, exc: BaseException, route: Route | None) -> None:
        """An engine task died of ``exc``: mark the engine broken; fail ``route``'s jobs."""
        with self._lock:
            if self.crash is None:
                self.crash = exc
            if route is not None:
                for job in [*route.inflight.values(), *route.queue]:
                    error = TransferError(
                        f"job {job.job_id}: the engine's task for {route.label} crashed: {exc!r}"
                    )
                    error.__cause__ = exc
                    self._resolve_locked(job, error)
            # tasks and threads waiting for room find the engine broken
            for r in self._routes.values():
                self._add_todo(r.space)
                r.space = None
            self._space_cond.notify_all()
        self._flush()

    async def _stop_tasks(self) -> None:
        if self._tasks_running:
            self._tasks_done = anyio.Event()
            for scope in self._scopes:
                scope.cancel()
            await self._tasks_done.wait()
        self._scopes.clear()

    async def _route_main(self, route: Route) -> None:
        handler = route.handler
        lock = self._lock
        since_yield = 0
        mine = False  # this task set route.launching for the batch it just launched
        while True:
            with lock:
                if mine:
                    route.launching = mine = False
                room = route.max_inflight - len(route.inflight)
                batch: list[Job] = []
                queue = route.queue
                inflight = route.inflight
                # a submitter inside handler.launch wakes this task when it is done
                while room > 0 and queue and not route.launching:
                    job = queue.popleft()
                    job.state = INFLIGHT
                    inflight[job.job_id] = job
                    batch.append(job)
                    room -= 1
                # queued jobs wait for room that only finished jobs' reports make
                blocked = bool(queue) and room <= 0 and handler.polled_completion
                if batch:
                    route.launching = mine = True
                else:
                    if route.wake is None:
                        route.wake = anyio.Event()
                    event = route.wake
            if batch:
                for job in batch:
                    job.t_launch = _now()
                    try:
                        handler.launch(job)
                    except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                        job.fail(exc)
                since_yield += len(batch)
                if since_yield >= _LAUNCHES_PER_YIELD:
                    since_yield = 0
                    await anyio.lowlevel.checkpoint()
            else:
                since_yield = 0
                if blocked:
                    await self._wait_watched(handler, event)
                else:
                    await event.wait()

    async def _timer_main(self) -> None:
        deadlines = self._deadlines
        while True:
            if self._polled:
                with self._lock:
                    due = deadlines.due_locked(time.monotonic())
                if due:  # a job that finished unpolled is not timed out
                    self._poll()
            with self._lock:
                now = time.monotonic()
                expired = deadlines.expired_locked(now)
                for job in expired:
                    self._resolve_locked(
                        job,
                        JobTimeoutError(f"job {job.job_id} timed out ({job.route.label})"),
                        timed_out=True,
                    )
                delay, event = deadlines.arm_locked(now)
            if expired:
                self._flush()
            with anyio.move_on_after(delay):
                await event.wait()
            with self._lock:
                if deadlines.wake is event:
                    deadlines.wake = None

    # ------------------------------------------------------------ loop wake-ups

    def _on_loop(self) -> bool:
        bridge = self._bridge
        return bridge is not None and bridge.in_loop_thread()

    def _add_todo(self, event: anyio.Event | None) -> None:
        if event is not None:
            self._todo.append(event)

    def _wake_route_locked(self, route: Route) -> None:
        event = route.wake
        if event is not None:
            route.wake = None
            self._todo.append(event)

    # ------------------------------------------------------------ submit

    def _check_running_locked(self) -> None:
        state = self._state
        if state != _RUNNING:
            if state == _NEW:
                raise EngineNotStartedError("enter the engine ('async with') before submitting")
            raise EngineClosedError(f"the engine is {state}; it accepts no more jobs")
        if self.crash is not None:
            raise EngineBrokenError(
                f"an engine task crashed ({self.crash!r}); the engine accepts no more jobs"
            ) from self.crash

    def _route_for(self, spec: TransferSpec) -> Route:
        if not isinstance(spec, TransferSpec):
            raise TypeError(f"submit takes a TransferSpec, got {type(spec).__name__}")
        route = self._routes.get(spec.pair)
        if route is None:
            known = ", ".join(r.label for r in self._routes.values()) or "none"
            raise NoHandlerError(
                f"no handler for {spec.src.medium.value}->{spec.dst.medium.value} "
                f"(registered: {known})"
            )
        return route

    def _prepare(
        self, spec: TransferSpec, job_id: int | None, timeout: float | None
    ) -> tuple[Route, object, float | None, int | None]:
        """Check the arguments and run the handler's ``prepare``, outside the lock.

        The job id and timeout come back as a plain int and float, so nothing
        the caller passed runs code under the lock later."""
        with self._lock:
            self._check_running_locked()
        if job_id is not None:
            job_id = check_job_id(job_id)
        # a plain float (or None) now: no caller code runs under the lock later
        timeout = self._default_timeout if timeout is None else check_job_timeout(timeout)
        route = self._route_for(spec)
        prepared = route.handler.prepare(spec)
        return route, prepared, timeout, job_id

    def _enqueue_locked(
        self,
        route: Route,
        spec: TransferSpec,
        prepared: object,
        job_id: int | None,
        timeout: float | None,
    ) -> tuple[int, Job | None]:
        """Queue the job; return its id, and the job itself when the submitting
        thread is to launch it (see :meth:`_launch_here`)."""
        self._check_running_locked()
        if len(route.queue) + len(route.inflight) >= route.capacity:
            raise QueueFullError(
                f"{route.label} holds {route.capacity} queued + in-flight jobs (its capacity)"
            )
        jid = self._store.reserve_locked(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        job = Job(self._report, route, jid, spec, prepared, _now(), deadline)
        self._jobs[jid] = job
        route.submitted += 1
        here = None
        if (
            route.launch_in_submitter
            and not route.queue
            and not route.launching
            and len(route.inflight) < route.max_inflight
        ):
            # the route is idle: this thread launches the job, and the loop sleeps on
            job.state = INFLIGHT
            route.inflight[jid] = job
            route.launching = True
            self._launching_here += 1
            here = job
        else:
            route.queue.append(job)
            event = route.wake
            if event is not None:
                route.wake = None
                self._todo.append(event)
        if deadline is not None:
            event = self._deadlines.push_locked(deadline, job, len(self._jobs))
            if event is not None:
                self._todo.append(event)
        return jid, here

    def _launch_here(self, job: Job) -> None:
        """Launch ``job`` on the submitting thread (its route's ``launching`` is
        held), then wake the route task if jobs queued up meanwhile."""
        route = job.route
        job.t_launch = _now()
        try:
            route.handler.launch(job)
        except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
            job.fail(exc)
        except BaseException as exc:
            # an interrupt in the caller's thread: the job gets its result, the
            # bookkeeping below still runs (else close would wait on it forever),
            # and the interrupt goes on to the caller
            job.fail(exc)
            raise
        finally:
            with self._lock:
                route.launching = False
                if route.queue:
                    self._wake_route_locked(route)
                self._launching_here -= 1
                if not self._launching_here and self._here_done is not None:
                    self._todo.append(self._here_done)
                    self._here_done = None
            if self._todo:
                self._flush()

    def submit_nowait(
        self, spec: TransferSpec, *, job_id: int | None = None, timeout: float | None = None
    ) -> int:
        """Queue ``spec``; return its job id. Never blocks; any thread.

        Raises :class:`QueueFullError` at capacity, and a typed error for bad
        input (no handler, bad ids, duplicate live id). Nothing is queued then.
        """
        route, prepared, timeout, job_id = self._prepare(spec, job_id, timeout)
        with self._lock:
            jid, here = self._enqueue_locked(route, spec, prepared, job_id, timeout)
        if here is not None:
            self._launch_here(here)
        if self._todo:
            self._flush()
        return jid

    async def submit(
        self, spec: TransferSpec, *, job_id: int | None = None, timeout: float | None = None
    ) -> int:
        """Queue ``spec``, waiting while the handler is at capacity. Loop thread only."""
        await anyio.lowlevel.checkpoint()  # every await is a checkpoint, even when not full
        if not self._on_loop():
            raise WrongThreadError(
                "await submit() on the engine's loop; use submit_nowait elsewhere"
            )
        route, prepared, timeout, job_id = self._prepare(spec, job_id, timeout)
        while True:
            event: anyio.Event | None = None
            with self._lock:
                try:
                    jid, here = self._enqueue_locked(route, spec, prepared, job_id, timeout)
                except QueueFullError:
                    if route.space is None:
                        route.space = anyio.Event()
                    event = route.space
            if event is None:
                if here is not None:
                    self._launch_here(here)
                self._flush()
                return jid
            await self._wait_watched(route.handler, event)

    async def _wait_watched(self, handler: TransferHandler[Any], event: anyio.Event) -> None:
        """Await ``event`` (room that only finished jobs make); a polled-completion
        handler reports what has finished first, and unprompted meanwhile."""
        if not handler.polled_completion:
            await event.wait()
            return
        handler.poll()
        handler.watch(1)
        try:
            await event.wait()
        finally:
            handler.watch(-1)

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
        route, prepared, timeout, job_id = self._prepare(spec, job_id, timeout)
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        handler = route.handler
        watching = False  # a polled-completion handler is watched while this waits for room
        try:
            while True:
                with self._lock:
                    try:
                        jid, here = self._enqueue_locked(route, spec, prepared, job_id, timeout)
                        break
                    except QueueFullError:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            raise
                        if watching or not handler.polled_completion:
                            self._sync_space_waiters += 1
                            try:
                                self._space_cond.wait(remaining)
                            finally:
                                self._sync_space_waiters -= 1
                            continue
                # outside the lock: report what has finished, then watch while waiting
                handler.poll()
                handler.watch(1)
                watching = True
        finally:
            if watching:
                handler.watch(-1)
        if here is not None:
            self._launch_here(here)
        self._flush()
        return jid

    def cancel(self, job_id: int) -> bool:
        """Cancel a queued job: True if it was queued and now has a cancelled
        result; False if it is already in flight or finished. Any thread."""
        job_id = check_job_id(job_id)  # a plain int: no caller code under the lock
        with self._lock:
            if self._state == _NEW:
                raise EngineNotStartedError("enter the engine ('async with') first")
            if self._state == _CLOSED:
                raise EngineClosedError("the engine is closed; it has no jobs to cancel")
            job = self._jobs.get(job_id)
            if job is None:
                if self._store.is_live_locked(job_id):
                    return False
                raise UnknownJobError(f"job {job_id} is not live")
            if job.state != QUEUED:
                return False
            self._resolve_locked(job, JobCancelledError(f"job {job_id} cancelled while queued"))
        self._flush()
        return True

    # ------------------------------------------------------------ completion

    def _report(
        self,
        job: Job,
        success: bool,
        nbytes: int,
        seconds: float | None,
        error: BaseException | None,
    ) -> None:
        """A handler's verdict on ``job``; any thread. Late or repeated reports are ignored."""
        now = _now()
        if seconds is None:
            seconds = now - job.t_launch
        with self._lock:
            if job.outcome is not None or job.state != INFLIGHT:
                return
            job.outcome = (success, nbytes, seconds, error)
            route = job.route
            if route.ordered:
                self._settle_locked(route, now)
            else:
                del route.inflight[job.job_id]
                self._post_locked(job, now)
            if route.queue:
                self._wake_route_locked(route)
        if self._todo:
            self._flush()

    def _settle_locked(self, route: Route, now: float) -> None:
        """Post the ordered route's leading run of resolved jobs."""
        inflight = route.inflight
        settled: list[int] = []
        for jid, head in inflight.items():
            if head.outcome is None:
                break
            self._post_locked(head, now)
            settled.append(jid)
        for jid in settled:
            del inflight[jid]

    def _resolve_locked(self, job: Job, error: BaseException, *, timed_out: bool = False) -> None:
        """Fail ``job`` from the engine's side (cancel, timeout, close); delivered at once."""
        if job.outcome is not None:
            return
        route = job.route
        now = _now()
        if job.state == QUEUED:
            route.queue.remove(job)
            seconds = 0.0
        else:
            del route.inflight[job.job_id]
            route.abandoned += 1
            seconds = now - job.t_launch
        if isinstance(error, JobCancelledError):
            route.cancelled += 1
        if timed_out:
            route.timed_out += 1
        job.outcome = (False, 0, seconds, error)
        self._post_locked(job, now)
        if route.ordered and route.inflight:
            # the job may have held back finished successors
            self._settle_locked(route, now)
        if route.queue:
            self._wake_route_locked(route)

    def _post_locked(self, job: Job, now: float) -> None:
        success, nbytes, seconds, error = job.outcome  # type: ignore[misc]
        route = job.route
        job.state = DONE
        del self._jobs[job.job_id]
        if success:
            route.count_success(job.spec, nbytes)
        else:
            route.failed += 1
        self._store.post_locked(
            TransferResult(job.job_id, success, nbytes, seconds, error, now - job.t_submit)
        )
        event = self._store.wake_locked()
        if event is not None:
            self._todo.append(event)
        if route.space is not None:
            self._todo.append(route.space)
            route.space = None
        if self._sync_space_waiters:
            self._space_cond.notify_all()
        if self._idle is not None and not self._jobs:
            self._todo.append(self._idle)
            self._idle = None

    # ------------------------------------------------------------ results

    def get_finished(self) -> list[TransferResult]:
        """Every result not yet collected, in finish order. Never blocks; any thread."""
        if self._state == _NEW:
            raise EngineNotStartedError("enter the engine ('async with') first")
        if self._polled:
            self._poll()
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
        if self._state == _NEW:
            raise EngineNotStartedError("enter the engine ('async with') first")
        if not self._polled:
            return await self._store.wait(job_ids, timeout)
        self._poll()
        self._watch(1)
        try:
            return await self._store.wait(job_ids, timeout)
        finally:
            self._watch(-1)

    def wait_blocking(
        self, job_ids: Iterable[int], *, timeout: float | None = None
    ) -> list[TransferResult]:
        """Like :meth:`wait`, blocking a thread other than the loop's."""
        if self._on_loop():
            raise WrongThreadError("wait_blocking would deadlock on the engine's loop thread")
        if self._state == _NEW:
            raise EngineNotStartedError("start the engine first")
        if not self._polled:
            return self._store.wait_blocking(job_ids, timeout)
        self._poll()
        self._watch(1)
        try:
            return self._store.wait_blocking(job_ids, timeout)
        finally:
            self._watch(-1)

    def __aiter__(self) -> AsyncIterator[TransferResult]:
        return self.results()

    def results(self) -> AsyncIterator[TransferResult]:
        """Results as they finish, until the engine is closed and empty.

        ``async for result in manager`` is the same. Iterators compete: each
        result goes to one of them (or to ``get_finished``/``wait``).
        """
        if self._state == _NEW:
            raise EngineNotStartedError("enter the engine ('async with') first")
        return _ResultIterator(self, self._store)

    # ------------------------------------------------------------ introspection

    def stats(self) -> EngineStats:
        """A consistent snapshot of every handler's counters (also after close)."""
        with self._lock:
            return EngineStats(
                state=self._state,
                handlers=tuple(r.snapshot() for r in self._routes.values()),
                results_ready=self._store.ready_count,
            )

    def __repr__(self) -> str:
        with self._lock:
            routes = ", ".join(
                f"{r.label} queued={len(r.queue)} in_flight={len(r.inflight)}"
                for r in self._routes.values()
            )
            ready = self._store.ready_count
        backend = f" {self._bridge.backend}" if self._bridge is not None else ""
        return f"<{type(self).__name__} {self._state}{backend} [{routes}] results_ready={ready}>"
