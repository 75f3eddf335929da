"""KV-cache layouts and the host tier's block format.

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

A job's mapping of cache blocks to tier slots is :mod:`offload_engine.host.mapping`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from offload_engine._checks import check_int
from offload_engine.errors import (
    InvalidTransferError,
    LayoutError,
)
from offload_engine.vocabulary import BlockIds, Direction

U64 = npt.NDArray[np.uint64]


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
    esz = t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * esz, (tensor_byte_span(t),), (1,)
    )


def _as_tensors(values: object, what: str) -> list[torch.Tensor]:
    """``values`` as a list of tensors; TypeError for anything else."""
    import torch

    if isinstance(values, (str, bytes, torch.Tensor)) or not isinstance(values, Sequence):
        raise TypeError(f"{what} takes a sequence of tensors, got {type(values).__name__}")
    out = list(values)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: item {i} is a {type(t).__name__}, not a torch.Tensor")
    return out


def _check_uniform(layers: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """All per-layer tensors of a layout must agree in shape, dtype and device."""
    layers = _as_tensors(layers, what)
    if not layers:
        raise LayoutError(f"{what} needs at least one tensor")
    first = layers[0]
    for i, t in enumerate(layers):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(
                f"{what}: layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}, layer 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}; the layers must agree"
            )
    return first


@dataclass(frozen=True)
class RegionTables:
    """One group's regions as arrays: absolute base address, block stride,
    size, and offset inside a tier slot (all uint64)."""

    base: U64
    stride: U64
    size: U64
    slot_offset: U64


def merge_runs(dst: U64, src: U64, sizes: U64) -> tuple[U64, U64, U64]:
    """Merge neighbouring copies that continue each other on both sides.

    The driver does not merge descriptors and each one costs CPU time, so
    adjacent chunks (consecutive block ids in a layout whose blocks are
    contiguous, consecutive tier slots) become one copy.
    """
    n = sizes.shape[0]
    if n <= 1:
        return dst, src, sizes
    ends_src = src[:-1] + sizes[:-1]
    ends_dst = dst[:-1] + sizes[:-1]
    breaks = (ends_src != src[1:]) | (ends_dst != dst[1:])
    if breaks.all():  # nothing to merge (scattered blocks, the common case)
        return dst, src, sizes
    if not breaks.any():
        return dst[:1], src[:1], np.array([sizes.sum()], dtype=np.uint64)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    return dst[starts], src[starts], np.add.reduceat(sizes, starts).astype(np.uint64)


def slot_byte_offsets(
    slots: BlockIds, *, slot_bytes: int, factor: int = 1, block_stride: int | None = None
) -> U64:
    """Byte offset of each tier slot from the tier's start: ``s * slot_bytes`` when
    the tier's blocks are back to back (``block_stride`` None or ``factor *
    slot_bytes``), else ``(s // factor) * block_stride + (s % factor) * slot_bytes``."""
    ids = slots.astype(np.uint64)
    if block_stride is None or block_stride == factor * slot_bytes:
        return ids * np.uint64(slot_bytes)
    f = np.uint64(factor)
    return (ids // f) * np.uint64(block_stride) + (ids % f) * np.uint64(slot_bytes)


def chunk_descriptors(
    tables: RegionTables,
    cache_ids: BlockIds,
    slots: BlockIds,
    *,
    tier_base: int,
    slot_bytes: int,
    direction: Direction,
    factor: int = 1,
    block_stride: int | None = None,
) -> tuple[U64, U64, U64]:
    """``(dst, src, sizes)`` for every (block, region) chunk of one group, in
    block-major order (a block's regions are adjacent in its tier slot), merged.
    ``factor`` and ``block_stride`` place the slots of a tier with gaps between
    its blocks (:func:`slot_byte_offsets`)."""
    ids = cache_ids.astype(np.uint64)[:, None]
    cache = (tables.base[None, :] + ids * tables.stride[None, :]).ravel()
    offsets = slot_byte_offsets(
        slots, slot_bytes=slot_bytes, factor=factor, block_stride=block_stride
    )
    tier = (np.uint64(tier_base) + offsets[:, None] + tables.slot_offset[None, :]).ravel()
    sizes = np.broadcast_to(tables.size, (cache_ids.shape[0], tables.size.shape[0])).ravel()
    if direction is Direction.STORE:
        return merge_runs(tier, cache, sizes)
    return merge_runs(cache, tier, sizes)


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


def _check_group_types(groups: object) -> None:
    """``groups`` is a non-empty sequence of non-empty sequences of Regions of ints."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise TypeError(f"groups must be a sequence of region lists, got {groups!r}")
    for g, regions in enumerate(groups):
        if isinstance(regions, (str, bytes)) or not isinstance(regions, Sequence):
            raise TypeError(f"group {g} must be a sequence of Regions, got {regions!r}")
        for r in regions:
            if not isinstance(r, Region) or not all(
                isinstance(v, int) and not isinstance(v, bool)
                for v in (r.tensor, r.offset, r.stride, r.size)
            ):
                raise TypeError(f"group {g}: {r!r} is not a Region of ints")
    if not groups or any(not g for g in groups):
        raise LayoutError("a layout needs at least one group, each with a region")


def _check_group_bounds(
    tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[Region]], num_blocks: int
) -> None:
    """Every region names a tensor, and its ``num_blocks`` blocks lie inside it."""
    spans = [tensor_byte_span(t) for t in tensors]
    for g, regions in enumerate(groups):
        for r in regions:
            if not 0 <= r.tensor < len(tensors):
                raise LayoutError(f"group {g}: region names tensor {r.tensor} of {len(tensors)}")
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
        tensors = _as_tensors(tensors, "KVLayout")
        if not tensors:
            raise LayoutError("a layout needs at least one tensor")
        _check_group_types(groups)
        check_int(num_blocks, "num_blocks", error=LayoutError)
        device = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device != device:
                raise LayoutError(
                    f"all KV tensors must share one device: tensor 0 is on {device}, "
                    f"tensor {i} (shape {tuple(t.shape)}) on {t.device}"
                )
        _check_group_bounds(tensors, groups, num_blocks)
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
        self._tables: dict[object, RegionTables] = {}
        self._selections: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {}
        # groups that share a tensor (hybrid models) share their blocks' memory: the
        # same id in two of them is one destination. One class label per group.
        label = list(range(len(self.groups)))
        owner: dict[int, int] = {}
        for g, regions in enumerate(self.groups):
            for r in regions:
                first = owner.setdefault(r.tensor, g)
                if label[first] != label[g]:
                    old, new = label[g], label[first]
                    label = [new if x == old else x for x in label]
        self.group_aliases: tuple[int, ...] = tuple(label)

    @classmethod
    def from_block_tensors(
        cls, tensors: Sequence[torch.Tensor], *, name: str = "blocks-first"
    ) -> KVLayout:
        """One group; each tensor has ``num_blocks`` as its leading dimension and
        each block's bytes contiguous (vLLM's canonical ``(num_blocks, page)`` views)."""
        tensors = _as_tensors(tensors, "from_block_tensors")
        if not tensors:
            raise LayoutError("from_block_tensors needs at least one tensor")
        num_blocks = int(tensors[0].shape[0]) if tensors[0].dim() else 0
        if num_blocks < 1:
            raise LayoutError(
                f"from_block_tensors: tensor 0 has shape {tuple(tensors[0].shape)}; it must lead "
                "with num_blocks >= 1"
            )
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

    @classmethod
    def flash_attention(cls, layers: Sequence[torch.Tensor]) -> KVLayout:
        """Per-layer tensors ``(2, num_blocks, block_tokens, heads, head_dim)``:
        K and V before ``num_blocks`` (FlashAttention). Two regions per layer."""
        first = _check_uniform(layers, "flash_attention")
        if first.dim() < 3 or first.shape[0] != 2 or first.shape[1] < 1:
            raise LayoutError(
                f"flash_attention expects (2, num_blocks, ...) tensors with num_blocks >= 1, "
                f"got {tuple(first.shape)}"
            )
        esz = first.element_size()
        regions: list[Region] = []
        for i, t in enumerate(layers):
            if not t[0, 0].is_contiguous():
                raise LayoutError(
                    f"layer {i} (shape {tuple(t.shape)}, stride {t.stride()}): a block's K "
                    "bytes must be contiguous"
                )
            size = t[0, 0].numel() * esz
            stride = t.stride(1) * esz
            regions += [Region(i, 0, stride, size), Region(i, t.stride(0) * esz, stride, size)]
        return cls(layers, [regions], int(first.shape[1]), name="flash-attention")

    @classmethod
    def flashinfer(cls, layers: Sequence[torch.Tensor]) -> KVLayout:
        """Per-layer tensors ``(num_blocks, 2, block_tokens, heads, head_dim)``:
        blocks first, K and V of a block side by side (FlashInfer)."""
        first = _check_uniform(layers, "flashinfer")
        if first.dim() < 3 or first.shape[1] != 2:
            raise LayoutError(
                f"flashinfer expects (num_blocks, 2, ...) tensors, got {tuple(first.shape)}"
            )
        return cls.from_block_tensors(layers, name="flashinfer")

    @classmethod
    def mla(cls, layers: Sequence[torch.Tensor]) -> KVLayout:
        """Per-layer MLA tensors ``(num_blocks, block_tokens, latent_dim)``: one
        latent per token, no K/V split."""
        first = _check_uniform(layers, "mla")
        if first.dim() != 3:
            raise LayoutError(
                "mla expects (num_blocks, block_tokens, latent_dim) tensors, "
                f"got {tuple(first.shape)}"
            )
        return cls.from_block_tensors(layers, name="mla")

    @classmethod
    def cross_layer(cls, tensor: torch.Tensor) -> KVLayout:
        """One tensor ``(num_blocks, layers, ...)`` holding each block contiguously
        across all layers."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"cross_layer takes one tensor, got {type(tensor).__name__}")
        return cls.from_block_tensors([tensor], name="cross-layer")

    @classmethod
    def separate_kv(
        cls, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor]
    ) -> KVLayout:
        """K and V in separate per-layer tensors ``(num_blocks, ...)`` (the Ascend
        layout). Block views come from shape and strides, so storage a runtime
        over-allocated for alignment is never touched."""
        k_layers = _as_tensors(k_layers, "separate_kv's k_layers")
        v_layers = _as_tensors(v_layers, "separate_kv's v_layers")
        if len(k_layers) != len(v_layers):
            raise LayoutError(f"{len(k_layers)} K tensors but {len(v_layers)} V tensors")
        both = [t for pair in zip(k_layers, v_layers, strict=True) for t in pair]
        _check_uniform(both, "separate_kv")
        return cls.from_block_tensors(both, name="separate-kv")

    @classmethod
    def combine(cls, groups: Sequence[KVLayout], *, name: str = "groups") -> KVLayout:
        """One layout with a KV group per given single-group layout (hybrid models).
        The groups share ``num_blocks``; a tensor may appear in several groups."""
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise TypeError(f"combine takes a sequence of KVLayouts, got {type(groups).__name__}")
        for k, layout in enumerate(groups):
            if not isinstance(layout, KVLayout):
                raise TypeError(f"combine: item {k} is a {type(layout).__name__}, not a KVLayout")
        if not groups:
            raise LayoutError("combine needs at least one layout")
        num_blocks = groups[0].num_blocks
        tensors: list[torch.Tensor] = []
        index: dict[int, int] = {}
        out: list[list[Region]] = []
        for k, layout in enumerate(groups):
            if layout.num_blocks != num_blocks:
                raise LayoutError(
                    f"group {k} has {layout.num_blocks} blocks, group 0 has {num_blocks}"
                )
            for regions in layout.groups:
                mapped = []
                for r in regions:
                    t = layout.tensors[r.tensor]
                    key = id(t)
                    if key not in index:
                        index[key] = len(tensors)
                        tensors.append(t)
                    mapped.append(Region(index[key], r.offset, r.stride, r.size))
                out.append(mapped)
        return cls(tensors, out, num_blocks, name=name)

    def region_tables(self, group: int, regions: tuple[int, ...] | None = None) -> RegionTables:
        """Per-region absolute addresses, strides, sizes and slot offsets (cached); with
        ``regions``, only those of the group's regions (see :meth:`regions_in`)."""
        key = group if regions is None else (group, regions)
        cached = self._tables.get(key)
        if cached is None:
            picked = range(len(self.groups[group])) if regions is None else regions
            chosen = [self.groups[group][i] for i in picked]
            offsets = self.slot_offsets[group]
            ptrs = [t.data_ptr() for t in self.tensors]
            cached = RegionTables(
                base=np.array([ptrs[r.tensor] + r.offset for r in chosen], dtype=np.uint64),
                stride=np.array([r.stride for r in chosen], dtype=np.uint64),
                size=np.array([r.size for r in chosen], dtype=np.uint64),
                slot_offset=np.array([offsets[i] for i in picked], dtype=np.uint64),
            )
            self._tables[key] = cached
        return cached

    def regions_in(self, tensors: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Per group, the indices of its regions that lie in ``tensors`` (indices into
        :attr:`tensors`): what a job with ``TransferSpec.tensors`` moves. Raises
        :class:`InvalidTransferError` for an index past the last tensor."""
        cached = self._selections.get(tensors)
        if cached is None:
            if tensors and tensors[-1] >= len(self.tensors):
                raise InvalidTransferError(
                    f"TransferSpec.tensors names tensor {tensors[-1]}; layout {self.name} has "
                    f"{len(self.tensors)} tensors"
                )
            wanted = set(tensors)
            cached = tuple(
                tuple(i for i, r in enumerate(g) if r.tensor in wanted) for g in self.groups
            )
            self._selections[tensors] = cached
        return cached

    def region_views(self, group: int) -> tuple[torch.Tensor, ...]:
        """Each region of ``group`` as a ``(num_blocks, size)`` strided byte view.

        ``as_strided`` takes an offset into the whole storage, so the tensor's own
        storage offset is added: a KV tensor may be a view that starts inside a
        larger allocation (vLLM carves every layer out of one buffer).
        """
        out = []
        for r in self.groups[group]:
            base = byte_view(self.tensors[r.tensor])
            out.append(
                torch.as_strided(
                    base, (self.num_blocks, r.size), (r.stride, 1), base.storage_offset() + r.offset
                )
            )
        return tuple(out)

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
