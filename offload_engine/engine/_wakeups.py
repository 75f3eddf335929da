"""Wake-up batching: set loop events collected under the lock, outside it.

Code under the manager's lock may not touch the loop (setting an anyio event
from another thread is unsafe). It appends the events to wake to
:attr:`Wakeups.todo`; after releasing the lock the caller :meth:`~Wakeups.flush`-es.
On the loop thread the events are set at once. From another thread one
callback is bridged to the loop, and while it is pending no second one is
scheduled, so a burst of completions from worker threads costs one loop wake-up.

``todo`` is one list for the manager's whole life (it is emptied in place), so
the manager may keep a direct reference and test it cheaply.
"""

from __future__ import annotations

import threading

import anyio

from offload_engine._loop import LoopBridge


class Wakeups:
    __slots__ = ("_lock", "_scheduled", "bridge", "todo")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
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
        bridge.call_soon(self._run)

    def _run(self) -> None:
        with self._lock:
            todo = self.todo[:]
            self.todo.clear()
            self._scheduled = False
        for event in todo:
            event.set()
