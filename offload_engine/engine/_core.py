"""The engine's state under its one lock, and the transitions of a job.

One ``threading.Lock`` guards all mutable state: routes, queues, in-flight
tables, counters, the deadline heap and the result store. Sections under it are
short and never await or call a handler. Work that must happen on the loop
(setting an anyio event to wake a sleeping task) is collected under the lock and
set after it, in one batch (:mod:`offload_engine.engine._wakeups`).

A sleeping task publishes the event it sleeps on (``route.wake``,
``route.space``, ...) under the lock after re-checking its condition, and a
waker takes that event under the lock. So no wake-up is lost and no task polls.

Job life: ``QUEUED`` -> ``INFLIGHT`` -> resolved (an outcome is set) -> result
posted. Exactly one outcome wins: the handler's ``succeed``/``fail``, a
timeout, a cancel, or abandonment at close. Later reports are ignored.
"""

from __future__ import annotations

import threading
import time
from typing import Final

import anyio

from offload_engine.engine._deadlines import Deadlines
from offload_engine.engine._jobs import DONE, INFLIGHT, QUEUED, Job, Route
from offload_engine.engine._waits import Waits
from offload_engine.engine._wakeups import Wakeups
from offload_engine.engine.completions import CompletionStore, check_job_id, check_job_timeout
from offload_engine.errors import (
    EngineBrokenError,
    EngineClosedError,
    EngineNotStartedError,
    JobCancelledError,
    NoHandlerError,
    QueueFullError,
    TransferError,
)
from offload_engine.vocabulary import Medium, TransferResult, TransferSpec

NEW: Final = "new"
RUNNING: Final = "running"
CLOSING: Final = "closing"
CLOSED: Final = "closed"

_now = time.perf_counter

#: what a submit queues once there is room: (route, spec, prepared, job id, timeout)
Ticket = tuple[Route, TransferSpec, object, "int | None", "float | None"]

#: a queued job: its id, and the job itself when the submitting thread launches it
Entry = tuple[int, "Job | None"]


class Core:
    """Routes, jobs, results and lifecycle state, and every change to them."""

    def __init__(self, capacity: int, default_timeout: float | None) -> None:
        self.lock = threading.Lock()
        self.store = CompletionStore(self.lock)
        self.capacity = capacity
        self.default_timeout = default_timeout
        self.routes: dict[tuple[Medium, Medium], Route] = {}
        self.jobs: dict[int, Job] = {}
        self.state = NEW
        #: what crashed one of the engine's tasks (the engine is broken then), or None
        self.crash: BaseException | None = None
        self.wakeups = Wakeups(self.lock, self._closed_locked)
        self.todo = self.wakeups.todo  # the same list, tested on hot paths
        self.flush = self.wakeups.flush
        self.deadlines = Deadlines()
        self.idle: anyio.Event | None = None  # set when the last job gets its result
        #: the wait hooks of every route's handler; replaced, never mutated
        self.waits = Waits()
        # submitting threads inside a handler's launch, and what close awaits them with
        self.submitter_launches = 0
        self.submitter_launches_done: anyio.Event | None = None

    def _closed_locked(self) -> bool:
        return self.state == CLOSED

    def add_route_locked(self, pair: tuple[Medium, Medium], route: Route) -> None:
        """Make ``route`` the one for ``pair``."""
        self.routes[pair] = route
        self.waits = Waits(r.handler for r in self.routes.values())

    # ------------------------------------------------------------ submit

    def check_running_locked(self) -> None:
        state = self.state
        if state != RUNNING:
            if state == NEW:
                raise EngineNotStartedError("enter the engine ('async with') before submitting")
            raise EngineClosedError(f"the engine is {state}; it accepts no more jobs")
        if self.crash is not None:
            raise EngineBrokenError(
                f"an engine task crashed ({self.crash!r}); the engine accepts no more jobs"
            ) from self.crash

    def route_for(self, spec: TransferSpec) -> Route:
        if not isinstance(spec, TransferSpec):
            raise TypeError(f"submit takes a TransferSpec, got {type(spec).__name__}")
        route = self.routes.get(spec.pair)
        if route is None:
            known = ", ".join(r.label for r in self.routes.values()) or "none"
            raise NoHandlerError(
                f"no handler for {spec.src.medium.value}->{spec.dst.medium.value} "
                f"(registered: {known})"
            )
        return route

    def ticket(self, spec: TransferSpec, job_id: int | None, timeout: float | None) -> Ticket:
        """Check the arguments and run the handler's ``prepare``, outside the lock.

        The job id and timeout come back as a plain int and float, so nothing
        the caller passed runs code under the lock later."""
        with self.lock:
            self.check_running_locked()
        if job_id is not None:
            job_id = check_job_id(job_id)
        timeout = self.default_timeout if timeout is None else check_job_timeout(timeout)
        route = self.route_for(spec)
        prepared = route.handler.prepare(spec)
        return route, spec, prepared, job_id, timeout

    def enqueue_locked(
        self,
        route: Route,
        spec: TransferSpec,
        prepared: object,
        job_id: int | None,
        timeout: float | None,
    ) -> Entry:
        """Queue the job, or hand it to the submitting thread (see :meth:`submitted`).
        Raises :class:`QueueFullError` at the route's capacity."""
        self.check_running_locked()
        if len(route.queue) + len(route.inflight) >= route.capacity:
            raise QueueFullError(
                f"{route.label} holds {route.capacity} queued + in-flight jobs (its capacity)"
            )
        fence = spec.fence
        if fence is not None:
            fence.claim()
        try:
            jid = self.store.reserve_locked(job_id)
        except BaseException:
            if fence is not None:
                fence.release_claim()
            raise
        deadline = None if timeout is None else time.monotonic() + timeout
        job = Job(self.report, route, jid, spec, prepared, _now(), deadline)
        self.jobs[jid] = job
        route.submitted += 1
        here = None
        if (
            route.launch_in_submitter
            and route.handler.launch_here(prepared)
            and route.hand_to_submitter_locked(job)
        ):
            # the route is idle: this thread launches the job, and the loop sleeps on
            self.submitter_launches += 1
            here = job
        else:
            route.queue.append(job)
            event = route.wake
            if event is not None:
                route.wake = None
                self.todo.append(event)
        if deadline is not None:
            event = self.deadlines.push_locked(deadline, job, len(self.jobs))
            if event is not None:
                self.todo.append(event)
        return jid, here

    def submitted(self, entry: Entry) -> int:
        """After the lock: launch the job if its route handed it to this thread,
        and wake the loop. Returns the job id."""
        jid, here = entry
        if here is not None:
            self._launch_here(here)
        if self.todo:
            self.flush()
        return jid

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
            with self.lock:
                route.launching = False
                if route.queue:
                    self.wake_route_locked(route)
                self.submitter_launches -= 1
                if not self.submitter_launches:
                    self.add_todo(self.submitter_launches_done)
                    self.submitter_launches_done = None
            if self.todo:
                self.flush()

    # ------------------------------------------------------------ completion

    def report(
        self,
        job: Job,
        success: bool,
        nbytes: int,
        seconds: float | None,
        error: BaseException | None,
        strategy: str | None,
    ) -> None:
        """A handler's verdict on ``job``; any thread. Late or repeated reports are ignored."""
        now = _now()
        if seconds is None:
            seconds = now - job.t_launch
        with self.lock:
            if job.outcome is not None or job.state != INFLIGHT:
                return
            job.outcome = (success, nbytes, seconds, error, strategy)
            route = job.route
            if route.ordered:
                self.settle_locked(route, now)
            else:
                del route.inflight[job.job_id]
                self._post_locked(job, now)
            if route.queue:
                self.wake_route_locked(route)
        if self.todo:
            self.flush()

    def settle_locked(self, route: Route, now: float) -> None:
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

    def resolve_locked(self, job: Job, error: BaseException, *, timed_out: bool = False) -> None:
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
        job.outcome = (False, 0, seconds, error, None)
        self._post_locked(job, now)
        if route.ordered and route.inflight:
            # the job may have held back finished successors
            self.settle_locked(route, now)
        if route.queue:
            self.wake_route_locked(route)

    def _post_locked(self, job: Job, now: float) -> None:
        success, nbytes, seconds, error, strategy = job.outcome  # type: ignore[misc]
        route = job.route
        job.state = DONE
        del self.jobs[job.job_id]
        if success:
            route.count_success(job.spec, nbytes, strategy)
        else:
            route.failed += 1
        self.store.post_locked(
            TransferResult(
                job.job_id, success, nbytes, seconds, error, now - job.t_submit, strategy
            )
        )
        if job.spec.fence is not None:
            job.spec.fence.finished(error)
        event = self.store.wake_locked()
        if event is not None:
            self.todo.append(event)
        if route.space is not None or route.space_threads is not None:
            route.wake_room_locked(self.todo)
        if self.idle is not None and not self.jobs:
            self.todo.append(self.idle)
            self.idle = None

    def abandon_all_locked(self, timeout: float | None) -> None:
        for job in list(self.jobs.values()):
            self.resolve_locked(
                job,
                JobCancelledError(
                    f"job {job.job_id} abandoned at close: unfinished after {timeout}s"
                ),
            )

    def crashed(self, exc: BaseException, route: Route | None) -> None:
        """An engine task died of ``exc``: mark the engine broken; fail ``route``'s jobs."""
        with self.lock:
            if self.crash is None:
                self.crash = exc
            if route is not None:
                for job in [*route.inflight.values(), *route.queue]:
                    error = TransferError(
                        f"job {job.job_id}: the engine's task for {route.label} crashed: {exc!r}"
                    )
                    error.__cause__ = exc
                    self.resolve_locked(job, error)
            # tasks and threads waiting for room find the engine broken
            for r in self.routes.values():
                r.wake_room_locked(self.todo)
        self.flush()

    # ------------------------------------------------------------ loop wake-ups

    def add_todo(self, event: anyio.Event | None) -> None:
        if event is not None:
            self.todo.append(event)

    def wake_route_locked(self, route: Route) -> None:
        event = route.wake
        if event is not None:
            route.wake = None
            self.todo.append(event)
