"""The thin layer between the engine and whichever event loop hosts it.

anyio gives tasks, events and cancel scopes on asyncio and trio alike. What it
lacks is a *non-blocking* thread-safe "call soon" (``anyio.from_thread.run_sync``
blocks the calling thread until the call ran), so :class:`LoopBridge` wraps the
native one: ``loop.call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon``
on trio. Both wake a sleeping loop through its self-pipe; nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel

from offload_engine.errors import EngineBrokenError

#: the signals an application handles itself: shutdown, interrupt, reload, its own
_NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD")
APPLICATION_SIGNALS = frozenset(getattr(signal, n) for n in _NAMES if hasattr(signal, n))


def block_application_signals() -> None:
    """Block :data:`APPLICATION_SIGNALS` in the calling thread: every thread the
    engine starts calls it first. A process-directed signal goes to one thread that
    does not block it, and Python runs its handler only in the main thread, when that
    thread next runs Python code; if the signal lands in an engine thread while the
    main thread sleeps in a lock (vLLM's engine core, idle, waiting for its input
    queue), the handler never runs and the process ignores its SIGTERM."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, APPLICATION_SIGNALS)


#: bytes of a C ``struct sigaction`` and more (glibc's is 152 on x86-64 and arm64)
_SIGACTION_BYTES = 256


def _libc_sigaction() -> Callable[..., int] | None:
    try:
        call: Callable[..., int] = ctypes.CDLL(None, use_errno=True).sigaction
    except (OSError, AttributeError, TypeError):  # no C library to ask (Windows)
        return None
    return call


@contextlib.contextmanager
def keep_signal_actions() -> Iterator[None]:
    """Put back the actions (handler and flags) of :data:`APPLICATION_SIGNALS` that
    the block changed. Native code that a runtime loads as it starts can leave them
    changed: under vLLM on an H200, SIGTERM's action came back from the CUDA
    runtime's start with C ``signal()``'s BSD flags, ``SA_RESTART`` among them. With
    that flag a thread asleep in a wait resumes the wait after the signal, and Python
    runs its handler only once the main thread runs Python again, which an idle
    server's main thread, waiting on its input queue (vLLM's engine core), never
    does: the process ignored its SIGTERM until it was killed."""
    sigaction = _libc_sigaction()
    saved: dict[int, ctypes.Array[ctypes.c_char]] = {}
    if sigaction is not None:
        for sig in APPLICATION_SIGNALS:
            action = ctypes.create_string_buffer(_SIGACTION_BYTES)
            if sigaction(int(sig), None, action) == 0:
                saved[int(sig)] = action
    try:
        yield
    finally:
        if sigaction is not None:
            for sig, action in saved.items():
                now = ctypes.create_string_buffer(_SIGACTION_BYTES)
                if sigaction(sig, None, now) == 0 and now.raw != action.raw:
                    sigaction(sig, action, None)


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
