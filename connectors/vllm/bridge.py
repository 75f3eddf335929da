"""The worker's vLLM-free core: vLLM's job calls in, engine jobs out, results back once.

vLLM's connector calls its ``OffloadingWorker`` from one thread, every step:
``submit_store``/``submit_load`` (must not block), ``get_finished`` (must not
block; each finished job reported once), and, on preemption or when a block
with a pending store is reallocated, ``wait(job_ids)`` (blocks until those jobs
are done, returns nothing; their results still come out of a later
``get_finished``).

The engine's ``wait`` *collects* the results it waits for, so
:class:`EngineBridge` keeps them in a stash that the next :meth:`get_finished`
hands out before the engine's own fresh results. ``wait`` asks the engine only
for ids that are still live here (submitted, result not yet collected); vLLM
may name ids already finished, or never submitted to this worker.

vLLM calls from one model-runner thread per worker, but nothing here relies
on it: the bookkeeping (live ids, the stash, the counters) is guarded by one
lock, held only for non-blocking work (``submit_nowait``, ``get_finished``),
never across the engine's blocking ``wait``. So several threads may share a
bridge, as the chaos run through the bridge does.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offload_engine import (
    CacheBlocks,
    Direction,
    HostTier,
    InvalidTransferError,
    JobFence,
    KVLayout,
    Medium,
    OffloadError,
    SyncOffloadingEngine,
    TierBlocks,
    TransferResult,
    TransferSpec,
    UnknownJobError,
    cpu_blocks,
)

from .config import EngineOffloadingConfig
from .parts import FIRST_PART_ID, PartedJob
from .stats_file import StatsFile
from .timings import JobClock

logger = logging.getLogger(__name__)

IdsLike = Sequence[int] | npt.NDArray[np.integer[Any]]


def _length(ids: object) -> str:
    """``len(ids)`` for a log line, whatever the caller passed."""
    try:
        return str(len(ids))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - only describes bad input that is being refused
        return f"? ({type(ids).__name__})"


def _describe(
    cache_ids: object,
    group_sizes: object,
    block_indices: object,
    tier_ids: object,
    tensors: tuple[int, ...] | None = None,
) -> str:
    """A refused job's blocks, for its log line."""
    return (
        f"{_length(cache_ids)} cache blocks, groups {group_sizes!r}, first indices "
        f"{block_indices!r}, {_length(tier_ids)} tier blocks"
        + ("" if tensors is None else f", tensors {tensors}")
    )


def _as_counts(values: object, what: str) -> tuple[int, ...]:
    """vLLM's group sizes or first indices as a tuple; InvalidTransferError otherwise."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidTransferError(
            f"{what} must be a sequence of ints, got {type(values).__name__}"
        )
    try:
        return tuple(values)
    except Exception as exc:  # a broken iterable from the caller
        raise InvalidTransferError(f"{what} could not be read: {exc!r}") from exc


def _job_id(job_id: object) -> int:
    """vLLM's job id as a plain int (the engine refuses negative ones). Anything else is
    a caller bug, raised (TypeError) rather than logged: None would make the engine
    pick an id that the bridge never learns."""
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise TypeError(f"job ids are ints, got {type(job_id).__name__}: {job_id!r}")
    return int(job_id)


class EngineBridge:
    """Owns a :class:`SyncOffloadingEngine` and translates vLLM's job calls for it.

    With ``stats_path`` the counters are written there (:class:`.stats_file.StatsFile`)
    at shutdown and, while serving, at most every ``stats_interval`` seconds from
    :meth:`get_finished` (default :data:`.stats_file.STATS_INTERVAL_S`).
    """

    def __init__(
        self,
        engine: SyncOffloadingEngine,
        cache_medium: Medium,
        *,
        tier: HostTier | None = None,
        stats_path: str | None = None,
        stats_interval: float | None = None,
        log: logging.Logger | None = None,
        layout: KVLayout | None = None,
        config: EngineOffloadingConfig | None = None,
    ) -> None:
        self._engine = engine
        #: the KV cache it moves, and the adapter config it was built from (None when
        #: built by hand); the layer-wise loads read both
        self.layout = layout
        self.config = config
        self._cache_medium = cache_medium
        self._tier = tier
        self._log = log or logger
        self._stats_file = (
            None if stats_path is None else StatsFile(stats_path, self._log, stats_interval)
        )
        # guards _live, _stash, _waiting and _counts; threads in wait() for ids that
        # another thread is waiting on sleep on it
        self._cond = threading.Condition(threading.Lock())
        self._live: dict[int, Direction] = {}  # submitted, result still in the engine
        self._stash: list[tuple[TransferResult, Direction]] = []  # collected by wait()
        self._waiting: set[int] = set()  # ids a thread is waiting on in the engine
        self._counts = {
            "stores_submitted": 0,
            "loads_submitted": 0,
            "submits_refused": 0,
            "results_delivered": 0,
            "failures_delivered": 0,
            "waits": 0,
            "waited_jobs": 0,
        }
        #: counters of the layers above (layer-wise stores), written by the worker's
        #: thread and copied into :meth:`stats`; their keys are set before serving
        self.counters: dict[str, int] = {}
        #: timing summaries of the layers above (layer-wise loads), by name, read into
        #: :meth:`stats`'s ``adapter.timings``
        self.timings: dict[str, Callable[[], dict[str, Any]]] = {}
        self._shut_down = False
        # jobs sent in parts: each job's state, and the job each engine part belongs to
        self._layered: dict[int, PartedJob] = {}
        self._part_of: dict[int, int] = {}
        self._next_part = FIRST_PART_ID
        # each engine job's submit-to-done, copy and done-to-collected times
        self._clock = JobClock()

    @property
    def engine(self) -> SyncOffloadingEngine:
        return self._engine

    # ------------------------------------------------------------ submit

    def submit_store(
        self,
        job_id: int,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        tier_ids: IdsLike,
    ) -> bool:
        """KV cache -> tier. False (logged with its typed error) if the engine refuses it."""
        refused = self._try_submit(
            _job_id(job_id), Direction.STORE, cache_ids, group_sizes, block_indices, tier_ids
        )
        return refused is None

    def submit_load(
        self,
        job_id: int,
        tier_ids: IdsLike,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> bool:
        """Tier -> KV cache. False (logged with its typed error) if the engine refuses it."""
        refused = self._try_submit(
            _job_id(job_id), Direction.LOAD, cache_ids, group_sizes, block_indices, tier_ids
        )
        return refused is None

    def submit_load_layers(
        self,
        job_id: int,
        tier_ids: IdsLike,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        tensor_sets: Sequence[tuple[int, ...] | None],
    ) -> list[JobFence]:
        """Tier -> KV cache as one engine job per entry of ``tensor_sets`` (the KV tensors
        of a group of layers, in the order the forward pass reads them; None for every
        tensor), each with a :class:`JobFence`, returned in that order.

        The parts report as one result under ``job_id`` once all are done, failed if
        any failed (see :meth:`open_parts`). A part refused (its blocks at open, or
        the part by the engine) is logged, and its fence is already finished with the
        error, so its wait raises instead of passing."""
        job_id = _job_id(job_id)
        self.open_parts(
            job_id,
            Direction.LOAD,
            len(tensor_sets),
            cache_ids=cache_ids,
            group_sizes=group_sizes,
            block_indices=block_indices,
            tier_ids=tier_ids,
        )
        fences: list[JobFence] = []
        for tensors in tensor_sets:
            fence = JobFence()
            fences.append(fence)
            refused = self.submit_part(job_id, tensors, fence=fence)
            if refused is not None:
                fence.finished(refused)
        return fences

    def open_parts(
        self,
        job_id: int,
        direction: Direction,
        parts: int,
        *,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        tier_ids: IdsLike,
    ) -> OffloadError | None:
        """Announce ``job_id`` as ``parts`` engine jobs over these blocks (converted and
        checked here, once for all parts), each part handed in later by
        :meth:`submit_part` (as the forward pass reaches its layers, say). They report
        as ONE result under ``job_id`` once every part came back, failed if any part
        failed or was refused; until then no part's result is handed out.

        None if the blocks were taken. If they are refused, the typed error (logged):
        the job is open all the same, each of its parts is refused with that error
        when handed in (counted in ``submits_refused``, never reaching the engine),
        and once all are handed in the job reports as one failed result. A ``parts``
        below one, or a ``job_id`` already out, raises :class:`InvalidTransferError`
        (nothing is opened).

        :meth:`wait` on ``job_id`` waits for the parts handed in so far: a caller
        that waits on such a job hands in all of its parts first."""
        job_id = _job_id(job_id)
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise InvalidTransferError(f"a job has at least one part, got {parts!r}")
        blocks = self._blocks(cache_ids, group_sizes, block_indices, tier_ids)
        with self._cond:
            if job_id in self._layered or job_id in self._live:
                raise InvalidTransferError(f"job {job_id} is already out")
            self._layered[job_id] = PartedJob(direction, parts, blocks)
            self._counts[f"{direction.value}s_submitted"] += 1
        if not isinstance(blocks, OffloadError):
            return None
        what = _describe(cache_ids, group_sizes, block_indices, tier_ids)
        self._log_refused(direction, job_id, f"{what}; all {parts} parts", blocks)
        return blocks

    def submit_part(
        self, job_id: int, tensors: tuple[int, ...] | None, *, fence: JobFence | None = None
    ) -> OffloadError | None:
        """Hand the engine the next part of ``job_id`` (see :meth:`open_parts`): the
        regions of the job's blocks in the KV tensors ``tensors`` (None: all), in the
        direction the job was opened with, with ``fence`` if given. None once the
        engine took it; otherwise the typed error, and the part counts as failed: the
        engine's refusal (logged here), or the refusal of the job's blocks at
        :meth:`open_parts` (logged there). A part past the announced number, or of a
        job not opened, raises :class:`InvalidTransferError`."""
        job_id = _job_id(job_id)
        with self._cond:
            state = self._layered.get(job_id)
            if state is None or state.submitted >= state.parts:
                raise InvalidTransferError(
                    f"job {job_id} has no part left to submit"
                    + ("" if state is None else f" (all {state.parts} were)")
                )
            state.submitted += 1
            part = self._next_part
            self._next_part += 1
            blocks = state.blocks
            if isinstance(blocks, OffloadError):  # refused at open, and logged there
                self._counts["submits_refused"] += 1
                self._fold_refused(job_id, part, blocks)
                return blocks
        cache, tier = blocks
        refused = self._submit(
            part, state.direction, cache, tier, tensors=tensors, fence=fence, parent=job_id
        )
        if refused is not None:
            what = _describe(cache, cache.group_sizes, cache.block_indices, tier, tensors)
            self._log_refused(state.direction, part, f"{what}; part of job {job_id}", refused)
            with self._cond:
                self._fold_refused(job_id, part, refused)
        return refused

    def _fold_refused(self, job_id: int, part: int, error: OffloadError) -> None:
        """Count ``part`` of ``job_id`` as refused; if it was the job's last part out,
        stash the job's result for the next get_finished. With the lock held."""
        direction = self._layered[job_id].direction
        whole = self._fold(job_id, TransferResult(part, False, 0, 0.0, error))
        if whole is not None:
            self._stash.append((whole, direction))

    def _blocks(
        self,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        tier_ids: IdsLike,
    ) -> tuple[CacheBlocks, TierBlocks] | OffloadError:
        """vLLM's ids as the engine's block specs, checked; the typed error if they are bad."""
        try:
            cache = CacheBlocks(
                self._cache_medium,
                cache_ids,  # type: ignore[arg-type]  # validated and converted by CacheBlocks
                _as_counts(group_sizes, "group_sizes"),
                _as_counts(block_indices, "block_indices"),
            )
            return cache, cpu_blocks(tier_ids)
        except OffloadError as exc:
            return exc

    def _try_submit(
        self,
        job_id: int,
        direction: Direction,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        tier_ids: IdsLike,
    ) -> OffloadError | None:
        """Submit one whole job; the typed error (logged) if it was refused."""
        blocks = self._blocks(cache_ids, group_sizes, block_indices, tier_ids)
        if isinstance(blocks, OffloadError):
            with self._cond:
                self._counts["submits_refused"] += 1
            refused: OffloadError | None = blocks
        else:
            refused = self._submit(job_id, direction, *blocks)
        if refused is not None:
            what = _describe(cache_ids, group_sizes, block_indices, tier_ids)
            self._log_refused(direction, job_id, what, refused)
        return refused

    def _submit(
        self,
        job_id: int,
        direction: Direction,
        cache: CacheBlocks,
        tier: TierBlocks,
        *,
        tensors: tuple[int, ...] | None = None,
        fence: JobFence | None = None,
        parent: int | None = None,
    ) -> OffloadError | None:
        """Submit one engine job (a part of job ``parent``, if given); the typed error
        (counted, not logged) if the engine refused it."""
        src, dst = (cache, tier) if direction is Direction.STORE else (tier, cache)
        try:
            spec = TransferSpec(src, dst, tensors=tensors, fence=fence)
            # under the lock, so no get_finished() in another thread sees this job's
            # result before the job is recorded as live
            with self._cond:
                self._engine.submit_nowait(spec, job_id=job_id)
                self._live[job_id] = direction
                self._clock.submitted(job_id)
                if parent is None:
                    self._counts[f"{direction.value}s_submitted"] += 1
                else:
                    self._part_of[job_id] = parent
                    self._layered[parent].pending.add(job_id)
        except OffloadError as exc:
            with self._cond:
                self._counts["submits_refused"] += 1
            return exc
        return None

    def _log_refused(self, direction: Direction, job_id: int, what: str, exc: Exception) -> None:
        # vLLM's interface has only a bool here (and asserts on it): say why first.
        name, value = type(exc).__name__, direction.value
        self._log.error(
            "offload-engine refused %s job %r (%s): %s: %s", value, job_id, what, name, exc
        )

    # ------------------------------------------------------------ results

    def get_finished(self) -> list[TransferResult]:
        """Results not yet handed out: those ``wait`` collected, then the engine's new ones."""
        if self._stats_file is not None and self._stats_file.due() and not self._shut_down:
            self._stats_file.snapshot(self.stats)
        with self._cond:
            fresh = self._engine.get_finished()
            if not self._stash and not fresh:
                return []
            stash, self._stash = self._stash, []
            live = self._live
            out: list[TransferResult] = []
            now = time.perf_counter()
            for result, stashed_direction in stash:
                self._deliver(result, stashed_direction, out)
            for result in fresh:
                # a result another thread's wait() was about to claim is handed out
                # here; that wait() then finds the job no longer live and skips it
                direction = live.pop(result.job_id) if result.job_id in live else None
                self._clock.collected(result, direction, now)
                if direction is None:  # pragma: no cover - only this bridge submits
                    self._log.error(
                        "offload-engine returned a result for job %d, which this worker did "
                        "not submit",
                        result.job_id,
                    )
                self._deliver(result, direction, out)
            if fresh:
                self._cond.notify_all()
        return out

    def _deliver(
        self, result: TransferResult, direction: Direction | None, out: list[TransferResult]
    ) -> None:
        parent = self._part_of.pop(result.job_id, None)
        if parent is not None:
            whole = self._fold(parent, result)
            if whole is None:
                return  # more parts of the job are out, or not handed in yet
            result = whole
        self._counts["results_delivered"] += 1
        if not result.success:
            self._counts["failures_delivered"] += 1
            self._log.error(
                "offload-engine %s job %d failed after %.6fs: %s: %s",
                direction.value if direction is not None else "unknown",
                result.job_id,
                result.latency,
                type(result.error).__name__,
                result.error,
            )
        out.append(result)

    def _fold(self, parent: int, part: TransferResult) -> TransferResult | None:
        """Add a part's result (or refusal) to its job; the job's result once every
        announced part is in. Called with the lock held."""
        whole = self._layered[parent].add(parent, part)
        if whole is not None:
            del self._layered[parent]
        return whole

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the live ones among ``job_ids`` are done; their results are
        stashed for the next :meth:`get_finished`. Ids not live here are skipped.

        Several threads may wait at once: a thread whose ids another thread is
        already waiting on sleeps until that thread is done with them."""
        ids = list(job_ids)  # the caller's iterable runs outside the lock
        with self._cond:
            self._counts["waits"] += 1
            layered = self._layered
            if layered:  # a job sent in parts is waited on through those handed in
                ids = [p for j in ids for p in (layered[j].pending if j in layered else (j,))]
        while True:
            with self._cond:
                while True:
                    live, waiting = self._live, self._waiting
                    mine = list(dict.fromkeys(j for j in ids if j in live and j not in waiting))
                    if mine:
                        break
                    if not any(j in waiting for j in ids):
                        return  # nothing of ours is left in the engine
                    self._cond.wait()  # another thread waits on the rest; it notifies
                self._waiting.update(mine)
                self._counts["waited_jobs"] += len(mine)
            try:
                self._wait_for(mine)
            finally:
                with self._cond:
                    self._waiting.difference_update(mine)
                    self._cond.notify_all()

    def _wait_for(self, ids: list[int]) -> None:
        """Wait in the engine for ``ids`` (this thread's to wait on); stash their results."""
        while ids:
            try:
                results = self._engine.wait(ids)
            except UnknownJobError:
                # get_finished() in another thread handed out one of these between
                # our look at _live and the engine's claim: the job is done, skip it
                with self._cond:
                    ids = [j for j in ids if j in self._live]
                continue
            now = time.perf_counter()
            with self._cond:
                for result in results:
                    direction = self._live.pop(result.job_id)
                    self._clock.collected(result, direction, now)
                    self._stash.append((result, direction))
            return

    @property
    def live_jobs(self) -> int:
        """Jobs submitted whose results are still in the engine."""
        return len(self._live)

    @property
    def stashed_results(self) -> int:
        """Results collected by ``wait`` and not yet handed out."""
        return len(self._stash)

    # ------------------------------------------------------------ stats and shutdown

    def stats(self) -> dict[str, Any]:
        """The engine's counters and the adapter's, as plain JSON-ready data."""
        snapshot = self._engine.stats()
        engine_stats = dataclasses.asdict(snapshot)
        for h in engine_stats["handlers"]:
            h["src"], h["dst"] = str(h["src"]), str(h["dst"])
        engine_stats.update(
            stores_succeeded=snapshot.stores_succeeded,
            loads_succeeded=snapshot.loads_succeeded,
            bytes_stored=snapshot.bytes_stored,
            bytes_loaded=snapshot.bytes_loaded,
        )
        with self._cond:
            adapter: dict[str, Any] = dict(
                self._counts, live_jobs=len(self._live), stashed=len(self._stash), **self.counters
            )
            adapter["timings"] = self._clock.summary()
        for name, summary in self.timings.items():
            adapter["timings"][name] = summary()
        return {"engine": engine_stats, "adapter": adapter}

    def shutdown(self) -> None:
        """Close the engine (queued jobs run, in-flight ones are awaited), log the
        results never handed to vLLM, release the tier, write the stats file.
        Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            leftovers = self._engine.close()
        finally:
            if self._tier is not None:
                self._tier.release()
            # the peer ledger the platform opened for the device handlers, if any
            ledgers = {getattr(h, "ledger", None) for h in self._engine.manager.handlers}
            for ledger in ledgers:
                if ledger is not None:
                    ledger.close()
        undelivered = [r for r, _ in self._stash] + leftovers
        self._stash = []
        for r in leftovers:
            self._live.pop(r.job_id, None)
        failed = [r for r in undelivered if not r.success]
        if undelivered:
            self._log.info(
                "offload-engine closed with %d results never handed to vLLM (%d failed)",
                len(undelivered),
                len(failed),
            )
        for r in failed:
            self._log.warning(
                "offload-engine job %d failed and was never handed to vLLM: %s: %s",
                r.job_id,
                type(r.error).__name__,
                r.error,
            )
        if self._stats_file is not None:
            self._stats_file.final(self.stats(), len(undelivered))
