"""The worker side assembled from vLLM's registration: layout, backend, handlers,
engine, and the :class:`EngineBridge` over them. vLLM-free."""

from __future__ import annotations

import logging
from typing import Any

from offload_engine import SyncOffloadingEngine

from .bridge import EngineBridge
from .config import EngineOffloadingConfig
from .layout import layout_from_canonical
from .platform import TierPlacement, select_backend

logger = logging.getLogger(__name__)


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
    return EngineBridge(
        engine,
        backend.cache_medium,
        tier=tier,
        stats_path=stats_path,
        log=log,
        layout=layout,
        config=config,
    )
