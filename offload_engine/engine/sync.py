"""Where the manager's loop lives.

* **The caller's loop.** :class:`~offload_engine.OffloadingQueueManager` is
  itself the async host: ``async with`` it inside a running asyncio or trio
  loop (anyio runs it on both).
* **A private loop thread.** :class:`SyncOffloadingEngine` is the facade for a
  caller with no loop, such as a vLLM worker. It starts a thread that runs an
  event loop hosting the manager, and exposes plain methods. ``submit_nowait``,
  ``get_finished``, ``cancel`` and ``stats`` never block on a transfer; they
  work on the manager's thread-safe state directly, without a hop through the
  loop. Only ``wait`` and ``close`` (and ``submit`` when the queue is full)
  block the caller.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Literal

import anyio

from offload_engine._loop import LoopBridge, block_application_signals
from offload_engine.engine.completions import check_wait_timeout
from offload_engine.engine.handler import TransferHandler
from offload_engine.engine.manager import OffloadingQueueManager
from offload_engine.engine.stats import EngineStats
from offload_engine.errors import EngineBrokenError, EngineClosedError, WrongThreadError
from offload_engine.vocabulary import TransferResult, TransferSpec


class _LoopThread:
    """A thread running one event loop that hosts one manager until asked to close."""

    def __init__(self, manager: OffloadingQueueManager, backend: str, name: str) -> None:
        self._manager = manager
        self._backend = backend
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.crash: BaseException | None = None
        #: set when the loop thread's run has ended (cheaper to test than is_alive())
        self.ended = False
        self._bridge: LoopBridge | None = None
        self._stop: anyio.Event | None = None
        self._close_args: dict[str, Any] = {}
        self._close_result: list[TransferResult] = []
        self._close_error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self.thread.join()
            raise self._startup_error

    def _run(self) -> None:
        block_application_signals()
        try:
            anyio.run(self._main, backend=self._backend)
        except BaseException as exc:  # noqa: BLE001 - reported to the owner thread
            if not self._ready.is_set():
                self._startup_error = exc
            else:
                self.crash = exc
        finally:
            self.ended = True
            self._ready.set()

    async def _main(self) -> None:
        async with self._manager:
            self._bridge = LoopBridge()
            self._stop = anyio.Event()
            self._ready.set()
            await self._stop.wait()
            try:
                self._close_result = await self._manager.aclose(**self._close_args)
            except Exception as exc:  # noqa: BLE001 - re-raised in close()
                self._close_error = exc

    def in_loop_thread(self) -> bool:
        # the object, not its ident, which a new thread may reuse once this one exited
        return threading.current_thread() is self.thread

    def close(self, **close_args: Any) -> list[TransferResult]:
        bridge, stop = self._bridge, self._stop
        if self.thread.is_alive() and bridge is not None and stop is not None:
            self._close_args = close_args
            try:
                bridge.call_soon(stop.set)
            except EngineBrokenError:
                pass  # the loop already ended; join below returns at once
        self.thread.join()
        if self._close_error is not None:
            raise self._close_error
        return self._close_result


class SyncOffloadingEngine:
    """The engine for callers without an event loop.

    ::

        with SyncOffloadingEngine([store_handler, load_handler]) as engine:
            job = engine.submit_nowait(spec)
            ...                                   # each step:
            for result in engine.get_finished():  # never blocks
                ...

    ``backend`` picks the private loop: ``"asyncio"`` (default) or ``"trio"``.
    """

    def __init__(
        self,
        handlers: Iterable[TransferHandler[Any]] = (),
        *,
        capacity: int = 4096,
        default_timeout: float | None = None,
        backend: Literal["asyncio", "trio"] = "asyncio",
        thread_name: str = "offload-engine-loop",
    ) -> None:
        if backend not in ("asyncio", "trio"):
            raise ValueError(f"backend must be 'asyncio' or 'trio', got {backend!r}")
        self._manager = OffloadingQueueManager(
            handlers, capacity=capacity, default_timeout=default_timeout
        )
        self._close_lock = threading.Lock()
        self._closed = False
        #: results nobody collected, when ``with`` closed the engine or close() raised
        self.leftover_results: tuple[TransferResult, ...] = ()
        self._host = _LoopThread(self._manager, backend, thread_name)

    def _check(self) -> None:
        # The loop thread first, the flag after: close() sets _closed before it
        # ends the loop thread, so a thread found stopped by close is always seen
        # closed here, never broken (in the other order, a close that ran whole
        # between the two reads looked like a loop thread that died).
        host = self._host
        stopped = host.crash is not None or host.ended
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if stopped:
            raise EngineBrokenError("the engine's loop thread has stopped") from host.crash

    # ------------------------------------------------------------ jobs

    def submit_nowait(
        self, spec: TransferSpec, *, job_id: int | None = None, timeout: float | None = None
    ) -> int:
        """Queue ``spec``; raise :class:`QueueFullError` at capacity. Never blocks."""
        self._check()
        return self._manager.submit_nowait(spec, job_id=job_id, timeout=timeout)

    def submit(
        self,
        spec: TransferSpec,
        *,
        job_id: int | None = None,
        timeout: float | None = None,
        wait_timeout: float | None = None,
    ) -> int:
        """Queue ``spec``, blocking only while the handler is at capacity."""
        self._check()
        return self._manager.submit_blocking(
            spec, job_id=job_id, timeout=timeout, wait_timeout=wait_timeout
        )

    def cancel(self, job_id: int) -> bool:
        """Cancel a queued job (True), or report it already started or finished (False)."""
        self._check()
        return self._manager.cancel(job_id)

    def get_finished(self) -> list[TransferResult]:
        """Every result not yet collected. Never blocks."""
        self._check()
        return self._manager.get_finished()

    def wait(self, job_ids: Iterable[int], *, timeout: float | None = None) -> list[TransferResult]:
        """Block until the results of ``job_ids`` are in; return them in that order."""
        self._check()
        return self._manager.wait_blocking(job_ids, timeout=timeout)

    def stats(self) -> EngineStats:
        return self._manager.stats()

    @property
    def manager(self) -> OffloadingQueueManager:
        """The hosted manager (its thread-safe methods may be called directly)."""
        return self._manager

    # ------------------------------------------------------------ lifecycle

    @property
    def closed(self) -> bool:
        return self._closed

    def close(
        self, *, cancel_queued: bool = False, timeout: float | None = None
    ) -> list[TransferResult]:
        """Finish (or, with ``cancel_queued``, cancel) queued jobs, await in-flight
        ones for at most ``timeout`` s, stop the loop thread, and return the
        results nobody collected. Idempotent: later calls return ``[]``.

        If a handler fails to close, the engine still ends closed and this
        raises that error; the results nobody collected are then in
        :attr:`leftover_results`."""
        if self._host.in_loop_thread():
            raise WrongThreadError("close() cannot run on the engine's own loop thread")
        current = threading.current_thread()
        for handler in self._manager.handlers:
            if handler.owns_thread(current):
                # close waits for every job, the one this thread is running included
                raise WrongThreadError(
                    f"close() cannot run on a thread of {handler.name} ({current.name}): "
                    "it would wait for the job that thread is running"
                )
        timeout = check_wait_timeout(timeout)
        with self._close_lock:
            if self._closed:
                return []
            self._closed = True
            try:
                return self._host.close(cancel_queued=cancel_queued, timeout=timeout)
            except Exception:
                self.leftover_results = self._manager.leftover_results
                raise

    def __enter__(self) -> SyncOffloadingEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.leftover_results = tuple(self.close(cancel_queued=exc is not None))

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and hasattr(self, "_host"):
            warnings.warn(
                f"{type(self).__name__} was never closed: call close() or use 'with'",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )

    def __repr__(self) -> str:
        return repr(self._manager).replace(type(self._manager).__name__, type(self).__name__, 1)
