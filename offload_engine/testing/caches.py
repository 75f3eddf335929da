"""Random host caches and poisoned tiers for benchmarks (also re-exported by
:mod:`offload_engine.testing`)."""

from __future__ import annotations

import torch

from offload_engine.host.layout import KVLayout
from offload_engine.host.tier import HostTier


def random_host_cache(
    *,
    num_layers: int = 4,
    num_blocks: int = 64,
    block_tokens: int = 16,
    kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[list[torch.Tensor], KVLayout]:
    """Random per-layer blocks-first KV tensors ``(num_blocks, 2, tokens, heads, dim)``
    in host memory and their layout."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn((num_blocks, 2, block_tokens, kv_heads, head_dim), generator=gen).to(dtype)
        for _ in range(num_layers)
    ]
    return tensors, KVLayout.from_block_tensors(tensors)


def poisoned_tier(
    layout: KVLayout, num_blocks: int, *, factor: int = 1, fill: int = 0xA5
) -> HostTier:
    """A host tier for ``layout`` whose bytes are all ``fill`` (so unwritten bytes show)."""
    tier = HostTier.for_layout(layout, num_blocks, factor=factor)
    tier.memory.fill_(fill)
    return tier
