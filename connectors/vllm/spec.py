"""``EngineOffloadingSpec``: the spec vLLM's OffloadingConnector loads by name.

Scheduler side: vLLM's own ``CPUOffloadingSpec`` (its ``CPUOffloadingManager``
with the LRU/ARC policies, chunk sizing from ``cpu_bytes_to_use``), unchanged.
Worker side: an :class:`EngineOffloadingWorker` on offload-engine, on every
platform :func:`~offload_engine.connectors.vllm.platform.select_backend` knows, vLLM's CPU
platform included (which ``CPUOffloadingSpec.get_worker`` refuses).

This module imports vLLM.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from offload_engine import ConfigError

from .bridge import EngineBridge
from .build import build_bridge
from .compat import SUPPORTED_VLLM, vllm_version
from .config import EngineOffloadingConfig, parse_extra_config
from .platform import TierPlacement
from .worker import EngineOffloadingWorker

# a child of vLLM's "vllm" logger, so vLLM's logging configuration shows our lines
logger = init_logger("vllm.offload_engine")


def parse_engine_config(config: OffloadingConfig) -> EngineOffloadingConfig:
    """The checks both specs make before vLLM's own constructor runs, so a bad
    config fails with one :class:`ConfigError` naming the key, not later inside
    vLLM. Warns when the installed vLLM is not a supported release."""
    cfg = parse_extra_config(config.extra_config, blocks_per_chunk=config.cache.blocks_per_chunk)
    try:
        CachePolicyFactory.get_cache_policy_cls(cfg.eviction_policy, cfg.cache_policy_module_path)
    except (ValueError, ImportError, AttributeError) as exc:
        raise ConfigError(
            f"kv_connector_extra_config['eviction_policy']={cfg.eviction_policy!r} "
            f"(cache_policy_module_path={cfg.cache_policy_module_path!r}) does not "
            f"resolve to a vLLM cache policy: {exc}"
        ) from exc
    version = vllm_version()
    if version not in SUPPORTED_VLLM:
        logger.warning(
            "offload-engine's vLLM adapter is written for vLLM %s; this is vLLM %s",
            ", ".join(SUPPORTED_VLLM),
            version,
        )
    world = config.parallel.world_size
    if cfg.stats_path is not None and world > 1 and "{rank}" not in cfg.stats_path:
        raise ConfigError(
            f"kv_connector_extra_config['stats_path']={cfg.stats_path!r}: with "
            f"{world} workers it must contain '{{rank}}' so they do not overwrite each other"
        )
    return cfg


def check_chunks(spec: CPUOffloadingSpec, cfg: EngineOffloadingConfig) -> None:
    """After vLLM sized the tier: refuse a ``cpu_bytes_to_use`` that holds no chunk."""
    config = spec.config
    if config.worker_kv_bytes_per_block > 0 and spec.num_chunks < 1:
        copies = 1 if spec.replicated_layout else config.parallel.world_size
        raise ConfigError(
            f"kv_connector_extra_config['cpu_bytes_to_use']={cfg.cpu_bytes_to_use} holds "
            f"no offload chunk: one chunk needs {spec.kv_bytes_per_chunk or 'more'} bytes "
            f"({config.worker_kv_bytes_per_block} bytes per block x "
            f"{spec.blocks_per_chunk} blocks x {copies} workers, page-aligned)"
        )


def engine_bridge(
    spec: CPUOffloadingSpec,
    kv_caches: CanonicalKVCaches,
    placement: TierPlacement | None = None,
) -> EngineBridge:
    """The worker's engine, on vLLM's current platform, for either spec."""
    engine_config: EngineOffloadingConfig = spec.engine_config  # type: ignore[attr-defined]
    return build_bridge(
        kv_caches,
        current_platform,
        engine_config,
        spec.num_chunks,
        rank=spec.config.parallel.rank,
        log=logger,
        placement=placement,
    )


class EngineOffloadingSpec(CPUOffloadingSpec):
    """Load with ``"spec_name": "EngineOffloadingSpec"`` and
    ``"spec_module_path": "offload_engine.connectors.vllm"``."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.engine_config: EngineOffloadingConfig = parse_engine_config(config)
        super().__init__(config)
        # Each worker keeps its own tier copy: never vLLM's single-writer
        # replicated layout, where only rank 0 would store.
        self.replicated_layout = False
        check_chunks(self, self.engine_config)
        self._engine_worker: EngineOffloadingWorker | None = None

    def _uses_shared_region(self) -> bool:
        # vLLM's CPU worker shares an mmap region across ranks; our tier is
        # private to each worker.
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._engine_worker is None:
            self._engine_worker = EngineOffloadingWorker(engine_bridge(self, kv_caches))
        return self._engine_worker
