"""Thread-safe delivery of results: drain, await, async-iterate, and blocking wait.

The store owns the job-id namespace: an id is *live* from submit until its
result is collected, and a live id cannot be submitted again. Every job gets
exactly one result, and a result leaves the store exactly once, through
whichever of these collects it first:

* :meth:`CompletionStore.drain` (``get_finished``), never blocks;
* :meth:`CompletionStore.wait` (async) or :meth:`CompletionStore.wait_blocking`
  (another thread), which *claim* their ids first, so a concurrent drain or
  close leaves those results to them;
* :meth:`CompletionStore.next_result`, behind ``async for``.

Cross-thread safety: every field is guarded by the lock the manager passes in
(one lock for job state and results, so "job finished" and "result visible"
change together). Threads blocked in :meth:`wait_blocking` sleep on a
``threading.Condition`` over that lock. Tasks sleep on an anyio event that only
the loop thread sets; a producer on another thread asks the loop to set it
through :class:`~offload_engine._loop.LoopBridge` (the manager coalesces those
asks into at most one pending callback).
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import threading
import time
from collections.abc import Iterable

import anyio

from offload_engine.errors import (
    DuplicateJobIdError,
    EngineClosedError,
    UnknownJobError,
)
from offload_engine.vocabulary import TransferResult

_INT64_MAX = (1 << 63) - 1

#: Seconds from which a timeout means "no bound" (about 31 years). A thread's
#: blocking wait cannot take much more (``threading.TIMEOUT_MAX``, the platform's
#: ``time_t``), and nobody means a longer one.
UNBOUNDED = 1e9


def check_job_id(job_id: object) -> int:
    """Return ``job_id`` as a plain int, or raise a typed error.

    An ``int`` subclass comes back as a plain ``int``, so no method of the
    caller's class runs later, under the engine's lock.
    """
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise TypeError(f"job ids are ints, got {type(job_id).__name__}: {job_id!r}")
    value = operator.index(job_id)  # exact int; runs no code of an int subclass
    if not 0 <= value <= _INT64_MAX:
        raise ValueError(f"job ids lie in [0, 2**63), got {value}")
    return value


def check_job_ids(job_ids: object) -> list[int]:
    """Materialise the caller's iterable of job ids, outside any lock.

    Consuming it may run the caller's code (a generator that submits, say);
    doing that under the engine's lock would deadlock the engine.
    """
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise TypeError(f"job ids come as an iterable of ints, got {type(job_ids).__name__}")
    return [check_job_id(j) for j in list(job_ids)]


def _seconds(value: numbers.Real) -> float:
    """``float(value)``; an int too large for a float (10**400) is +-inf."""
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def check_wait_timeout(timeout: object, *, what: str = "timeout") -> float | None:
    """Return a bound on a wait (``None``: no bound), or raise a typed error.

    A real number; zero or less means "do not wait", and ``inf`` or anything
    from :data:`UNBOUNDED` seconds up means no bound (``None``). NaN is
    refused (it compared false with every deadline, so a wait never ended),
    and so are bools and non-numbers.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, got {timeout!r}")
    value = _seconds(timeout)
    if math.isnan(value):
        raise ValueError(f"{what} must be a number of seconds or None, got NaN")
    return None if value >= UNBOUNDED else value


def check_job_timeout(
    timeout: object, *, what: str = "timeout", error: type[ValueError] = ValueError
) -> float | None:
    """Return a job's time limit (``None``: no limit), or raise a typed error.

    A positive number of seconds; ``inf`` or anything from :data:`UNBOUNDED`
    up means no limit. ``None`` passes through. Bools and non-numbers raise
    ``TypeError``; zero, negative values and NaN raise ``error``.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} must be a positive number of seconds or None, got {timeout!r}")
    value = _seconds(timeout)
    if not value > 0:  # NaN too
        raise error(f"{what} must be a positive number of seconds, got {timeout!r}")
    return None if value >= UNBOUNDED else value


class CompletionStore:
    """Results waiting to be collected, and the ids that will produce them."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._pending: set[int] = set()  # submitted, no result yet
        self._ready: dict[int, TransferResult] = {}  # insertion order = finish order
        self._claimed: set[int] = set()
        self._auto_ids = itertools.count()
        self._sync_waiters = 0
        # Created by a task about to sleep; taken (and set on the loop) by a waker.
        self._changed: anyio.Event | None = None
        self._closed = False

    # ------------------------------------------------------------ lock held

    def reserve_locked(self, job_id: int | None) -> int:
        """Take ``job_id`` (or a fresh one) for a new job."""
        if job_id is None:
            job_id = next(self._auto_ids)
            while job_id in self._pending or job_id in self._ready:
                job_id = next(self._auto_ids)
        elif job_id in self._pending or job_id in self._ready:
            raise DuplicateJobIdError(
                f"job id {job_id} is still live (its result has not been collected)"
            )
        self._pending.add(job_id)
        return job_id

    def post_locked(self, result: TransferResult) -> None:
        self._pending.discard(result.job_id)
        self._ready[result.job_id] = result

    def wake_locked(self) -> anyio.Event | None:
        """Wake blocked threads now; return the event that sleeping tasks wait
        on, which the caller must set on the loop thread."""
        if self._sync_waiters:
            self._cond.notify_all()
        event, self._changed = self._changed, None
        return event

    def drain_locked(self) -> list[TransferResult]:
        ready = self._ready
        if not ready:
            return []
        if not self._claimed:
            out = list(ready.values())
            ready.clear()
            return out
        out = [r for jid, r in ready.items() if jid not in self._claimed]
        for r in out:
            del ready[r.job_id]
        return out

    def close_locked(self) -> anyio.Event | None:
        self._closed = True
        self._cond.notify_all()
        event, self._changed = self._changed, None
        return event

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def is_live_locked(self, job_id: int) -> bool:
        return job_id in self._pending or job_id in self._ready

    # ------------------------------------------------------------ collectors

    def drain(self) -> list[TransferResult]:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed; close() returned the last results")
            return self.drain_locked()

    def _claim_locked(self, wanted: list[int]) -> list[int]:
        """Claim ``wanted`` (plain ints, from :func:`check_job_ids`)."""
        if self._closed:
            raise EngineClosedError("the engine is closed; close() returned the last results")
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"job ids repeat in {wanted}")
        for jid in wanted:
            if jid in self._claimed:
                raise UnknownJobError(f"job {jid} is already being waited on elsewhere")
            if jid not in self._pending and jid not in self._ready:
                raise UnknownJobError(
                    f"job {jid} is not live (never submitted, or its result was collected)"
                )
        self._claimed.update(wanted)
        return wanted

    def _take_if_ready_locked(self, wanted: list[int]) -> list[TransferResult] | None:
        ready = self._ready
        if all(j in ready for j in wanted):
            out = [ready.pop(j) for j in wanted]
            self._claimed.difference_update(wanted)
            return out
        return None

    async def wait(self, ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        """Await the results of ``ids``; returned in the order of ``ids``."""
        timeout = check_wait_timeout(timeout)
        ids = check_job_ids(ids)
        with self._lock:
            wanted = self._claim_locked(ids)
            done = self._take_if_ready_locked(wanted)
            if done is not None:
                return done
        try:
            with anyio.fail_after(timeout):
                while True:
                    with self._lock:
                        done = self._take_if_ready_locked(wanted)
                        if done is not None:
                            return done
                        if self._changed is None:
                            self._changed = anyio.Event()
                        event = self._changed
                    await event.wait()
        finally:
            with self._lock:
                self._claimed.difference_update(wanted)

    def wait_blocking(
        self, ids: Iterable[int], timeout: float | None = None
    ) -> list[TransferResult]:
        """Block the calling thread until the results of ``ids`` are in."""
        timeout = check_wait_timeout(timeout)
        wanted = check_job_ids(ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            wanted = self._claim_locked(wanted)
            try:
                while True:
                    done = self._take_if_ready_locked(wanted)
                    if done is not None:
                        return done
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        missing = [j for j in wanted if j not in self._ready]
                        raise TimeoutError(f"jobs {missing} did not finish within {timeout}s")
                    self._sync_waiters += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        self._sync_waiters -= 1
            finally:
                self._claimed.difference_update(wanted)

    async def next_result(self) -> TransferResult | None:
        """The next unclaimed result; ``None`` once closed and empty."""
        while True:
            with self._lock:
                for jid, result in self._ready.items():
                    if jid not in self._claimed:
                        del self._ready[jid]
                        return result
                if self._closed:
                    return None
                if self._changed is None:
                    self._changed = anyio.Event()
                event = self._changed
            await event.wait()
