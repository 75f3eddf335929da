"""``EngineTieringSpec``: vLLM's multi-tier offloading, offload-engine moving the worker's bytes.

Scheduler side: vLLM's own ``TieringOffloadingSpec``, unchanged: its
``TieringOffloadingManager`` with the CPU primary tier in the shared offload
region (``/dev/shm``), the secondary tiers listed in ``secondary_tiers``
(vLLM's ``fs``, ``obj``, ``p2p``, ``kvcr``, or any out-of-tree
``SecondaryTierManager`` named by ``type`` and ``module_path``), lookups,
promotion, cascade, back-pressure and metrics.

Worker side: an :class:`EngineTieringWorker` whose host tier *is* this rank's
part of that region: each chunk row of the region holds one page of
``cpu_page_size_per_worker`` bytes per rank, and the engine's tier block ``b``
is the rank's page in row ``b`` (rank 0's for every worker under vLLM's
replicated MLA layout). So what the worker stores, the secondary tiers read,
and what they promote, the worker loads. On CUDA and NPU the region is
registered with the runtime (never copied) and unregistered at shutdown.

The bytes inside a page are in offload-engine's slot format (each cache block
contiguous across layers), not in vLLM's CPU worker's, so keyed tiers must not
share files with stock vLLM: the spec tags the storage namespace (the dtype
field of vLLM's ``FileMapper`` digest) with :data:`PAGE_FORMAT`, and turns off
vLLM's parallelism-agnostic namespace where several workers write their own
pages.

This module imports vLLM.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Mapping
from typing import Any

from typing_extensions import override
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from offload_engine import ConfigError, LayoutError

from .bridge import EngineBridge
from .compat import open_worker_region, region_rows
from .config import EngineOffloadingConfig
from .platform import TierPlacement
from .sizing import PrimarySizing
from .spec import check_chunks, engine_bridge, parse_engine_config
from .worker import EngineOffloadingWorker

logger = init_logger("vllm.offload_engine")

#: The page format tag added to the keyed tiers' storage namespace.
PAGE_FORMAT = "offload-engine-slots-v1"

# what SecondaryTierFactory passes every tier itself
_FACTORY_ARGS = {"self", "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"}
# what the factory takes out of a tier's config before calling the tier
_FACTORY_KEYS = {"type", "module_path", "backpressure"}


def check_secondary_tiers(extra: Mapping[str, Any]) -> None:
    """Resolve every ``secondary_tiers`` entry the way vLLM will (its factory: a
    registered ``type``, or ``type`` + ``module_path``) and check its keys
    against the tier's constructor; one :class:`ConfigError` naming the key."""
    if not isinstance(extra, Mapping):
        return  # parse_extra_config reports it
    tiers = extra.get("secondary_tiers", [])
    if tiers is None:
        return
    if not isinstance(tiers, list):
        raise ConfigError(
            "kv_connector_extra_config['secondary_tiers'] must be a list of tier "
            f"configurations (mappings with a 'type'), got {type(tiers).__name__}"
        )
    for i, tier in enumerate(tiers):
        key = f"kv_connector_extra_config['secondary_tiers'][{i}]"
        if not isinstance(tier, dict):
            raise ConfigError(f"{key} must be a mapping with a 'type', got {tier!r}")
        try:
            tier_cls = SecondaryTierFactory.get_tier_class(tier)
        except (ValueError, ImportError, AttributeError, AssertionError, TypeError) as exc:
            raise ConfigError(
                f"{key}['type']={tier.get('type')!r} (module_path="
                f"{tier.get('module_path')!r}) is not a secondary tier vLLM can load: "
                f"{exc or type(exc).__name__}"
            ) from exc
        params = inspect.signature(tier_cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        given = set(tier) - _FACTORY_KEYS
        missing = [
            name
            for name, p in params.items()
            if name not in _FACTORY_ARGS
            and p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and name not in given
        ]
        if missing:
            raise ConfigError(
                f"{key}[{missing[0]!r}] is required by secondary tier "
                f"{tier['type']!r} ({tier_cls.__name__})"
            )
        unknown = sorted(given - set(params)) if not takes_any else []
        if unknown:
            raise ConfigError(
                f"{key}[{unknown[0]!r}] is not a parameter of secondary tier "
                f"{tier['type']!r} ({tier_cls.__name__}); it takes "
                f"{sorted(set(params) - _FACTORY_ARGS)}"
            )


def storage_config(config: OffloadingConfig) -> OffloadingConfig:
    """``config`` with the storage namespace of keyed secondary tiers set apart for
    offload-engine's page format (see the module docstring)."""
    model = dataclasses.replace(config.model, dtype=f"{config.model.dtype};{PAGE_FORMAT}")
    parallel = config.parallel
    if parallel.world_size > 1 and not config.replicated_layout:
        parallel = dataclasses.replace(parallel, is_parallelism_agnostic=False)
    return dataclasses.replace(config, model=model, parallel=parallel)


def scheduler_limits() -> tuple[int, int] | None:
    """``(max_model_len, max_num_seqs)`` of the vLLM engine building the tiering
    manager, or ``None`` where they cannot be found.

    vLLM does not hand them to a spec: its ``OffloadingConnectorScheduler.__init__
    (spec, vllm_config, kv_cache_config)`` calls ``spec.get_manager()`` without
    making ``vllm_config`` current, so the caller's frames are read for it (only
    for this startup check, which is skipped when they hold no such config).
    """
    from vllm.config import get_current_vllm_config_or_none

    config: Any = get_current_vllm_config_or_none()
    frame = sys._getframe(1)
    for _ in range(6):  # get_manager, then vLLM's OffloadingConnectorScheduler
        if config is not None or frame is None:
            break
        config = frame.f_locals.get("vllm_config")
        frame = frame.f_back  # type: ignore[assignment]
    try:
        return int(config.model_config.max_model_len), int(config.scheduler_config.max_num_seqs)
    except (AttributeError, TypeError, ValueError):
        return None


class EngineTieringWorker(EngineOffloadingWorker):
    """:class:`EngineOffloadingWorker` whose tier lives in vLLM's shared offload
    region; shutdown closes the engine, unregisters the region and unmaps it."""

    def __init__(self, bridge: EngineBridge, region: Any) -> None:
        super().__init__(bridge)
        self.region: Any = region

    def shutdown(self) -> None:
        """Idempotent. The engine closes first (queued jobs run, in-flight ones are
        awaited) and releases the tier (unregistering the memory); only then is
        the region unmapped."""
        try:
            super().shutdown()
        finally:
            region, self.region = self.region, None
            if region is not None:
                region.cleanup()


class EngineTieringSpec(TieringOffloadingSpec):
    """Load with ``"spec_name": "EngineTieringSpec"`` and
    ``"spec_module_path": "offload_engine.connectors.vllm"``."""

    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        # vLLM asks for the metrics before it builds the spec: fail here, typed
        check_secondary_tiers(extra_config)
        return super().build_metric_definitions(extra_config)

    def __init__(self, config: OffloadingConfig) -> None:
        self.engine_config: EngineOffloadingConfig = parse_engine_config(config)
        if self.engine_config.store_threshold >= 2:
            raise ConfigError(
                f"kv_connector_extra_config['store_threshold']={self.engine_config.store_threshold}"
                " is not supported by vLLM's tiering manager (use 0 or 1)"
            )
        check_secondary_tiers(config.extra_config)
        super().__init__(storage_config(config))
        check_chunks(self, self.engine_config)
        self._engine_worker: EngineTieringWorker | None = None

    def sizing(self, max_model_len: int, max_num_seqs: int) -> PrimarySizing:
        """The CPU primary tier against the scheduler's limits (docs/vllm.md, sizing)."""
        return PrimarySizing(
            num_chunks=int(self.num_chunks),
            kv_bytes_per_chunk=int(self.kv_bytes_per_chunk),
            chunk_tokens=int(self.config.cache.tokens_per_hash) * int(self.blocks_per_chunk),
            kv_groups=len(self.config.groups),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
        )

    @override
    def get_manager(self) -> OffloadingManager:
        """vLLM's tiering manager (the scheduler side); the first call warns when the
        CPU primary tier cannot promote one full-length request's chunks."""
        first = self._manager is None
        manager = super().get_manager()
        if first and (limits := scheduler_limits()) is not None:
            warning = self.sizing(*limits).too_small_warning()
            if warning is not None:
                logger.warning(warning)
        return manager

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # vLLM's CPUOffloadingSpec.get_worker refuses non-CUDA platforms; ours
        # serves every platform the adapter knows.
        if self._engine_worker is None:
            self._engine_worker = self.create_worker(kv_caches)
        return self._engine_worker

    @override
    def create_worker(self, kv_caches: CanonicalKVCaches) -> EngineTieringWorker:  # type: ignore[override]
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        page = self.cpu_page_size_per_worker
        row = self.kv_bytes_per_chunk
        copies = 1 if self.replicated_layout else self.config.parallel.world_size
        if copies * page > row:
            raise LayoutError(
                f"vLLM's shared offload region rows of {row} bytes cannot hold {copies} "
                f"worker pages of cpu_page_size_per_worker={page} bytes"
            )
        region = open_worker_region(self, rank)
        try:
            placement = TierPlacement(
                buffer=region_rows(region, self.num_chunks, row),
                offset=rank * page,
                page_bytes=page,
                block_stride=row,
                owner=(
                    f"vLLM's shared offload region (rank {rank}'s page: "
                    f"cpu_page_size_per_worker={page} bytes in rows of {row} bytes)"
                ),
            )
            bridge = engine_bridge(self, kv_caches, placement)
            del placement
        except BaseException:
            region.cleanup()
            raise
        return EngineTieringWorker(bridge, region)
