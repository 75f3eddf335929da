"""Waiting for room in a full route: the loop that ``await submit`` and
``submit_blocking`` share.

A submitter that finds its route at capacity publishes what it sleeps on
(:meth:`~offload_engine.engine._jobs.Route.task_room_locked`, an anyio event, or
:meth:`~offload_engine.engine._jobs.Route.thread_room_locked`) under the lock, and any job
leaving the route, or the engine closing or breaking, sets it. The wait is a
wait on the route's jobs, so the handler's wait hooks run around it: a handler
that holds finished jobs back reports them, which is what makes the room.

A submit first tries to queue the job at once (the common case, which pays
for nothing here); only a :class:`QueueFullError` brings it to
:func:`wait_for_room` or :func:`wait_for_room_blocking`, two shells of the same
loop around :meth:`RoomWait.attempt`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

from offload_engine.engine._core import Core, Entry, Ticket
from offload_engine.engine._jobs import Route
from offload_engine.errors import QueueFullError

S = TypeVar("S", anyio.Event, threading.Event)


class RoomWait(Generic[S]):
    """One submit waiting for room; :meth:`close` it when done."""

    __slots__ = ("_core", "_deadline", "_hooked", "_sleeper", "_ticket", "entry", "remaining")

    def __init__(
        self,
        core: Core,
        ticket: Ticket,
        sleeper_locked: Callable[[Route], S],
        deadline: float | None = None,
    ) -> None:
        self._core = core
        self._ticket = ticket
        # the route's task or thread event, taken under the lock
        self._sleeper: Callable[[Route], S] = sleeper_locked
        self._deadline = deadline  # time.monotonic() past which QueueFullError goes out
        self._hooked = False  # the route's wait hooks have begun
        #: the queued job, once :meth:`attempt` returned None
        self.entry: Entry = (-1, None)
        #: seconds left before the deadline, when :meth:`attempt` returned a sleeper
        self.remaining: float | None = None

    def attempt(self) -> S | None:
        """Queue the job if there is room (then None, and :attr:`entry` holds it),
        else return what to sleep on before the next attempt. Raises
        :class:`QueueFullError` past the deadline, and whatever queueing raises
        (a closed engine, a duplicate id)."""
        core = self._core
        route = self._ticket[0]
        with core.lock:
            try:
                self.entry = core.enqueue_locked(*self._ticket)
                return None
            except QueueFullError:
                deadline = self._deadline
                if deadline is not None:
                    self.remaining = deadline - time.monotonic()
                    if self.remaining <= 0:
                        raise
                sleeper = self._sleeper(route)
        if not self._hooked:
            # the sleeper is published first: room that the hooks' reports make sets it
            route.waits.begin()
            self._hooked = True
        return sleeper

    def close(self) -> None:
        if self._hooked:
            self._hooked = False
            self._ticket[0].waits.end()


async def wait_for_room(core: Core, ticket: Ticket) -> Entry:
    """Queue the ticket's job once its full route has room; a task on the loop."""
    room = RoomWait(core, ticket, Route.task_room_locked)
    try:
        while (sleeper := room.attempt()) is not None:
            await sleeper.wait()
    finally:
        room.close()
    return room.entry


def wait_for_room_blocking(core: Core, ticket: Ticket, deadline: float | None) -> Entry:
    """The same, blocking a thread other than the loop's until ``deadline``
    (``time.monotonic()``; then :class:`QueueFullError`)."""
    room = RoomWait(core, ticket, Route.thread_room_locked, deadline)
    try:
        while (sleeper := room.attempt()) is not None:
            sleeper.wait(room.remaining)
    finally:
        room.close()
    return room.entry
