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

Bookkeeping is single-threaded by vLLM's contract (one model-runner thread);
the engine itself is thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offload_engine import (
    CacheBlocks,
    Direction,
    HostTier,
    Medium,
    OffloadError,
    SyncOffloadingEngine,
    TransferResult,
    TransferSpec,
    cpu_blocks,
)

from .config import EngineOffloadingConfig
from .layout import layout_from_canonical
from .platform import TierPlacement, select_backend

logger = logging.getLogger(__name__)

IdsLike = Sequence[int] | npt.NDArray[np.integer[Any]]


class EngineBridge:
    """Owns a :class:`SyncOffloadingEngine` and translates vLLM's job calls for it."""

    def __init__(
        self,
        engine: SyncOffloadingEngine,
        cache_medium: Medium,
        *,
        tier: HostTier | None = None,
        stats_path: str | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self._engine = engine
        self._cache_medium = cache_medium
        self._tier = tier
        self._stats_path = stats_path
        self._log = log or logger
        self._live: dict[int, Direction] = {}  # submitted, result still in the engine
        self._stash: list[tuple[TransferResult, Direction]] = []  # collected by wait()
        self._counts = {
            "stores_submitted": 0,
            "loads_submitted": 0,
            "submits_refused": 0,
            "results_delivered": 0,
            "failures_delivered": 0,
            "waits": 0,
            "waited_jobs": 0,
        }
        self._shut_down = False

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
        return self._submit(
            job_id, Direction.STORE, cache_ids, group_sizes, block_indices, tier_ids
        )

    def submit_load(
        self,
        job_id: int,
        tier_ids: IdsLike,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> bool:
        """Tier -> KV cache. False (logged with its typed error) if the engine refuses it."""
        return self._submit(job_id, Direction.LOAD, cache_ids, group_sizes, block_indices, tier_ids)

    def _submit(
        self,
        job_id: int,
        direction: Direction,
        cache_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        tier_ids: IdsLike,
    ) -> bool:
        try:
            cache = CacheBlocks(
                self._cache_medium,
                cache_ids,  # type: ignore[arg-type]  # validated and converted by CacheBlocks
                tuple(group_sizes),
                tuple(block_indices),
            )
            tier = cpu_blocks(tier_ids)
            spec = (
                TransferSpec(cache, tier)
                if direction is Direction.STORE
                else TransferSpec(tier, cache)
            )
            self._engine.submit_nowait(spec, job_id=job_id)
        except OffloadError as exc:
            # vLLM's interface has only a bool here (and asserts on it): say why first.
            self._counts["submits_refused"] += 1
            self._log.error(
                "offload-engine refused %s job %d (%d cache blocks, groups %s, first "
                "indices %s, %d tier blocks): %s: %s",
                direction.value,
                job_id,
                len(cache_ids),
                tuple(group_sizes),
                tuple(block_indices),
                len(tier_ids),
                type(exc).__name__,
                exc,
            )
            return False
        self._live[job_id] = direction
        self._counts[f"{direction.value}s_submitted"] += 1
        return True

    # ------------------------------------------------------------ results

    def get_finished(self) -> list[TransferResult]:
        """Results not yet handed out: those ``wait`` collected, then the engine's new ones."""
        fresh = self._engine.get_finished()
        if not self._stash and not fresh:
            return []
        stash, self._stash = self._stash, []
        live = self._live
        out: list[TransferResult] = []
        for result, stashed_direction in stash:
            self._deliver(result, stashed_direction, out)
        for result in fresh:
            direction = live.pop(result.job_id) if result.job_id in live else None
            if direction is None:  # pragma: no cover - only this bridge submits
                self._log.error(
                    "offload-engine returned a result for job %d, which this worker did not submit",
                    result.job_id,
                )
            self._deliver(result, direction, out)
        return out

    def _deliver(
        self, result: TransferResult, direction: Direction | None, out: list[TransferResult]
    ) -> None:
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

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the live ones among ``job_ids`` are done; their results are
        stashed for the next :meth:`get_finished`. Ids not live here are skipped."""
        live = self._live
        wanted = [j for j in job_ids if j in live]
        self._counts["waits"] += 1
        if not wanted:
            return
        self._counts["waited_jobs"] += len(wanted)
        results = self._engine.wait(wanted)
        for result in results:
            self._stash.append((result, live.pop(result.job_id)))

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
        return {
            "engine": engine_stats,
            "adapter": dict(self._counts, live_jobs=len(self._live), stashed=len(self._stash)),
        }

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
        if self._stats_path is not None:
            self._write_stats(self._stats_path, undelivered=len(undelivered))

    def _write_stats(self, path: str, *, undelivered: int) -> None:
        data = self.stats()
        data["adapter"]["undelivered_at_shutdown"] = undelivered
        data["pid"] = os.getpid()
        data["written_at"] = time.time()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
        self._log.info("offload-engine stats written to %s", path)


def build_bridge(
    kv_caches: Any,
    platform: Any,
    config: EngineOffloadingConfig,
    num_tier_blocks: int,
    *,
    rank: int = 0,
    log: logging.Logger | None = None,
    placement: TierPlacement | None = None,
) -> EngineBridge:
    """Layout, backend, handlers, engine: the worker side, from vLLM's registration.

    Raises :class:`LayoutError` for a KV cache the engine cannot move and
    :class:`RuntimeUnavailableError` for a platform without a handler, before
    any memory is taken. With a ``placement`` the tier lives in that memory
    (vLLM's shared offload region) instead of a private allocation.
    """
    layout = layout_from_canonical(kv_caches)
    backend = select_backend(platform)
    handlers, tier = backend.build(layout, num_tier_blocks, config, placement)
    try:
        engine = SyncOffloadingEngine(
            handlers,
            capacity=config.queue_capacity,
            default_timeout=config.job_timeout_s,
            thread_name=f"offload-engine-vllm-{rank}",
        )
    except BaseException:
        tier.release()
        raise
    stats_path = config.stats_path.format(rank=rank) if config.stats_path else None
    (log or logger).info(
        "offload-engine: %s backend, %r, tier %d blocks x %d x %d bytes (%.1f MiB)",
        backend.name,
        layout,
        tier.num_blocks,
        tier.factor,
        tier.slot_bytes,
        tier.nbytes / 2**20,
    )
    return EngineBridge(engine, backend.cache_medium, tier=tier, stats_path=stats_path, log=log)
