"""Public fakes and helpers for driving an engine in tests, deterministically.

:class:`FakeHandler` is a scriptable handler for any medium pair:

* ``latency=0`` (default): each job completes inside ``launch`` (instant);
* ``latency=s`` or ``latency=lambda job_id: s``: each job completes ``s``
  seconds after launch, from an engine task sleeping on the loop's clock;
  a latency that falls with the job id makes jobs finish out of order;
* ``manual=True``: launched jobs wait until the test calls :meth:`complete`,
  :meth:`complete_all` or :meth:`fail_job` (from any thread);
* ``fail=`` and ``raise_on_launch=``: a set of job ids or a predicate naming
  jobs that fail (reported failure) or whose launch raises.

Tests synchronise on :meth:`FakeHandler.wait_launched` and on results, never
on sleeps. The helpers below build small random host setups for tests,
examples and benchmarks.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Collection, Iterable
from typing import TypeVar

import anyio

from offload_engine.engine.handler import HandlerContext, LaunchedJob, TransferHandler
from offload_engine.errors import InvalidTransferError
from offload_engine.vocabulary import Medium, TransferResult, TransferSpec

T = TypeVar("T")

JobPredicate = Callable[[int], bool]


class FakeTransferFailure(RuntimeError):
    """The error a :class:`FakeHandler` reports for jobs scripted to fail."""


def _as_predicate(value: Collection[int] | JobPredicate | None) -> JobPredicate:
    if value is None:
        return lambda _jid: False
    if callable(value):
        return value
    ids = frozenset(value)
    return ids.__contains__


class FakeHandler(TransferHandler[int]):
    """A handler that moves no bytes and does exactly what the test scripts."""

    def __init__(
        self,
        src: Medium = Medium.GPU,
        dst: Medium = Medium.CPU,
        *,
        latency: float | Callable[[int], float] = 0.0,
        manual: bool = False,
        fail: Collection[int] | JobPredicate | None = None,
        raise_on_launch: Collection[int] | JobPredicate | None = None,
        ordered: bool = True,
        max_inflight: int = 64,
        bytes_per_block: int = 1,
    ) -> None:
        self.src = src
        self.dst = dst
        self.ordered = ordered
        self.max_inflight = max_inflight
        self._latency = latency
        self._manual = manual
        self._fails = _as_predicate(fail)
        self._raises = _as_predicate(raise_on_launch)
        self._bytes_per_block = bytes_per_block
        self._lock = threading.Lock()
        self._launch_cond = threading.Condition(self._lock)
        self.launched: list[int] = []  # job ids, launch order
        self.completed: list[int] = []  # job ids reported (succeeded or failed)
        self.held: dict[int, LaunchedJob[int]] = {}  # manual mode: launched, not reported
        self._launch_waiters: list[tuple[int, anyio.Event]] = []
        self._timers: list[tuple[float, int, LaunchedJob[int]]] = []
        self._seq = itertools.count()
        self._timer_wake: anyio.Event | None = None
        self._timed = not manual and (callable(latency) or latency > 0)
        self.started = False
        self.closed = False

    # ------------------------------------------------------------ contract

    def prepare(self, spec: TransferSpec) -> int:
        if len(spec.src) != len(spec.dst):
            raise InvalidTransferError(
                f"FakeHandler moves blocks one to one: {len(spec.src)} != {len(spec.dst)}"
            )
        return len(spec.src) * self._bytes_per_block

    def start(self, context: HandlerContext) -> None:
        self.started = True
        if self._timed:
            context.start_task(self._timer_task)

    def launch(self, job: LaunchedJob[int]) -> None:
        jid = job.job_id
        with self._lock:
            self.launched.append(jid)
            self._launch_cond.notify_all()
            n = len(self.launched)
            ready = [e for k, e in self._launch_waiters if k <= n]
            self._launch_waiters = [(k, e) for k, e in self._launch_waiters if k > n]
        for event in ready:
            event.set()
        if self._raises(jid):
            raise FakeTransferFailure(f"fake launch failure for job {jid}")
        if self._manual:
            with self._lock:
                self.held[jid] = job
            return
        if self._timed:
            lat = self._latency(jid) if callable(self._latency) else self._latency
            heapq.heappush(self._timers, (anyio.current_time() + lat, next(self._seq), job))
            wake, self._timer_wake = self._timer_wake, None
            if wake is not None:
                wake.set()
            return
        self._report(job)

    async def aclose(self) -> None:
        self.closed = True

    # ------------------------------------------------------------ scripting

    def _report(self, job: LaunchedJob[int]) -> None:
        with self._lock:
            self.completed.append(job.job_id)
        if self._fails(job.job_id):
            job.fail(FakeTransferFailure(f"fake transfer failure for job {job.job_id}"))
        else:
            job.succeed(job.prepared)

    async def _timer_task(self) -> None:
        while True:
            now = anyio.current_time()
            while self._timers and self._timers[0][0] <= now:
                _, _, job = heapq.heappop(self._timers)
                self._report(job)
            delay = self._timers[0][0] - now if self._timers else float("inf")
            self._timer_wake = event = anyio.Event()
            with anyio.move_on_after(delay):
                await event.wait()

    def complete(self, job_id: int) -> None:
        """Manual mode: report ``job_id`` (success unless scripted to fail). Any thread."""
        with self._lock:
            job = self.held.pop(job_id)
        self._report(job)

    def fail_job(self, job_id: int, error: BaseException | None = None) -> None:
        """Manual mode: report ``job_id`` as failed. Any thread."""
        with self._lock:
            job = self.held.pop(job_id)
            self.completed.append(job_id)
        job.fail(error or FakeTransferFailure(f"fake transfer failure for job {job_id}"))

    def complete_all(self, order: Iterable[int] | None = None) -> None:
        """Manual mode: report every held job, in ``order`` if given, else launch order."""
        with self._lock:
            ids = list(order) if order is not None else list(self.held)
        for jid in ids:
            self.complete(jid)

    async def wait_launched(self, count: int) -> None:
        """Return once at least ``count`` jobs have been launched. Engine loop only."""
        with self._lock:
            if len(self.launched) >= count:
                return
            event = anyio.Event()
            self._launch_waiters.append((count, event))
        await event.wait()

    def wait_launched_blocking(self, count: int, timeout: float = 10.0) -> None:
        """Block a thread (not the engine's loop) until ``count`` jobs were launched."""
        with self._launch_cond:
            if not self._launch_cond.wait_for(lambda: len(self.launched) >= count, timeout):
                raise TimeoutError(f"{len(self.launched)} of {count} jobs launched in {timeout}s")


# ---------------------------------------------------------------- helpers


def assert_exactly_once(submitted: Iterable[int], results: Iterable[TransferResult]) -> None:
    """Raise ``AssertionError`` unless every submitted id has exactly one result."""
    want = sorted(submitted)
    got = sorted(r.job_id for r in results)
    if want != got:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        dups = sorted({j for j in got if got.count(j) > 1}) if len(got) < 10_000 else "?"
        raise AssertionError(
            f"results do not match jobs: missing {missing[:10]}, unexpected {extra[:10]}, "
            f"duplicated {dups}"
        )


def call_in_thread(fn: Callable[[], T], bound: float = 10.0) -> T:
    """Run ``fn()`` in a fresh thread and return its result, or re-raise its exception
    here. Raise ``AssertionError`` if it has not returned within ``bound`` seconds: a
    hang fails the test instead of hanging it (the thread is a daemon)."""
    out: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name="call-in-thread", daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        raise AssertionError(f"{fn} did not return within {bound}s (a hang)")
    if errors:
        raise errors[0]
    return out[0]


def engine_threads() -> list[threading.Thread]:
    """Live threads started by this package (their names start with ``offload-engine``)."""
    return [t for t in threading.enumerate() if t.name.startswith("offload-engine")]
