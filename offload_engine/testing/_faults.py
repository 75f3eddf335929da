"""Fault injection and exactly-once accounting, for chaos tests and benchmarks.

Part of the public testing kit, :mod:`offload_engine.testing`:

* :class:`FaultPlan` makes one :class:`~offload_engine.TransferSpec` per :class:`Fault` for a
  medium pair. A job's fault is the spec it was submitted with, so it is fixed at submit and
  needs no job-id bookkeeping (ids may be automatic, explicit or reused).
* :class:`FaultyHandler` is a thread-pool handler that does what each job's fault says: complete
  on a worker thread or inside ``launch``, report a failure, raise in the worker, raise in
  ``launch``, misreport its byte count, refuse the job at submit, or never report at all (a lost
  completion, like a device event that never fires).
* :class:`Ledger` counts, from any number of threads, the jobs the engine accepted and the
  results that came back, and checks each result against its job's fault. Its
  :meth:`Ledger.report` gives lost results, duplicates and impossible outcomes; all must be 0.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from offload_engine.engine.handler import LaunchedJob
from offload_engine.engine.threadpool import ThreadPoolHandler
from offload_engine.errors import (
    InvalidTransferError,
    JobCancelledError,
    JobTimeoutError,
    TransferError,
)
from offload_engine.vocabulary import BlockSpec, Medium, TransferResult, TransferSpec


class Fault(enum.Enum):
    """What a :class:`FaultyHandler` does with a job."""

    OK = "ok"  # succeeds on a worker thread
    INSTANT = "instant"  # succeeds inside launch(), on the engine's loop
    FAIL = "fail"  # the worker reports a failure (job.fail)
    RAISE = "raise"  # the worker's copy raises
    LAUNCH_RAISES = "launch_raises"  # launch() raises on the engine's loop
    BAD_REPORT = "bad_report"  # the worker reports success with an invalid byte count
    LOST = "lost"  # accepted and never reported: only a timeout or close ends it
    REFUSED = "refused"  # prepare() refuses it at submit (InvalidTransferError)

    @property
    def can_succeed(self) -> bool:
        return self in (Fault.OK, Fault.INSTANT)

    @property
    def handler_fails(self) -> bool:
        """The handler itself delivers a TransferError for this fault."""
        return self in (Fault.FAIL, Fault.RAISE, Fault.LAUNCH_RAISES, Fault.BAD_REPORT)


class InjectedFault(RuntimeError):
    """The exception a :class:`FaultyHandler` raises or reports on purpose."""


class FaultPlan:
    """One spec per fault for the medium pair ``(src, dst)``; each moves ``blocks`` blocks."""

    def __init__(
        self, src: Medium, dst: Medium, *, blocks: int = 2, bytes_per_block: int = 1
    ) -> None:
        self.pair = (src, dst)
        self.nbytes = blocks * bytes_per_block
        self._specs: dict[Fault, TransferSpec] = {}
        self._faults: dict[int, Fault] = {}
        for i, fault in enumerate(Fault):
            ids = list(range(i * blocks, (i + 1) * blocks))
            spec = TransferSpec(BlockSpec(src, ids), BlockSpec(dst, ids))  # type: ignore[arg-type]
            self._specs[fault] = spec
            self._faults[id(spec)] = fault

    def spec(self, fault: Fault) -> TransferSpec:
        return self._specs[fault]

    def fault_of(self, spec: TransferSpec) -> Fault:
        """The fault ``spec`` stands for; InvalidTransferError for a spec not from this plan."""
        fault = self._faults.get(id(spec))
        if fault is None or self._specs[fault] is not spec:
            raise InvalidTransferError(f"{spec!r} does not come from this fault plan")
        return fault


class FaultyHandler(ThreadPoolHandler[Fault]):
    """Does what each job's :class:`Fault` says. ``delay`` (seconds) bounds a random pause
    of each worker-thread job, so jobs overlap and finish out of order."""

    def __init__(
        self,
        plan: FaultPlan,
        *,
        workers: int = 2,
        ordered: bool = True,
        max_inflight: int | None = None,
        delay: float = 0.0,
        thread_name: str = "offload-engine-faulty",
    ) -> None:
        super().__init__(workers=workers, thread_name=thread_name)
        self.src, self.dst = plan.pair
        self.ordered = ordered
        if max_inflight is not None:
            self.max_inflight = max_inflight
        self.plan = plan
        self._delay = delay
        self._counts_lock = threading.Lock()
        self._counts: Counter[Fault] = Counter()

    @property
    def injected(self) -> dict[Fault, int]:
        """How many times each fault was acted out (OK and INSTANT: jobs completed)."""
        with self._counts_lock:
            return dict(self._counts)

    def _count(self, fault: Fault) -> None:
        with self._counts_lock:
            self._counts[fault] += 1

    def prepare(self, spec: TransferSpec) -> Fault:
        fault = self.plan.fault_of(spec)
        if fault is Fault.REFUSED:
            self._count(fault)
            raise InvalidTransferError("refused at submit by fault injection")
        return fault

    def launch(self, job: LaunchedJob[Fault]) -> None:
        fault = job.prepared
        if fault is Fault.LAUNCH_RAISES:
            self._count(fault)
            raise InjectedFault(f"injected launch failure of job {job.job_id}")
        if fault is Fault.LOST:
            self._count(fault)
            return
        if fault is Fault.INSTANT:
            self._count(fault)
            job.succeed(self.plan.nbytes)
            return
        super().launch(job)

    def execute(self, job: LaunchedJob[Fault]) -> int:
        if self._delay:
            time.sleep(random.random() * self._delay)  # a transfer's duration, simulated
        fault = job.prepared
        self._count(fault)
        if fault is Fault.FAIL:
            job.fail(InjectedFault(f"injected transfer failure of job {job.job_id}"))
            return 0  # the pool's success report that follows is ignored
        if fault is Fault.RAISE:
            raise InjectedFault(f"injected worker exception in job {job.job_id}")
        if fault is Fault.BAD_REPORT:
            return None  # type: ignore[return-value]  # a handler bug, on purpose
        return self.plan.nbytes


# --------------------------------------------------------------------------- accounting


def outcome_name(result: TransferResult) -> str:
    """``"ok"`` or the error's class name."""
    return "ok" if result.success else type(result.error).__name__


def check_outcome(result: TransferResult, fault: Fault, timed: bool, nbytes: int) -> str | None:
    """Why ``result`` is impossible for a job with ``fault`` (``timed``: submitted with a
    timeout), or ``None`` if it is allowed."""
    err = result.error
    if result.success:
        if err is not None or not fault.can_succeed or result.bytes_moved != nbytes:
            return f"job {result.job_id} ({fault.value}) succeeded: {result}"
        return None
    if result.bytes_moved != 0 or err is None:
        return f"job {result.job_id} failed with bytes or without an error: {result}"
    if isinstance(err, JobTimeoutError):
        return None if timed else f"job {result.job_id} timed out without a timeout: {result}"
    allowed = (
        isinstance(err, JobCancelledError)  # cancelled while queued, or at close: any job
        or (isinstance(err, TransferError) and fault.handler_fails)
    )
    return None if allowed else f"job {result.job_id} ({fault.value}, timed={timed}) got {err!r}"


@dataclass
class LedgerReport:
    """What a :class:`Ledger` saw. ``clean`` means no result was lost, doubled, unexpected
    or impossible, and every confirmed cancel produced a cancelled result."""

    jobs: int
    results: int
    lost: int
    duplicates: int
    unexpected: int
    wrong: int
    cancels_confirmed: int
    cancelled_while_queued: int
    outcomes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (
            self.lost == 0
            and self.duplicates == 0
            and self.unexpected == 0
            and self.wrong == 0
            and self.cancels_confirmed == self.cancelled_while_queued
        )


class _Entry:
    __slots__ = ("accepted", "early", "fault", "nbytes", "results", "timed")

    def __init__(self) -> None:
        self.accepted = 0
        self.results = 0
        self.fault: Fault | None = None
        self.timed = False
        self.nbytes = 0
        self.early: list[TransferResult] = []  # results recorded before their submission


class Ledger:
    """Exactly-once accounting of jobs and results, from any thread.

    Call :meth:`accepted` after each submit the engine accepted, :meth:`collected` with every
    batch of results from any collector (``get_finished``, ``wait``, ``async for``, close),
    and :meth:`cancel_confirmed` when ``cancel`` returned True. A job id may be reused once
    its result is collected, with the same fault. Memory is bounded by the open jobs.
    """

    def __init__(self, max_problems: int = 20) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, _Entry] = {}
        self._jobs = 0
        self._results = 0
        self._wrong = 0
        self._cancels = 0
        self._cancelled_queued = 0
        self._outcomes: Counter[str] = Counter()
        self._problems: list[str] = []
        self._max_problems = max_problems
        # ids whose jobs all got their results, newest last (bounded): a later result for
        # one of them that no submission claims is a duplicate, not an unknown job
        self._done: dict[int, None] = {}
        self._done_cap = 1 << 14

    def _balanced_locked(self, job_id: int) -> None:
        del self._open[job_id]
        done = self._done
        done.pop(job_id, None)
        done[job_id] = None
        if len(done) > self._done_cap:
            del done[next(iter(done))]

    def _problem_locked(self, text: str) -> None:
        self._wrong += 1
        if len(self._problems) < self._max_problems:
            self._problems.append(text)

    def _check_locked(self, entry: _Entry, result: TransferResult) -> None:
        if entry.fault is None:
            entry.early.append(result)
            return
        problem = check_outcome(result, entry.fault, entry.timed, entry.nbytes)
        if problem is not None:
            self._problem_locked(problem)

    def accepted(self, job_id: int, fault: Fault, *, timed: bool = False, nbytes: int) -> None:
        with self._lock:
            self._jobs += 1
            entry = self._open.get(job_id)
            if entry is None:
                entry = self._open[job_id] = _Entry()
            elif entry.fault is not None and (entry.fault, entry.timed) != (fault, timed):
                self._problem_locked(f"job id {job_id} reused for another kind of job")
            entry.accepted += 1
            entry.fault, entry.timed, entry.nbytes = fault, timed, nbytes
            early, entry.early = entry.early, []
            for result in early:
                self._check_locked(entry, result)
            if entry.accepted == entry.results:
                self._balanced_locked(job_id)

    def collected(self, results: Iterable[TransferResult]) -> int:
        """Record results; returns how many."""
        n = 0
        with self._lock:
            for result in results:
                n += 1
                self._results += 1
                self._outcomes[outcome_name(result)] += 1
                err = result.error
                if isinstance(err, JobCancelledError) and "while queued" in str(err):
                    self._cancelled_queued += 1
                entry = self._open.get(result.job_id)
                if entry is None:
                    entry = self._open[result.job_id] = _Entry()
                entry.results += 1
                self._check_locked(entry, result)
                if entry.accepted == entry.results:
                    self._balanced_locked(result.job_id)
        return n

    def cancel_confirmed(self, job_id: int) -> None:
        with self._lock:
            self._cancels += 1

    def open_ids(self) -> list[int]:
        """Ids accepted whose result has not been recorded yet."""
        with self._lock:
            return [j for j, e in self._open.items() if e.accepted > e.results]

    @property
    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def report(self) -> LedgerReport:
        """Totals so far; call it once the engine is closed and every collector recorded."""
        with self._lock:
            lost = duplicates = unexpected = 0
            problems = list(self._problems)
            for jid, e in self._open.items():
                if e.accepted == 0 and jid in self._done:
                    duplicates += e.results
                    problems.append(f"job {jid}: {e.results} more result(s) after its last")
                elif e.accepted == 0:
                    unexpected += e.results
                    problems.append(f"result for job {jid}, which was never accepted")
                elif e.results > e.accepted:
                    duplicates += e.results - e.accepted
                    problems.append(f"job {jid}: {e.results} results for {e.accepted} jobs")
                else:
                    lost += e.accepted - e.results
                    if len(problems) < self._max_problems:
                        problems.append(f"job {jid}: no result ({e.fault}, timed={e.timed})")
            return LedgerReport(
                jobs=self._jobs,
                results=self._results,
                lost=lost,
                duplicates=duplicates,
                unexpected=unexpected,
                wrong=self._wrong,
                cancels_confirmed=self._cancels,
                cancelled_while_queued=self._cancelled_queued,
                outcomes=dict(self._outcomes),
                problems=problems[: self._max_problems],
            )
