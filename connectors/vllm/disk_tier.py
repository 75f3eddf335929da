"""``EngineDiskTier``: the engine's disk tier as a vLLM secondary tier.

Load it under vLLM's tiering spec (or ``EngineTieringSpec``) with no patching::

    "secondary_tiers": [{"type": "EngineDiskTier", "module_path": "offload_engine.connectors.vllm",
                         "path": "/mnt/nvme/kv", "capacity_bytes": 500000000000}]

Optional keys: ``queue_depth`` (I/O threads per direction; ``null``, the default,
derives it from the directory's block device, see :class:`~offload_engine.DiskStore`),
``direct`` (``null`` probes O_DIRECT, ``false`` forces buffered I/O),
``fsync`` (``never`` | ``data`` | ``always``), ``pack_bytes`` (the least bytes of chunks
one record holds, and the most one read request covers; default 1 MiB),
``segment_bytes`` (``null``, the default: the directory's, a 16th of the cap for a new
one; N: segments of N bytes), ``on_foreign_layout`` (``error``, the default, refuses a
directory written in an older on-disk layout; ``wipe`` deletes it), ``locality``.

vLLM calls every method from its scheduler, which must never wait on I/O:

* ``lookup`` reads the store's in-memory index: HIT for a stored key, RETRY
  for one being written, MISS otherwise.
* ``submit_store``/``submit_load`` hand a job to the engine (``submit_nowait``,
  which never blocks) on the host-tier slots vLLM names; the primary tier's
  memoryview *is* the engine's host tier, so nothing is copied on the way.
* ``get_finished_jobs`` drains the engine's finished results without waiting.
  A load that missed some keys (absent, or failing its checksum) reports the
  verified ones as ``successful_keys``.
* ``drain_jobs`` waits for every job submitted so far and keeps the results for
  the next ``get_finished_jobs``; ``shutdown`` closes the engine and the store.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from offload_engine import (
    DiskStore,
    EngineClosedError,
    HostTier,
    KeyMissError,
    LayoutDigest,
    OffloadError,
    SyncOffloadingEngine,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
    disk_handlers,
)

from .primary import PrimaryRows

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("offload_engine.vllm")


def digest_for(offloading_spec: OffloadingSpec, page_bytes: int) -> LayoutDigest:
    """The layout digest of vLLM's offloaded chunks: model, dtype, tokens per
    hash block, blocks per chunk, parallel rank and world size, chunk bytes."""
    config = offloading_spec.config
    parallel = config.parallel
    return LayoutDigest(
        model=str(config.model.name),
        dtype=str(config.model.dtype),
        block_size=int(config.cache.tokens_per_hash),
        chunk_blocks=int(config.cache.blocks_per_chunk),
        page_bytes=page_bytes,
        rank=int(parallel.rank),
        world_size=int(parallel.world_size),
    )


def host_tier_over(view: memoryview) -> HostTier:
    """The primary tier's ``(num_chunks, chunk_bytes)`` memoryview as a host tier (no
    copy). The tier's views of the memory go when it is released and dropped; a
    secondary tier uses :class:`~.primary.PrimaryRows`, which also checks that."""
    return PrimaryRows(view).tier


class EngineDiskTier(SecondaryTierManager):
    """A vLLM secondary tier on local disk, backed by offload-engine's disk tier."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        path: str,
        capacity_bytes: int,
        queue_depth: int | None = None,
        direct: bool | None = None,
        fsync: str = "never",
        locality: str | None = None,
        pack_bytes: int | None = None,
        segment_bytes: int | None = None,
        on_foreign_layout: str = "error",
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self._primary = PrimaryRows(primary_kv_view)
        tier = self._primary.tier
        try:
            self.store = DiskStore(
                Path(path),
                digest_for(offloading_spec, tier.slot_bytes),
                capacity_bytes=capacity_bytes,
                direct=direct,
                fsync=fsync,  # type: ignore[arg-type]
                queue_depth=queue_depth,
                pack_bytes=pack_bytes,
                segment_bytes=segment_bytes,
                on_foreign_layout=on_foreign_layout,  # type: ignore[arg-type]
            )
        except BaseException:
            self._primary.release()
            raise
        try:
            self._engine: SyncOffloadingEngine | None = SyncOffloadingEngine(
                disk_handlers(self.store, tier), thread_name="offload-engine-disk-loop"
            )
        except BaseException:
            self.store.close()
            self._primary.release()
            raise
        # engine job id -> (vLLM job id, is_load); scheduler thread only
        self._jobs: dict[int, tuple[int, bool]] = {}
        self._ready: list[JobResult] = []  # results taken by drain_jobs, not yet returned
        self._closed = False

    # ------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self.store.state(key)
        if state == "stored":
            return LookupResult.HIT
        return LookupResult.RETRY if state == "writing" else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch(keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # ------------------------------------------------------------ jobs

    def submit_store(self, job_metadata: TransferJob) -> None:
        spec = TransferSpec(cpu_blocks(job_metadata.chunk_ids), disk_blocks(job_metadata.keys))
        self._submit(job_metadata, spec, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        spec = TransferSpec(disk_blocks(job_metadata.keys), cpu_blocks(job_metadata.chunk_ids))
        self._submit(job_metadata, spec, is_load=True)

    @property
    def engine(self) -> SyncOffloadingEngine:
        """The engine moving this tier's bytes; :class:`EngineClosedError` after shutdown."""
        if self._engine is None:
            raise EngineClosedError("the disk tier is shut down")
        return self._engine

    def _submit(self, job: TransferJob, spec: TransferSpec, *, is_load: bool) -> None:
        try:
            engine_id = self.engine.submit_nowait(spec)
        except OffloadError as exc:  # full queue, bad ids: a failed job, the tier serves on
            log.warning("disk tier refused job %d: %s", job.job_id, exc)
            self._ready.append(JobResult(job_id=job.job_id, success=False))
            return
        self._jobs[engine_id] = (job.job_id, is_load)

    def _translate(self, results: Iterable[TransferResult]) -> list[JobResult]:
        out: list[JobResult] = []
        for r in results:
            job_id, is_load = self._jobs.pop(r.job_id)
            successful: tuple[OffloadKey, ...] | None = None
            if not r.success:
                if is_load and isinstance(r.error, KeyMissError) and r.error.loaded:
                    successful = tuple(OffloadKey(k) for k in r.error.loaded)
                log.debug("disk tier job %d failed: %s", job_id, r.error)
            out.append(
                JobResult(
                    job_id=job_id,
                    success=r.success,
                    successful_keys=successful,
                    transfer_time=r.seconds,
                    transfer_bytes=r.bytes_moved,
                )
            )
        return out

    def get_finished_jobs(self) -> Iterable[JobResult]:
        ready, self._ready = self._ready, []
        if self._closed:
            return ready
        return ready + self._translate(self.engine.get_finished())

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._ready)

    def drain_jobs(self) -> None:
        if self._jobs and not self._closed:
            self._ready += self._translate(self.engine.wait(list(self._jobs)))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close()
        finally:
            try:
                self.store.close()
            finally:
                # vLLM closes its region right after: the engine (its handlers hold
                # views of the rows) goes first, then every view of ours
                self._engine = None
                self._primary.release()

    def __repr__(self) -> str:
        return f"<EngineDiskTier {self.store!r} jobs={len(self._jobs)}>"


__all__ = ["EngineDiskTier", "digest_for", "host_tier_over"]
