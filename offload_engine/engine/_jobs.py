"""The job record and one handler's route (queue, in-flight table, counters).

A :class:`Job` is also the :class:`~offload_engine.engine.handler.LaunchedJob` a
handler sees. It knows nothing of the manager: it hands its verdict to the
``report`` callable it was built with. Every field is read and written under
the manager's one lock; the job only checks its arguments before reporting.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import anyio

from offload_engine.engine._waits import Waits
from offload_engine.engine.handler import TransferHandler
from offload_engine.engine.stats import HandlerStats
from offload_engine.errors import TransferError
from offload_engine.vocabulary import CacheBlocks, TransferSpec

QUEUED: Final = 0
INFLIGHT: Final = 1
DONE: Final = 2

#: (success, nbytes, seconds, error, strategy) once a job is resolved
Outcome = tuple[bool, int, float, BaseException | None, str | None]

#: what a job calls with its verdict: (job, success, nbytes, seconds or None, error,
#: the strategy the handler names or None)
Reporter = Callable[["Job", bool, int, "float | None", "BaseException | None", "str | None"], None]


class Job:
    """One job. Also the :class:`~offload_engine.engine.handler.LaunchedJob` a handler sees."""

    __slots__ = (
        "_report",
        "deadline",
        "job_id",
        "outcome",
        "prepared",
        "route",
        "spec",
        "state",
        "t_launch",
        "t_submit",
    )

    def __init__(
        self,
        report: Reporter,
        route: Route,
        job_id: int,
        spec: TransferSpec,
        prepared: object,
        t_submit: float,
        deadline: float | None,
    ) -> None:
        self._report = report
        self.route = route
        self.job_id = job_id
        self.spec = spec
        self.prepared = prepared
        self.t_submit = t_submit
        self.t_launch = t_submit
        self.deadline = deadline
        self.state = QUEUED
        self.outcome: Outcome | None = None

    @property
    def resolved(self) -> bool:
        return self.outcome is not None

    def succeed(
        self, nbytes: int, seconds: float | None = None, strategy: str | None = None
    ) -> None:
        # A malformed report is the handler's bug, but raising here would kill the
        # reporting thread (a worker, a watcher) and leave the job without a result.
        # It fails the job instead, with an error that names the bad value.
        try:
            count = int(nbytes)
            secs = None if seconds is None else float(seconds)
            if count < 0 or (secs is not None and not secs >= 0):
                raise ValueError("byte counts and durations are non-negative")
            if strategy is not None and not isinstance(strategy, str):
                raise TypeError("a strategy is named by a str")
        except (TypeError, ValueError, OverflowError) as exc:
            bad = TransferError(
                f"job {self.job_id}: {self.route.handler.name} reported success with an invalid "
                f"byte count, duration or strategy (nbytes={nbytes!r}, seconds={seconds!r}, "
                f"strategy={strategy!r})"
            )
            bad.__cause__ = exc
            self._report(self, False, 0, None, bad, None)
            return
        self._report(self, True, count, secs, None, strategy)

    def fail(self, error: BaseException) -> None:
        if not isinstance(error, BaseException):
            error = TypeError(f"the handler reported a failure that is not an exception: {error!r}")
        if isinstance(error, TransferError):
            wrapped: BaseException = error
        else:
            wrapped = TransferError(
                f"job {self.job_id} failed in {self.route.handler.name}: {error!r}"
            )
            wrapped.__cause__ = error
        self._report(self, False, 0, None, wrapped, None)

    def __repr__(self) -> str:
        state = ("queued", "in flight", "done")[self.state]
        return f"<job {self.job_id} {self.route.label} {state}>"


class Route:
    """One handler's queue, in-flight table and counters."""

    __slots__ = (
        "abandoned",
        "bytes_loaded",
        "bytes_moved",
        "bytes_stored",
        "cancelled",
        "capacity",
        "failed",
        "handler",
        "inflight",
        "label",
        "launch_in_submitter",
        "launching",
        "loads_succeeded",
        "max_inflight",
        "ordered",
        "queue",
        "space",
        "space_threads",
        "stores_succeeded",
        "strategies",
        "submitted",
        "succeeded",
        "timed_out",
        "waits",
        "wake",
    )

    def __init__(self, handler: TransferHandler[Any], capacity: int) -> None:
        self.handler = handler
        self.label = f"{handler.src.value}->{handler.dst.value}"
        self.capacity = capacity
        self.max_inflight = int(handler.max_inflight)
        self.ordered = bool(handler.ordered)
        self.launch_in_submitter = bool(handler.launch_in_submitter)
        self.waits = Waits((handler,))  # the hooks of a wait for this route's jobs
        # a thread is inside handler.launch for this route (the route task or a
        # submitter); launches of one route never overlap, so they keep queue order
        self.launching = False
        self.queue: deque[Job] = deque()
        self.inflight: dict[int, Job] = {}  # insertion order = launch order
        self.wake: anyio.Event | None = None  # set while the route task sleeps
        # room in the queue: what a task, and what a thread, waiting for it sleeps on
        self.space: anyio.Event | None = None  # set on the loop
        self.space_threads: threading.Event | None = None  # set at once, under the lock
        self.submitted = self.succeeded = self.failed = 0
        self.cancelled = self.timed_out = self.abandoned = self.bytes_moved = 0
        # successful jobs by direction (a handler may serve both, e.g. CPU<->CPU)
        self.stores_succeeded = self.loads_succeeded = 0
        self.bytes_stored = self.bytes_loaded = 0
        self.strategies: dict[str, int] = {}  # successful jobs per strategy named

    @property
    def count(self) -> int:
        return len(self.queue) + len(self.inflight)

    def hand_to_submitter_locked(self, job: Job) -> bool:
        """Put a new ``job`` in flight for the submitting thread to launch, when the
        handler launches in the submitter and the route is idle with room; else
        False (the job is to be queued for the route task).

        The route stays ``launching`` until the submitter's launch returns."""
        if (
            self.launch_in_submitter  # the caller tests it first too: the common case
            and not self.queue
            and not self.launching
            and len(self.inflight) < self.max_inflight
        ):
            job.state = INFLIGHT
            self.inflight[job.job_id] = job
            self.launching = True
            return True
        return False

    def task_room_locked(self) -> anyio.Event:
        """What a task that found the queue full sleeps on until a job leaves it
        (or the engine closes or breaks)."""
        if self.space is None:
            self.space = anyio.Event()
        return self.space

    def thread_room_locked(self) -> threading.Event:
        """The same, for a thread."""
        if self.space_threads is None:
            self.space_threads = threading.Event()
        return self.space_threads

    def wake_room_locked(self, todo: list[anyio.Event]) -> None:
        """Wake every submitter waiting for room: threads at once, tasks through
        ``todo`` (set on the loop after the lock)."""
        if self.space is not None:
            todo.append(self.space)
            self.space = None
        if self.space_threads is not None:
            self.space_threads.set()
            self.space_threads = None

    def count_success(self, spec: TransferSpec, nbytes: int, strategy: str | None) -> None:
        """Count one successful job, by direction where it has one, and by the
        strategy its handler named."""
        self.succeeded += 1
        self.bytes_moved += nbytes
        if strategy is not None:
            self.strategies[strategy] = self.strategies.get(strategy, 0) + 1
        src_cache = isinstance(spec.src, CacheBlocks)
        if src_cache != isinstance(spec.dst, CacheBlocks):
            if src_cache:
                self.stores_succeeded += 1
                self.bytes_stored += nbytes
            else:
                self.loads_succeeded += 1
                self.bytes_loaded += nbytes

    def snapshot(self) -> HandlerStats:
        return HandlerStats(
            src=self.handler.src,
            dst=self.handler.dst,
            handler=self.handler.name,
            submitted=self.submitted,
            succeeded=self.succeeded,
            failed=self.failed,
            cancelled=self.cancelled,
            timed_out=self.timed_out,
            abandoned=self.abandoned,
            bytes_moved=self.bytes_moved,
            queued=len(self.queue),
            stores_succeeded=self.stores_succeeded,
            loads_succeeded=self.loads_succeeded,
            bytes_stored=self.bytes_stored,
            bytes_loaded=self.bytes_loaded,
            by_strategy=tuple(sorted(self.strategies.items())),
            in_flight=len(self.inflight),
            capacity=self.capacity,
        )
