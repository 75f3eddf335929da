"""``EngineRemoteTier``: a vLLM secondary tier on a remote store (Redis/Valkey, Mooncake Store).

Loaded by vLLM's tiering manager (``EngineTieringSpec`` or vLLM's own
``TieringOffloadingSpec``) from a ``secondary_tiers`` entry::

    {"type": "EngineRemoteTier", "module_path": "offload_engine.connectors.vllm",
     "backend": "redis", "url": "redis://10.0.0.5:6379/0", "password_env": "REDIS_PASSWORD"}
    {"type": "EngineRemoteTier", "module_path": "offload_engine.connectors.vllm",
     "backend": "mooncake", "master": "10.0.0.5:50051", "local_hostname": "10.0.0.7"}

It runs in the scheduler process and never blocks it: lookups go to a
background thread (vLLM's ``AsyncLookupManager``; RETRY while one is in
flight), and stores and loads are offload-engine jobs on a
:class:`~offload_engine.remote.tier.RemoteTier` over the primary tier's
memory (each primary chunk row is one stored object), submitted with
``submit_nowait`` and collected with ``get_finished``. A failed load reports
the keys it did load, and marks the rest a miss so the scheduler recomputes
them instead of retrying.

Objects are named in a namespace built from vLLM's own storage digest
(``FileMapper``: model, tokens per hash, chunk size, parallel layout, dtype
tagged with the page format, KV groups), so instances share objects exactly
when vLLM's fs tier would share files.

This module imports vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import override
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from offload_engine import (
    ConfigError,
    EngineClosedError,
    KeyMissError,
    LayoutDigest,
    MooncakeStore,
    MooncakeStoreConfig,
    OffloadError,
    RedisStore,
    RedisStoreConfig,
    RemoteStore,
    RemoteTier,
    StoreUnavailableError,
    SyncOffloadingEngine,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    remote_blocks,
)

from .primary import PrimaryRows

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = init_logger("vllm.offload_engine")


@dataclass(frozen=True)
class RemoteTierOptions:
    """The tier's keys, parsed at the boundary (the store's own config is built from them)."""

    store: RedisStoreConfig | MooncakeStoreConfig
    workers: int
    degraded_start: bool
    job_timeout: float | None
    """Engine-side timeout per job (default none). The store's own timeouts bound each
    call; an engine timeout would abandon a job whose worker may still touch the
    primary tier, which ``drain_jobs`` must rule out."""


def _password(password: str | None, password_env: str | None) -> str | None:
    if password_env is None:
        return password
    if password is not None:
        raise ConfigError("EngineRemoteTier takes password or password_env, not both")
    value = os.environ.get(password_env)
    if value is None:
        raise ConfigError(f"EngineRemoteTier password_env={password_env!r} is not set")
    return value


def parse_remote_options(
    *,
    backend: str,
    url: str | None = None,
    master: str | None = None,
    username: str | None = None,
    password: str | None = None,
    password_env: str | None = None,
    cluster: bool = False,
    ssl_ca_certs: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_cert_reqs: str = "required",
    socket_timeout: float = 5.0,
    local_hostname: str = "127.0.0.1",
    segment_bytes: int = 1 << 30,
    local_buffer_bytes: int = 64 << 20,
    protocol: str = "tcp",
    rdma_devices: str = "",
    workers: int = 4,
    degraded_start: bool = False,
    job_timeout: float | None = None,
) -> RemoteTierOptions:
    """Typed options from a ``secondary_tiers`` entry; :class:`ConfigError` names the key."""
    store: RedisStoreConfig | MooncakeStoreConfig
    if backend == "redis":
        if url is None:
            raise ConfigError(
                "EngineRemoteTier backend 'redis' needs 'url' (redis:// or rediss://)"
            )
        store = RedisStoreConfig(
            url,
            username=username,
            password=_password(password, password_env),
            cluster=bool(cluster),
            socket_timeout=socket_timeout,
            ssl_ca_certs=ssl_ca_certs,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            ssl_cert_reqs=ssl_cert_reqs,
        )
    elif backend == "mooncake":
        if master is None:
            raise ConfigError("EngineRemoteTier backend 'mooncake' needs 'master' (host:port)")
        store = MooncakeStoreConfig(
            master,
            local_hostname=local_hostname,
            segment_bytes=segment_bytes,
            local_buffer_bytes=local_buffer_bytes,
            protocol=protocol,
            rdma_devices=rdma_devices,
        )
    else:
        raise ConfigError(f"EngineRemoteTier 'backend' must be redis or mooncake, got {backend!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"EngineRemoteTier 'workers' must be a positive int, got {workers!r}")
    if job_timeout is not None and not (
        isinstance(job_timeout, (int, float)) and not isinstance(job_timeout, bool)
    ):
        raise ConfigError(f"EngineRemoteTier 'job_timeout' must be seconds, got {job_timeout!r}")
    return RemoteTierOptions(store, workers, bool(degraded_start), job_timeout)


def remote_digest(spec: OffloadingSpec, row_bytes: int) -> LayoutDigest:
    """The layout digest of the primary tier's rows, from vLLM's storage namespace."""
    config = spec.config
    mapper = FileMapper.from_offloading_spec(
        "", spec, blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True
    )
    fields = mapper.get_run_config()
    world = math.prod(int(fields[k]) for k in ("tp_size", "pp_size", "pcp_size", "dcp_size"))
    return LayoutDigest(
        model=mapper.base_path.lstrip("/"),  # the model name and vLLM's namespace hash
        dtype=str(config.model.dtype),
        block_size=int(config.cache.tokens_per_hash),
        chunk_blocks=int(spec.blocks_per_chunk),
        page_bytes=row_bytes,
        rank=mapper.rank,
        world_size=max(world, mapper.rank + 1),
    )


class _RemoteLookups(AsyncLookupManager):
    """Existence checks on vLLM's lookup thread, one batch per scheduler step."""

    def __init__(self, tier: EngineRemoteTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        remote = self._tier.remote
        try:
            return remote.store().exists(remote.names(keys))
        except StoreUnavailableError as exc:
            logger.warning("remote tier lookup: store unreachable, answering miss: %s", exc)
            return [False] * len(keys)


class EngineRemoteTier(SecondaryTierManager):
    """A vLLM secondary tier on a remote store, moved by offload-engine (locality REMOTE)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backend: str,
        locality: str | None = "REMOTE",
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.options = parse_remote_options(backend=backend, **options)
        self._primary = PrimaryRows(primary_kv_view)
        row_bytes = self._primary.row_bytes
        if row_bytes != self.block_size_bytes:
            self._primary.release()
            raise ConfigError(
                "EngineRemoteTier needs the primary tier as contiguous rows, got a view of "
                f"shape {primary_kv_view.shape} and strides {primary_kv_view.strides}"
            )
        store_config = self.options.store

        def connect() -> RemoteStore:
            if isinstance(store_config, RedisStoreConfig):
                return RedisStore(store_config)
            return MooncakeStore(store_config)

        try:
            self.remote = RemoteTier(
                connect,
                self._primary.tier,
                remote_digest(offloading_spec, row_bytes),
                workers=self.options.workers,
                degraded_start=self.options.degraded_start,
            )
        except BaseException:
            self._primary.release()
            raise
        try:
            self._engine: SyncOffloadingEngine | None = SyncOffloadingEngine(
                self.remote.handlers(),
                capacity=1 << 16,
                default_timeout=self.options.job_timeout,
                thread_name=f"offload-engine-loop-{tier_type}",
            )
        except BaseException:
            self.remote.close()
            self._primary.release()
            raise
        self._jobs: dict[JobId, tuple[bool, list[OffloadKey]]] = {}  # job -> (load?, keys)
        self._done: list[JobResult] = []  # results a drain collected, for get_finished_jobs
        self._lookups = _RemoteLookups(self, tier_type)
        self._shut = False

    @property
    def engine(self) -> SyncOffloadingEngine:
        """The engine moving this tier's bytes; :class:`EngineClosedError` after shutdown."""
        if self._engine is None:
            raise EngineClosedError("the remote tier is shut down")
        return self._engine

    # ------------------------------------------------------------------ scheduler thread

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _submit(self, job: TransferJob, load: bool) -> None:
        keys = list(job.keys)
        ids = cpu_blocks(job.chunk_ids)
        spec = (
            TransferSpec(remote_blocks(keys), ids)
            if load
            else TransferSpec(ids, remote_blocks(keys))
        )
        try:
            self.engine.submit_nowait(spec, job_id=int(job.job_id))
        except OffloadError as exc:  # refused at submit: a failed result, never a raise
            logger.warning("remote tier: job %s refused at submit: %s", job.job_id, exc)
            if load:
                self._lookups.mark_miss(keys)
            self._done.append(JobResult(job_id=job.job_id, success=False))
            return
        self._jobs[job.job_id] = (load, keys)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _result(self, r: TransferResult) -> JobResult:
        load, keys = self._jobs.pop(r.job_id, (False, []))
        loaded: tuple[OffloadKey, ...] | None = None
        if not r.success:
            err = r.error if isinstance(r.error, KeyMissError) else None
            if err is None and r.error is not None and isinstance(r.error.__cause__, KeyMissError):
                err = r.error.__cause__
            if load:
                ok = set(err.loaded) if err is not None else set()
                loaded = tuple(OffloadKey(k) for k in keys if k in ok) or None
                self._lookups.mark_miss([k for k in keys if k not in ok])
            logger.debug("remote tier: job %s failed: %s", r.job_id, r.error)
        return JobResult(
            job_id=r.job_id,
            success=r.success,
            successful_keys=loaded,
            transfer_time=r.seconds,
            transfer_bytes=r.bytes_moved or None,
        )

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self._done = self._done, []
        if not self._shut:
            done += [self._result(r) for r in self.engine.get_finished()]
        return done

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._done)

    @override
    def drain_jobs(self) -> None:
        if self._jobs and not self._shut:
            self._done += [self._result(r) for r in self.engine.wait(list(self._jobs))]

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    @override
    def shutdown(self) -> None:
        """Idempotent: stop lookups, finish the jobs in flight, close the connection,
        then give back every view of the primary tier (vLLM closes it next)."""
        if self._shut:
            return
        self._shut = True
        try:
            self._lookups.shutdown()
            self._done += [self._result(r) for r in self.engine.close()]
        finally:
            try:
                self.remote.close()
            finally:
                self._engine = None  # its handlers hold the tier
                self._primary.release()
