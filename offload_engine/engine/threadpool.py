"""A handler whose jobs run on its own worker threads (host memcpy, file I/O).

``launch`` hands the job to a ``queue.SimpleQueue`` (thread-safe, never blocks)
and returns. A worker thread runs :meth:`ThreadPoolHandler.execute` and reports
through ``job.succeed``/``job.fail``, which are thread-safe. Closing enqueues
one stop marker per worker and awaits, without blocking the loop, a signal the
last exiting worker raises; the threads are then joined.

A worker stuck inside a job (a transfer that never returns) cannot be stopped.
The engine has given that job its result already (timed out, or abandoned at
close), so close waits for the workers at most ``close_timeout`` seconds, then
raises :class:`~offload_engine.EngineBrokenError` instead of hanging; the stuck
worker exits by itself once its job returns.
"""

from __future__ import annotations

import abc
import queue
import threading
from typing import TypeVar

from offload_engine._checks import check_int, check_seconds
from offload_engine._loop import ThreadSignal, block_application_signals, join_threads
from offload_engine.engine.handler import HandlerContext, LaunchedJob, TransferHandler

P = TypeVar("P")

_STOP = object()


class ThreadPoolHandler(TransferHandler[P], abc.ABC):
    """Runs :meth:`execute` for each job on one of ``workers`` threads.

    With one worker, jobs run and finish in launch order. With more, they run
    concurrently; ``ordered`` (default True) still makes the engine deliver
    results in launch order.
    """

    def __init__(
        self,
        *,
        workers: int = 1,
        thread_name: str = "offload-engine-worker",
        close_timeout: float = 30.0,
    ) -> None:
        check_int(workers, "workers")
        self.workers = workers
        self.close_timeout = check_seconds(close_timeout, "close_timeout")
        self.max_inflight = 2 * workers  # one running and one waiting per worker
        self._thread_name = thread_name
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._alive = 0
        self._alive_lock = threading.Lock()
        self._all_exited: ThreadSignal | None = None

    @abc.abstractmethod
    def execute(self, job: LaunchedJob[P]) -> int:
        """Move the job's bytes on a worker thread; return the byte count."""

    def start(self, context: HandlerContext) -> None:
        self._all_exited = ThreadSignal(context.call_soon)
        self._alive = self.workers
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"{self._thread_name}-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def launch(self, job: LaunchedJob[P]) -> None:
        self._queue.put(job)

    def owns_thread(self, thread: threading.Thread) -> bool:
        return thread in self._threads

    def _work(self) -> None:
        block_application_signals()
        get = self._queue.get
        try:
            while True:
                item = get()
                if item is _STOP:
                    return
                job: LaunchedJob[P] = item  # type: ignore[assignment]
                if job.resolved:  # timed out or abandoned while waiting
                    continue
                try:
                    job.succeed(self.execute(job))
                except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                    # also covers a report that raised: the worker must outlive any job
                    # (a report that was recorded makes this later fail() a no-op)
                    job.fail(exc)
        finally:
            with self._alive_lock:
                self._alive -= 1
                last = self._alive == 0
            if last and self._all_exited is not None:
                self._all_exited.set()

    async def aclose(self) -> None:
        if not self._threads:
            return
        for _ in self._threads:
            self._queue.put(_STOP)
        await join_threads(
            self._threads,
            self._all_exited,
            self.close_timeout,
            f"of {self.name} still inside a job (they exit when it returns)",
        )
