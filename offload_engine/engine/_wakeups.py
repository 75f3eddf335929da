"""Wake-up batching: set loop events collected under the lock, outside it.

Code under the manager's lock may not touch the loop (setting an anyio event
from another thread is unsafe). It appends the events to wake to
:attr:`Wakeups.todo`; after releasing the lock the caller :meth:`~Wakeups.flush`-es.
On the loop thread the events are set at once. From another thread one
callback is bridged to the loop, and while it is pending no second one is
scheduled, so a burst of completions from worker threads costs one loop wake-up.

``todo`` is one list for the manager's whole life (it is emptied in place), so
the manager may keep a direct reference and test it cheaply.

A thread may reach its flush after the engine has closed and its loop has
ended: it queued a job, or reported or cancelled one, before close, and the
loop thread ran the whole close between that thread's lock section and its
flush. The bridge then refuses the callback. That is no error: close's last
flush, on the loop after the engine was marked closed, set every event
collected until then, and the tasks that could sleep on a later one ended with
the loop. So a refusal once the engine is closed is dropped (the job has its
result, the submitter its id), and one before it goes on as a broken engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio

from offload_engine._loop import LoopBridge
from offload_engine.errors import EngineBrokenError


class Wakeups:
    __slots__ = ("_closed_locked", "_lock", "_scheduled", "bridge", "todo")

    def __init__(self, lock: threading.Lock, closed_locked: Callable[[], bool]) -> None:
        self._lock = lock
        #: whether the engine has closed; called under the lock
        self._closed_locked = closed_locked
        self._scheduled = False
        self.bridge: LoopBridge | None = None
        self.todo: list[anyio.Event] = []  # guarded by the lock

    def add_locked(self, event: anyio.Event | None) -> None:
        if event is not None:
            self.todo.append(event)

    def flush(self) -> None:
        """Set the collected events: now if on the loop, else via one callback. No lock held."""
        if not self.todo:
            return
        bridge = self.bridge
        if bridge is None:
            return
        if bridge.in_loop_thread():
            self._run()
            return
        with self._lock:
            if self._scheduled or not self.todo:
                return
            self._scheduled = True
        try:
            bridge.call_soon(self._run)
        except EngineBrokenError:
            # the loop has ended: nothing was scheduled, and after close nothing waits
            with self._lock:
                self._scheduled = False
                closed = self._closed_locked()
            if not closed:
                raise

    def _run(self) -> None:
        with self._lock:
            todo = self.todo[:]
            self.todo.clear()
            self._scheduled = False
        for event in todo:
            event.set()
