"""The engine's tasks on its loop: one per route (launches queued jobs), one
timer (expires deadlines), and those handlers start; each supervised.

Every task runs in its own cancel scope, so close stops them all before it
closes the handlers. A task that dies of anything but cancellation breaks the
engine instead of escaping into the host's task group (which would cancel the
host's body and leave jobs without results).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from offload_engine.engine._core import Core
from offload_engine.engine._jobs import INFLIGHT, Job, Route
from offload_engine.engine._waits import NO_WAITS
from offload_engine.errors import EngineNotStartedError, JobTimeoutError

_now = time.perf_counter

# A route task launches this many jobs back to back before it lets other tasks run.
_LAUNCHES_PER_YIELD = 1024


class Tasks:
    """Spawns, supervises and stops the engine's tasks."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self.group: anyio.abc.TaskGroup | None = None
        self._scopes: list[anyio.CancelScope] = []
        self.running = 0
        self._done: anyio.Event | None = None

    def spawn(self, fn: Any, *args: Any) -> None:
        tg = self.group
        if tg is None:  # pragma: no cover - only called while running
            raise EngineNotStartedError("engine has no task group")
        scope = anyio.CancelScope()
        self._scopes.append(scope)
        self.running += 1
        tg.start_soon(self._run, scope, fn, *args)

    async def _run(self, scope: anyio.CancelScope, fn: Any, *args: Any) -> None:
        try:
            with scope:
                await fn(*args)
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            # The engine is broken instead: it refuses new jobs, a crashed route's
            # jobs fail now, and close still works within its timeout.
            route = next((a for a in args if isinstance(a, Route)), None)
            self._core.crashed(exc, route)
        finally:
            self.running -= 1
            if self.running == 0 and self._done is not None:
                self._done.set()

    async def stop(self) -> None:
        if self.running:
            self._done = anyio.Event()
            for scope in self._scopes:
                scope.cancel()
            await self._done.wait()
        self._scopes.clear()


async def route_main(core: Core, route: Route) -> None:
    """Launch ``route``'s queued jobs while it has room in flight."""
    handler = route.handler
    lock = core.lock
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
            if batch:
                route.launching = mine = True
            else:
                if route.wake is None:
                    route.wake = anyio.Event()
                event = route.wake
                # queued jobs wait for room in flight, which only finished jobs'
                # reports make: a wait on the handler's jobs; else a wait for work
                waits = route.waits if queue and room <= 0 else NO_WAITS
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
            waits.begin()
            try:
                await event.wait()
            finally:
                waits.end()


async def timer_main(core: Core) -> None:
    """Time out each job still unresolved at its deadline."""
    deadlines = core.deadlines
    lock = core.lock
    while True:
        with lock:
            due = deadlines.due_locked(time.monotonic())
        if due:  # a job that finished unpolled is not timed out
            core.waits.poll()
        with lock:
            now = time.monotonic()
            expired = deadlines.expired_locked(now)
            for job in expired:
                core.resolve_locked(
                    job,
                    JobTimeoutError(f"job {job.job_id} timed out ({job.route.label})"),
                    timed_out=True,
                )
            delay, event = deadlines.arm_locked(now)
        if expired:
            core.flush()
        with anyio.move_on_after(delay):
            await event.wait()
        with lock:
            if deadlines.wake is event:
                deadlines.wake = None
