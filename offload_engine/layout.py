"""KV-cache layouts, the host tier's block format, and block-id arithmetic.

Model
-----
A :class:`KVLayout` describes the serving engine's KV cache as **regions**:
for region ``r`` of tensor ``t``, block ``b`` occupies the bytes
``[offset + b * stride, offset + b * stride + size)`` of ``t``. Every layout
the engine supports reduces to a list of regions per KV group: a per-layer
FlashAttention tensor ``(2, num_blocks, ...)`` gives a K and a V region, a
blocks-first tensor ``(num_blocks, 2, ...)`` gives one region spanning K and
V, an MLA tensor one region, a cross-layer tensor one region covering all
layers. Offsets and strides come from the tensor's shape and strides, never
from its storage size (a runtime may over-allocate storage for alignment).

The **host tier** stores each cache block contiguously across layers: one
*slot* holds every region of one cache block, back to back, in region order.
A tier block holds ``factor`` consecutive slots (the block-size factor). With
several KV groups a slot is as large as the largest group's regions.

Block-id arithmetic follows vLLM's ``blocks_per_chunk`` rule: a job moving
``n`` cache blocks of a group whose first block has logical index ``i`` starts
``i % factor`` slots into its first tier block and spans
``ceil((n + i % factor) / factor)`` tier blocks. Stores and loads alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from offload_engine.errors import BlockCountMismatchError, InvalidBlockIdsError, LayoutError
from offload_engine.vocabulary import BlockIds, CacheBlocks, TierBlocks

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Region:
    """One block's bytes in one tensor: ``[offset + b*stride, +size)`` for block ``b``."""

    tensor: int
    offset: int
    stride: int
    size: int


def tensor_byte_span(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element, from shape and strides."""
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over ``t``'s bytes (from its data pointer to its span)."""
    import torch

    esz = t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * esz, (tensor_byte_span(t),), (1,)
    )


def _coalesce(regions: Sequence[Region]) -> tuple[Region, ...]:
    """Merge neighbours that are adjacent in the same tensor with the same stride.

    They are adjacent in the tier slot too (slots follow region order), so one
    region (one copy) replaces two.
    """
    out: list[Region] = []
    for r in regions:
        if out:
            p = out[-1]
            if p.tensor == r.tensor and p.stride == r.stride and p.offset + p.size == r.offset:
                out[-1] = Region(p.tensor, p.offset, p.stride, p.size + r.size)
                continue
        out.append(r)
    return tuple(out)


class KVLayout:
    """The serving engine's KV cache, as byte regions per KV group."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[Sequence[Region]],
        num_blocks: int,
        *,
        name: str = "custom",
    ) -> None:
        if not tensors:
            raise LayoutError("a layout needs at least one tensor")
        if not groups or any(not g for g in groups):
            raise LayoutError("a layout needs at least one group, each with a region")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise LayoutError(f"num_blocks must be a positive int, got {num_blocks!r}")
        device = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device != device:
                raise LayoutError(
                    f"all KV tensors must share one device: tensor 0 is on {device}, "
                    f"tensor {i} (shape {tuple(t.shape)}) on {t.device}"
                )
        spans = [tensor_byte_span(t) for t in tensors]
        for g, regions in enumerate(groups):
            for r in regions:
                if not 0 <= r.tensor < len(tensors):
                    raise LayoutError(
                        f"group {g}: region names tensor {r.tensor} of {len(tensors)}"
                    )
                if r.size <= 0 or r.offset < 0 or r.stride < r.size:
                    raise LayoutError(
                        f"group {g}: region {r} needs size > 0, offset >= 0 and stride >= size"
                    )
                end = r.offset + (num_blocks - 1) * r.stride + r.size
                if end > spans[r.tensor]:
                    t = tensors[r.tensor]
                    raise LayoutError(
                        f"group {g}: {num_blocks} blocks of region {r} end at byte {end}, past "
                        f"tensor {r.tensor} (shape {tuple(t.shape)}, stride {t.stride()}, "
                        f"{spans[r.tensor]} bytes)"
                    )
        self.name = name
        self.tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        self.groups: tuple[tuple[Region, ...], ...] = tuple(_coalesce(g) for g in groups)
        self.num_blocks = num_blocks
        self.device = device
        self.group_bytes: tuple[int, ...] = tuple(sum(r.size for r in g) for g in self.groups)
        self.slot_bytes = max(self.group_bytes)
        # offset of each region inside a tier slot
        self.slot_offsets: tuple[tuple[int, ...], ...] = tuple(
            tuple(int(x) for x in np.cumsum([0] + [r.size for r in g])[:-1]) for g in self.groups
        )

    @classmethod
    def from_block_tensors(
        cls, tensors: Sequence[torch.Tensor], *, name: str = "blocks-first"
    ) -> KVLayout:
        """One group; each tensor has ``num_blocks`` as its leading dimension and
        each block's bytes contiguous (vLLM's canonical ``(num_blocks, page)`` views)."""
        if not tensors:
            raise LayoutError("from_block_tensors needs at least one tensor")
        num_blocks = int(tensors[0].shape[0]) if tensors[0].dim() else 0
        regions: list[Region] = []
        for i, t in enumerate(tensors):
            if t.dim() < 1 or int(t.shape[0]) != num_blocks:
                raise LayoutError(
                    f"tensor {i} has shape {tuple(t.shape)}; every tensor must lead with "
                    f"num_blocks={num_blocks}"
                )
            inner = t[0] if t.dim() > 1 else t[:1]
            if t.dim() > 1 and not inner.is_contiguous():
                raise LayoutError(
                    f"tensor {i} (shape {tuple(t.shape)}, stride {t.stride()}): a block's bytes "
                    "must be contiguous"
                )
            size = inner.numel() * t.element_size()
            regions.append(Region(i, 0, t.stride(0) * t.element_size(), size))
        return cls(tensors, [regions], num_blocks, name=name)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one cache block (of the largest group)."""
        return self.slot_bytes

    def __repr__(self) -> str:
        regions = sum(len(g) for g in self.groups)
        return (
            f"<KVLayout {self.name} blocks={self.num_blocks} groups={len(self.groups)} "
            f"regions={regions} slot_bytes={self.slot_bytes} device={self.device}>"
        )


@dataclass(frozen=True)
class GroupMapping:
    """Cache block ids and the tier slots they pair with, for one KV group."""

    group: int
    cache_ids: BlockIds
    slots: BlockIds


def expand_tier_slots(tier_ids: BlockIds, factor: int, skip: int, count: int) -> BlockIds:
    """The ``count`` slots that start ``skip`` slots into ``tier_ids[0]``."""
    if factor == 1:
        return tier_ids[:count]
    slots = (tier_ids[:, None] * factor + np.arange(factor, dtype=np.int64)[None, :]).ravel()
    return slots[skip : skip + count]


def map_blocks(
    cache: CacheBlocks,
    tier: TierBlocks,
    *,
    factor: int,
    num_cache_blocks: int,
    num_tier_blocks: int,
    num_groups: int,
) -> list[GroupMapping]:
    """Pair each cache block of ``cache`` with its tier slot, per group.

    Raises :class:`BlockCountMismatchError` when the tier ids do not cover the
    cache ids exactly, and :class:`InvalidBlockIdsError` for ids outside either
    pool. Vectorised: no per-block Python loop.
    """
    if len(cache.group_sizes) != num_groups:
        raise BlockCountMismatchError(
            f"the cache spec has {len(cache.group_sizes)} KV groups, the layout {num_groups}"
        )
    cache_ids, tier_ids = cache.block_ids, tier.block_ids
    if cache_ids.size and int(cache_ids.max()) >= num_cache_blocks:
        raise InvalidBlockIdsError(
            f"cache block id {int(cache_ids.max())} is out of range (the cache has "
            f"{num_cache_blocks} blocks)"
        )
    if tier_ids.size and int(tier_ids.max()) >= num_tier_blocks:
        raise InvalidBlockIdsError(
            f"tier block id {int(tier_ids.max())} is out of range (the tier has "
            f"{num_tier_blocks} blocks)"
        )
    out: list[GroupMapping] = []
    c0 = t0 = 0
    for g, (n, index) in enumerate(zip(cache.group_sizes, cache.block_indices, strict=True)):
        skip = index % factor
        m = -(-(n + skip) // factor) if n else 0
        if t0 + m > tier_ids.size:
            break
        if n:
            out.append(
                GroupMapping(
                    g,
                    cache_ids[c0 : c0 + n],
                    expand_tier_slots(tier_ids[t0 : t0 + m], factor, skip, n),
                )
            )
        c0 += n
        t0 += m
    else:
        if t0 == tier_ids.size:
            return out
    expected = sum(
        -(-(n + i % factor) // factor) if n else 0
        for n, i in zip(cache.group_sizes, cache.block_indices, strict=True)
    )
    raise BlockCountMismatchError(
        f"{len(cache_ids)} cache blocks (groups {cache.group_sizes}, first indices "
        f"{cache.block_indices}) need {expected} tier blocks at factor {factor}, "
        f"got {tier_ids.size}"
    )
