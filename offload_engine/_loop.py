"""The thin layer between the engine and whichever event loop hosts it.

anyio gives tasks, events and cancel scopes on asyncio and trio alike. What it
lacks is a *non-blocking* thread-safe "call soon" (``anyio.from_thread.run_sync``
blocks the calling thread until the call ran), so :class:`LoopBridge` wraps the
native one: ``loop.call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon``
on trio. Both wake a sleeping loop through its self-pipe; nothing polls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from offload_engine.errors import EngineBrokenError


class LoopBridge:
    """Captures the running loop; lets any thread schedule work on it."""

    __slots__ = ("_call", "backend", "thread")

    def __init__(self) -> None:
        token = anyio.lowlevel.current_token()
        native = token.native_token
        # The thread object, not its ident: once the loop's thread has exited, a new
        # thread may get the same ident, and must not pass for the loop's thread.
        self.thread = threading.current_thread()
        if isinstance(native, asyncio.AbstractEventLoop):
            self.backend = "asyncio"
            self._call: Callable[..., object] = native.call_soon_threadsafe
        else:
            self.backend = "trio"
            self._call = native.run_sync_soon  # type: ignore[attr-defined]

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon. Safe from any thread; never blocks."""
        try:
            self._call(fn, *args)
        except RuntimeError as exc:  # asyncio: loop closed; trio: run finished
            raise EngineBrokenError("the engine's event loop is no longer running") from exc


class ThreadSignal:
    """A one-shot signal set from any thread and awaited on the loop.

    The anyio event is created by the awaiting task (creation needs a task
    context); ``set`` hops to the loop through ``call_soon`` (a bridge's
    thread-safe scheduler).
    """

    def __init__(self, call_soon: Callable[..., object]) -> None:
        self._call_soon = call_soon
        self._lock = threading.Lock()
        self._flag = False
        self._event: anyio.Event | None = None

    def set(self) -> None:
        with self._lock:
            if self._flag:
                return
            self._flag = True
            event = self._event
        if event is not None:
            try:
                self._call_soon(event.set)
            except EngineBrokenError:
                pass  # the loop has ended: nobody is left waiting

    def is_set(self) -> bool:
        return self._flag

    async def wait(self) -> None:
        with self._lock:
            if self._flag:
                return
            if self._event is None:
                self._event = anyio.Event()
            event = self._event
        await event.wait()


async def join_threads(
    threads: list[threading.Thread], done: ThreadSignal | None, timeout: float, stuck: str
) -> None:
    """Close-time wait for a handler's threads: await ``done`` on the loop (the last
    thread sets it) for at most ``timeout`` seconds, then join them; ``threads`` ends
    empty. Past the timeout it raises :class:`EngineBrokenError` naming the threads
    still alive, followed by ``stuck`` (what they are inside, what happens next)."""
    if done is not None:
        with anyio.move_on_after(timeout):
            await done.wait()
        if not done.is_set():
            alive = ", ".join(t.name for t in threads if t.is_alive())
            threads.clear()
            raise EngineBrokenError(f"thread(s) {alive} {stuck} {timeout}s after close")
    for t in threads:
        t.join()
    threads.clear()
