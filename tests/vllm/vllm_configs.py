"""vLLM's ``OffloadingConfig`` for the specs' in-process tests (imports vLLM)."""

from __future__ import annotations

from typing import Any


def offloading_config(
    extra: dict[str, Any],
    *,
    spec_keys: dict[str, str],
    blocks_per_chunk: int = 1,
    bytes_per_block: int = 704,
    world_size: int = 1,
    rank: int = 0,
    replicated: bool = False,
    engine_id: str = "test-engine",
) -> Any:
    """What vLLM's connector builds from its config, for a one-group model of
    32-token blocks of ``bytes_per_block`` bytes per worker."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={**spec_keys, **extra},
        engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        replicated_layout=replicated,
    )
