"""Random KV caches in every supported layout, and helpers that read their bytes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from offload_engine.host.layout import KVLayout, byte_view


def cache_block_bytes(layout: KVLayout, block_id: int, group: int = 0) -> bytes:
    """Every byte of cache block ``block_id`` of ``group``, in tier-slot order
    (copied to host memory first if the cache is on a device)."""
    parts = []
    for r in layout.groups[group]:
        base = byte_view(layout.tensors[r.tensor])
        start = r.offset + block_id * r.stride
        parts.append(base[start : start + r.size].cpu().numpy().tobytes())
    return b"".join(parts)


Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]

#: the layouts :func:`build_layout` makes
LAYOUT_KINDS = ("flash-attention", "flashinfer", "mla", "cross-layer", "separate-kv", "groups")


def build_layout(
    kind: str,
    empty: Allocator,
    *,
    num_blocks: int = 16,
    num_layers: int = 2,
    block_tokens: int = 16,
    kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> KVLayout:
    """A KV cache of layout ``kind`` filled with random data, in memory from ``empty``.

    ``separate-kv`` pads every block row, as an NPU runner over-allocates for
    alignment; ``groups`` combines a FlashAttention group and an MLA group.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        t = empty(shape, dtype)
        t.copy_(torch.randn(shape, generator=gen).to(dtype))
        return t

    nb, bt, h, d = num_blocks, block_tokens, kv_heads, head_dim
    if kind == "flash-attention":
        return KVLayout.flash_attention([rand((2, nb, bt, h, d)) for _ in range(num_layers)])
    if kind == "flashinfer":
        return KVLayout.flashinfer([rand((nb, 2, bt, h, d)) for _ in range(num_layers)])
    if kind == "mla":
        return KVLayout.mla([rand((nb, bt, h * d)) for _ in range(num_layers)])
    if kind == "cross-layer":
        return KVLayout.cross_layer(rand((nb, num_layers, 2, bt, h, d)))
    if kind == "separate-kv":
        row, pad = bt * h * d, 32
        views = []
        for _ in range(2 * num_layers):
            buf = rand((nb * (row + pad) + pad,))
            views.append(buf.as_strided((nb, bt, h, d), (row + pad, h * d, d, 1)))
        return KVLayout.separate_kv(views[0::2], views[1::2])
    if kind == "groups":
        fa = KVLayout.flash_attention([rand((2, nb, bt, h, d)) for _ in range(num_layers)])
        mla = KVLayout.mla([rand((nb, bt, 2 * d))])
        return KVLayout.combine([fa, mla])
    raise ValueError(f"unknown layout kind {kind!r}; known: {LAYOUT_KINDS}")


def group_of(layout: KVLayout, spec_group_sizes: tuple[int, ...], index: int) -> int:
    """The KV group of the ``index``-th block id of a spec with ``spec_group_sizes``."""
    total = 0
    for g, n in enumerate(spec_group_sizes):
        total += n
        if index < total:
            return g % len(layout.groups)
    raise IndexError(index)


def random_ids(rng: np.random.Generator, count: int, upper: int) -> list[int]:
    """``count`` distinct ids below ``upper``, in random order."""
    return [int(x) for x in rng.choice(upper, size=count, replace=False)]
