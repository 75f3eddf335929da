"""Submits racing close, on the sync facade and on the async API (asyncio and trio).

The contract: a submit either returns an id whose result is delivered exactly
once (by ``get_finished``, a wait or close's return), or raises
:class:`EngineClosedError` and its job never runs. A close is not a broken
engine, so no submit may raise :class:`EngineBrokenError` because of one.

Each round starts two submitting threads (or tasks) that call as fast as they
can, every third call the waiting ``submit`` and the others ``submit_nowait``,
draining ``get_finished()`` on :class:`QueueFullError`. The round closes the
engine once the submitters have made a number of calls drawn at random, so
the close lands before the first submit, among them, or after the queue filled.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import pytest

from offload_engine import (
    EngineBrokenError,
    EngineClosedError,
    OffloadingQueueManager,
    QueueFullError,
    SyncOffloadingEngine,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine._loop import LoopBridge
from offload_engine.testing import FakeHandler, assert_exactly_once

SPEC = TransferSpec(gpu_blocks([1]), cpu_blocks([2]))
#: small, so that submits also meet a full queue and wait for room
CAPACITY = 16
#: the close comes after this many submit calls at most
MAX_CALLS_BEFORE_CLOSE = 400
CLOSE_TIMEOUTS = (None, 0.0, 0.01)
#: a bound on every wait of the test itself: a hang fails the round instead of the run
BOUND = 20.0
ROUNDS = 100
SLOW_ROUNDS = 1500


@dataclass
class Race:
    """What one round saw: the ids submits returned, what they raised, every result."""

    close_after: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    returned: list[int] = field(default_factory=list)
    raised: list[BaseException] = field(default_factory=list)
    results: list[TransferResult] = field(default_factory=list)
    calls: int = 0
    #: set once the submitters made ``close_after`` calls, or one of them stopped
    close_now: threading.Event = field(default_factory=threading.Event)

    def called(self) -> None:
        with self.lock:
            self.calls += 1
            if self.calls >= self.close_after:
                self.close_now.set()

    def got(self, job_id: int) -> None:
        with self.lock:
            self.returned.append(job_id)

    def stopped(self, exc: BaseException) -> None:
        with self.lock:
            self.raised.append(exc)
        self.close_now.set()

    def collect(self, results: Iterable[TransferResult]) -> None:
        with self.lock:
            self.results.extend(results)

    def check(self, launched: Iterable[int], what: str) -> None:
        """Fail, naming every breach of the contract this round saw."""
        problems = [
            f"a submit racing close raised {exc!r}"
            for exc in self.raised
            if not isinstance(exc, EngineClosedError)
        ]
        ran = set(launched) - set(self.returned)
        if ran:
            problems.append(f"jobs {sorted(ran)} ran though no submit returned their ids")
        try:
            assert_exactly_once(self.returned, self.results)
        except AssertionError as exc:
            problems.append(str(exc))
        assert not problems, f"{what}: " + "; ".join(problems)


def _thread_submitter(
    race: Race,
    submit_nowait: Callable[[TransferSpec], int],
    submit: Callable[[TransferSpec], int],
    get_finished: Callable[[], list[TransferResult]],
) -> threading.Thread:
    """A thread submitting until a call raises anything but QueueFullError."""

    def run() -> None:
        n = 0
        while True:
            n += 1
            try:
                try:
                    job_id = submit(SPEC) if n % 3 == 0 else submit_nowait(SPEC)
                finally:
                    race.called()
            except QueueFullError:
                try:
                    race.collect(get_finished())
                except Exception as exc:  # noqa: BLE001 - checked by Race.check
                    race.stopped(exc)
                    return
                continue
            except Exception as exc:  # noqa: BLE001 - checked by Race.check
                race.stopped(exc)
                return
            race.got(job_id)

    thread = threading.Thread(target=run, name="close-race-submitter", daemon=True)
    thread.start()
    return thread


def _join(threads: list[threading.Thread], what: str) -> None:
    for thread in threads:
        thread.join(BOUND)
        if thread.is_alive():
            raise AssertionError(f"{what}: a submitting thread hangs after close")


def _sync_round(backend: str, seed: int) -> None:
    rng = random.Random(seed)
    cancel_queued = bool(seed % 2)
    timeout = rng.choice(CLOSE_TIMEOUTS)
    what = f"sync {backend} seed={seed} cancel_queued={cancel_queued} timeout={timeout}"
    handler = FakeHandler()
    race = Race(close_after=rng.randrange(MAX_CALLS_BEFORE_CLOSE))
    engine = SyncOffloadingEngine([handler], capacity=CAPACITY, backend=backend)  # type: ignore[arg-type]
    threads = [
        _thread_submitter(
            race,
            engine.submit_nowait,
            lambda spec: engine.submit(spec, wait_timeout=5),
            engine.get_finished,
        )
        for _ in range(2)
    ]
    race.close_now.wait(BOUND)
    race.collect(engine.close(cancel_queued=cancel_queued, timeout=timeout))
    _join(threads, what)
    race.check(handler.launched, what)


async def _task_submitter(race: Race, mgr: OffloadingQueueManager) -> None:
    """A task submitting until a call raises anything but QueueFullError."""
    n = 0
    while True:
        n += 1
        try:
            try:
                job_id = await mgr.submit(SPEC) if n % 3 == 0 else mgr.submit_nowait(SPEC)
            finally:
                race.called()
        except QueueFullError:
            race.collect(mgr.get_finished())
            await anyio.lowlevel.checkpoint()
            continue
        except Exception as exc:  # noqa: BLE001 - checked by Race.check
            race.stopped(exc)
            return
        race.got(job_id)
        await anyio.lowlevel.checkpoint()


async def _async_round_body(
    race: Race,
    handler: FakeHandler,
    threads: list[threading.Thread],
    cancel_queued: bool,
    timeout: float | None,
) -> None:
    async with OffloadingQueueManager([handler], capacity=CAPACITY) as mgr:
        # Threads race the close and, after it, the end of the loop (anyio.run
        # returns while they may still be submitting); tasks race it on the loop.
        threads.extend(
            _thread_submitter(
                race,
                mgr.submit_nowait,
                lambda spec: mgr.submit_blocking(spec, wait_timeout=5),
                mgr.get_finished,
            )
            for _ in range(2)
        )
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(_task_submitter, race, mgr)
            await anyio.to_thread.run_sync(race.close_now.wait, BOUND)
            race.collect(await mgr.aclose(cancel_queued=cancel_queued, timeout=timeout))


def _async_round(backend: str, seed: int) -> None:
    rng = random.Random(seed)
    cancel_queued = bool(seed % 2)
    timeout = rng.choice(CLOSE_TIMEOUTS)
    what = f"async {backend} seed={seed} cancel_queued={cancel_queued} timeout={timeout}"
    handler = FakeHandler()
    race = Race(close_after=rng.randrange(MAX_CALLS_BEFORE_CLOSE))
    threads: list[threading.Thread] = []
    try:
        anyio.run(
            _async_round_body, race, handler, threads, cancel_queued, timeout, backend=backend
        )
    finally:
        _join(threads, what)
    race.check(handler.launched, what)


# ---------------------------------------------------------------- the window, held open


class _HeldBridge:
    """Stands in for the manager's loop bridge. The first ``call_soon`` through it
    (a submitting thread waking the loop after it queued its job) sets ``reached``
    and waits for ``release`` before it goes on, so the test can close the engine
    and end its loop inside that window."""

    def __init__(self, bridge: LoopBridge) -> None:
        self._bridge = bridge
        self.reached = threading.Event()
        self.release = threading.Event()

    def in_loop_thread(self) -> bool:
        return self._bridge.in_loop_thread()

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        if not self.reached.is_set():
            self.reached.set()
            self.release.wait(BOUND)
        self._bridge.call_soon(fn, *args)


def _hold_wakeups(mgr: OffloadingQueueManager) -> _HeldBridge:
    wakeups = mgr._core.wakeups
    if wakeups.bridge is None:
        raise AssertionError("the manager has not started")
    held = _HeldBridge(wakeups.bridge)
    wakeups.bridge = held  # type: ignore[assignment]
    return held


def _submit_until_held(
    race: Race,
    held: _HeldBridge,
    submit: Callable[[], int],
    wait: Callable[[list[int]], list[TransferResult]],
) -> threading.Thread:
    """A thread submitting one job at a time until a submit reached the held
    wake-up. It waits for each result before the next submit, so the route's
    task soon sleeps again and the next submit has to wake it."""

    def run() -> None:
        while True:
            try:
                job_id = submit()
            except Exception as exc:  # noqa: BLE001 - checked by Race.check
                race.stopped(exc)
                return
            race.got(job_id)
            if held.reached.is_set():
                return
            race.collect(wait([job_id]))

    thread = threading.Thread(target=run, name="close-race-submitter", daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("cancel_queued", [False, True])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_submit_whose_wake_up_meets_an_ended_loop_returns_its_id(
    backend: str, cancel_queued: bool
) -> None:
    """The submit queued its job before close, and close ran it (or cancelled it)
    and ended the loop before the submit woke the loop: the submit returns the id
    whose result close delivered."""
    handler = FakeHandler()
    race = Race(close_after=0)
    engine = SyncOffloadingEngine([handler], capacity=100_000, backend=backend)  # type: ignore[arg-type]
    held = _hold_wakeups(engine.manager)
    thread = _submit_until_held(race, held, lambda: engine.submit_nowait(SPEC), engine.wait)
    try:
        assert held.reached.wait(BOUND), "no submit woke the loop"
        race.collect(engine.close(cancel_queued=cancel_queued))
    finally:
        held.release.set()
        _join([thread], backend)
    race.check(handler.launched, backend)
    assert not race.raised


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_thread_submit_whose_wake_up_meets_the_callers_ended_loop_returns_its_id(
    backend: str,
) -> None:
    """The same window on the async API: the caller's loop closes the manager
    and ends while a thread's submit is between queueing its job and waking it."""
    handler = FakeHandler()
    race = Race(close_after=0)
    threads: list[threading.Thread] = []
    holds: list[_HeldBridge] = []

    async def main() -> None:
        async with OffloadingQueueManager([handler], capacity=100_000) as mgr:
            held = _hold_wakeups(mgr)
            holds.append(held)
            submit = lambda: mgr.submit_nowait(SPEC)  # noqa: E731
            threads.append(_submit_until_held(race, held, submit, mgr.wait_blocking))
            reached = await anyio.to_thread.run_sync(held.reached.wait, BOUND)
            assert reached, "no submit woke the loop"
            race.collect(await mgr.aclose())

    try:
        anyio.run(main, backend=backend)  # returns once the loop has ended
    finally:
        for held in holds:
            held.release.set()
        _join(threads, backend)
    race.check(handler.launched, backend)
    assert not race.raised


class _HostHeldAtFirstLook:
    """Stands in for the sync facade's loop thread: the first look at ``crash``
    (a submit checking that the engine still runs) waits for ``release``."""

    def __init__(self, host: object) -> None:
        self._host = host
        self.reached = threading.Event()
        self.release = threading.Event()

    @property
    def crash(self) -> BaseException | None:
        if not self.reached.is_set():
            self.reached.set()
            self.release.wait(BOUND)
        return self._host.crash  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._host, name)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_submit_checking_the_engine_while_it_closes_gets_engine_closed(backend: str) -> None:
    """A submit that found the facade open, then its loop thread gone because
    close ended it, raises EngineClosedError, not EngineBrokenError."""
    engine = SyncOffloadingEngine([FakeHandler()], backend=backend)  # type: ignore[arg-type]
    host = engine._host
    held = _HostHeldAtFirstLook(host)
    engine._host = held  # type: ignore[assignment]
    raised: list[BaseException] = []

    def submit() -> None:
        try:
            engine.submit_nowait(SPEC)
        except Exception as exc:  # noqa: BLE001 - asserted below
            raised.append(exc)

    thread = threading.Thread(target=submit, name="close-race-submitter", daemon=True)
    thread.start()
    try:
        assert held.reached.wait(BOUND)
        assert engine.close() == []
    finally:
        held.release.set()
        _join([thread], backend)
    assert host.ended
    assert len(raised) == 1
    assert isinstance(raised[0], EngineClosedError), repr(raised[0])
    assert not isinstance(raised[0], EngineBrokenError)


# ---------------------------------------------------------------- many rounds


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_submits_racing_close_on_the_sync_facade(backend: str) -> None:
    for seed in range(ROUNDS):
        _sync_round(backend, seed)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_submits_racing_aclose_on_the_async_api(backend: str) -> None:
    for seed in range(ROUNDS):
        _async_round(backend, seed)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_submits_racing_close_on_the_sync_facade_long(backend: str) -> None:
    for seed in range(ROUNDS, ROUNDS + SLOW_ROUNDS):
        _sync_round(backend, seed)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_submits_racing_aclose_on_the_async_api_long(backend: str) -> None:
    for seed in range(ROUNDS, ROUNDS + SLOW_ROUNDS):
        _async_round(backend, seed)
