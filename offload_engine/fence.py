"""``JobFence``: one job's completion, for a host thread or for a device stream.

A forward pass that reads KV blocks as they arrive (layer by layer) must not
block its host thread on each copy: on an accelerator it is enough that the
model's stream waits for the copy. A fence passed in a job's
:class:`~offload_engine.TransferSpec` gives both:

- :meth:`JobFence.wait` blocks the calling thread until the job's result is in
  (any handler);
- :meth:`JobFence.wait_on_stream` makes the caller's current device stream wait
  for the job's copies and returns as soon as they are enqueued, which a device
  handler does at launch, long before they finish. Where the job has no device
  work (host memory), it waits on the host like :meth:`wait`.

Either call raises the job's error if it failed before its copies were
enqueued. A failure on the device afterwards surfaces in the job's result
(``get_finished``/``wait``): a caller that must never compute on a partial
cache checks those results before it trusts the blocks.

A fence serves one job: the engine refuses it in a second submit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from offload_engine.errors import InvalidTransferError, JobTimeoutError


class JobFence:
    """Created by the caller, passed as ``TransferSpec(..., fence=fence)``, signalled by
    the engine (completion) and by a device handler (launch)."""

    __slots__ = ("_claimed", "_done", "_error", "_lock", "_ready", "_stream_wait")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()  # the job's result is in
        self._ready = threading.Event()  # launched on a device, or done
        self._stream_wait: Callable[[], None] | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------ the engine's side

    def claim(self) -> None:
        """Taken by the engine when a job carrying it is queued; a second claim is refused."""
        with self._lock:
            if self._claimed:
                raise InvalidTransferError(
                    "this JobFence already belongs to a submitted job: use one fence per job"
                )
            self._claimed = True

    def release_claim(self) -> None:
        """The submit that claimed it was refused after the claim: the fence is free again."""
        with self._lock:
            self._claimed = False

    def launched(self, stream_wait: Callable[[], None]) -> None:
        """A device handler enqueued the job's copies; ``stream_wait()`` makes the calling
        thread's current stream wait for them."""
        self._stream_wait = stream_wait
        self._ready.set()

    def finished(self, error: BaseException | None) -> None:
        """The job's result is in (``error`` None on success). Called once, by the engine."""
        self._error = error
        self._done.set()
        self._ready.set()

    # ------------------------------------------------------------ the caller's side

    @property
    def done(self) -> bool:
        """Whether the job's result is in."""
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """The job's error once it failed, else None."""
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until the job is done; raise its error if it failed, or
        :class:`~offload_engine.JobTimeoutError` after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise JobTimeoutError(f"the fenced job did not finish within {timeout}s")
        if self._error is not None:
            raise self._error

    def wait_on_stream(self, timeout: float | None = None) -> None:
        """Make the current device stream wait for the job's copies; on the host, wait
        for the job itself. Returns once that is arranged; raises the job's error if it
        failed before its copies were enqueued, or
        :class:`~offload_engine.JobTimeoutError` if the job was neither launched nor
        done within ``timeout`` seconds (it sits behind other jobs)."""
        if not self._ready.wait(timeout):
            raise JobTimeoutError(f"the fenced job was not launched within {timeout}s")
        stream_wait = self._stream_wait
        if stream_wait is None or self._done.is_set():
            # no device work to wait on, or it is finished: the result decides
            self.wait(timeout)
            return
        stream_wait()

    def __repr__(self) -> str:
        state = "done" if self.done else "launched" if self._ready.is_set() else "pending"
        return f"<JobFence {state}>"
