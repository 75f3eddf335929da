"""The host-memory tier: a pool of tier blocks, each ``factor`` slots of a cache block.

By default the memory is one ``(num_blocks * factor, slot_bytes)`` uint8
tensor, so slot ``s`` of the pool is row ``s`` and tier block ``b`` is rows
``[b * factor, (b + 1) * factor)``; plain pageable memory, or an allocation a
device runtime has pinned (registered with the driver) and releases at close.
:meth:`HostTier.over` wraps memory someone else owns instead (vLLM's shared
offload region), with a page size and a stride between blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from offload_engine._checks import check_int
from offload_engine.errors import ConfigError, LayoutError
from offload_engine.host.layout import (
    KVLayout,
    slot_byte_offsets,
)
from offload_engine.vocabulary import BlockIds


def _physical_memory() -> int:
    """This host's physical memory in bytes (a bound no pageable tier may pass)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 56


class HostTier:
    """``num_blocks`` tier blocks of ``factor`` slots of ``slot_bytes`` each.

    By default the slots are one contiguous ``(num_blocks * factor, slot_bytes)``
    tensor. A tier over memory someone else owns (:meth:`over`) may space its
    blocks further apart: block ``b`` is then ``page_bytes`` bytes at
    ``b * block_stride`` from the start, its ``factor`` slots back to back at its
    start. Slot ``s`` lives at ``(s // factor) * block_stride + (s % factor) *
    slot_bytes`` (:meth:`slot_offsets`).
    """

    def __init__(
        self,
        num_blocks: int,
        slot_bytes: int,
        *,
        factor: int = 1,
        memory: torch.Tensor | None = None,
        release: Callable[[], None] | None = None,
        pinned: bool = False,
    ) -> None:
        for key, value in (
            ("num_blocks", num_blocks),
            ("slot_bytes", slot_bytes),
            ("factor", factor),
        ):
            check_int(value, f"HostTier {key}")
        rows = num_blocks * factor
        if memory is None:
            nbytes = rows * slot_bytes
            if nbytes > _physical_memory():
                # refused before torch tries: with overcommit a huge allocation may
                # "succeed" and fail later, page by page, far from this call
                raise ConfigError(
                    f"HostTier num_blocks={num_blocks} x factor={factor} x slot_bytes="
                    f"{slot_bytes} is {nbytes} bytes, more than this host's memory "
                    f"({_physical_memory()} bytes)"
                )
            try:
                memory = torch.empty((rows, slot_bytes), dtype=torch.uint8)
            except (RuntimeError, MemoryError) as exc:  # torch reports a failed malloc so
                raise ConfigError(
                    f"HostTier num_blocks={num_blocks} x factor={factor} x slot_bytes="
                    f"{slot_bytes} ({nbytes / 2**30:.1f} GiB) cannot be allocated: {exc}"
                ) from exc
        elif not isinstance(memory, torch.Tensor):
            raise TypeError(f"tier memory must be a torch.Tensor, got {type(memory).__name__}")
        elif (
            memory.dtype != torch.uint8
            or tuple(memory.shape) != (rows, slot_bytes)
            or memory.device.type != "cpu"
            or not memory.is_contiguous()
        ):
            raise LayoutError(
                f"tier memory must be a contiguous CPU uint8 tensor of shape {(rows, slot_bytes)}, "
                f"got {memory.dtype} {tuple(memory.shape)} on {memory.device}"
            )
        self.num_blocks = num_blocks
        self.factor = factor
        self.slot_bytes = slot_bytes
        self.page_bytes = factor * slot_bytes
        self.block_stride = factor * slot_bytes
        self.pinned = pinned
        self._memory: torch.Tensor | None = memory
        self._span: torch.Tensor | None = memory.view(-1)
        self._release = release

    @classmethod
    def over(
        cls,
        buffer: torch.Tensor,
        *,
        num_blocks: int,
        slot_bytes: int,
        factor: int = 1,
        offset: int = 0,
        page_bytes: int | None = None,
        block_stride: int | None = None,
        release: Callable[[], None] | None = None,
        pinned: bool = False,
        owner: str = "the buffer",
    ) -> HostTier:
        """A tier inside ``buffer`` (a contiguous CPU tensor of one-byte elements that
        someone else owns, such as vLLM's shared offload region): block ``b`` is
        ``page_bytes`` bytes (default ``factor * slot_bytes``) at ``offset + b *
        block_stride`` (default ``page_bytes``). Nothing is copied; ``release`` runs
        at :meth:`release` (to unpin it), and the memory itself stays the owner's.

        Raises :class:`LayoutError`, naming both sides, when a block's slots do
        not fit its page or the blocks do not fit the buffer. ``owner`` names the
        buffer in those messages.
        """
        for key, value in (
            ("num_blocks", num_blocks),
            ("slot_bytes", slot_bytes),
            ("factor", factor),
        ):
            check_int(value, f"HostTier.over {key}")
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"HostTier.over takes a torch.Tensor, got {type(buffer).__name__}")
        if buffer.device.type != "cpu" or buffer.element_size() != 1 or not buffer.is_contiguous():
            raise LayoutError(
                f"{owner} must be a contiguous CPU tensor of bytes, got {buffer.dtype} "
                f"{tuple(buffer.shape)} on {buffer.device}"
            )
        need = factor * slot_bytes
        page = need if page_bytes is None else page_bytes
        stride = page if block_stride is None else block_stride
        for key, value in (("offset", offset), ("page_bytes", page), ("block_stride", stride)):
            check_int(value, f"HostTier.over {key}", minimum=0)
        if page < need:
            raise LayoutError(
                f"{owner} gives each tier block a page of {page} bytes, but the engine's tier "
                f"block needs {need} bytes ({factor} slots x {slot_bytes} bytes per cache block)"
            )
        if stride < page:
            raise LayoutError(
                f"{owner}: block stride {stride} bytes is smaller than its page of {page} "
                "bytes, so blocks would overlap"
            )
        size = buffer.numel()
        end = offset + (num_blocks - 1) * stride + page
        if end > size:
            raise LayoutError(
                f"{owner} holds {size} bytes, but {num_blocks} tier blocks of {page} bytes "
                f"every {stride} bytes from byte {offset} end at byte {end}"
            )
        flat = buffer.view(-1).view(torch.uint8)
        tier = cls.__new__(cls)
        tier.num_blocks = num_blocks
        tier.factor = factor
        tier.slot_bytes = slot_bytes
        tier.page_bytes = page
        tier.block_stride = stride
        tier.pinned = pinned
        tier._memory = torch.as_strided(
            flat, (num_blocks, page), (stride, 1), flat.storage_offset() + offset
        )
        tier._span = flat[offset:end]
        tier._release = release
        return tier

    @classmethod
    def for_layout(cls, layout: KVLayout, num_blocks: int, *, factor: int = 1) -> HostTier:
        """A pageable tier sized for ``layout``'s blocks."""
        if not isinstance(layout, KVLayout):
            raise TypeError(f"for_layout takes a KVLayout, got {type(layout).__name__}")
        return cls(num_blocks, layout.slot_bytes, factor=factor)

    @property
    def memory(self) -> torch.Tensor:
        """The tier's bytes: the ``(num_blocks * factor, slot_bytes)`` uint8 tensor of a
        contiguous tier, or the ``(num_blocks, page_bytes)`` strided view of one made
        by :meth:`over` with gaps between its blocks."""
        if self._memory is None:
            raise LayoutError("this host tier has been released")
        return self._memory

    @property
    def span(self) -> torch.Tensor:
        """A contiguous 1-D uint8 view from the tier's first byte to its last."""
        if self._span is None:
            raise LayoutError("this host tier has been released")
        return self._span

    @property
    def released(self) -> bool:
        return self._memory is None

    @property
    def nbytes(self) -> int:
        """Bytes of the slots (gaps between blocks not counted)."""
        return self.num_blocks * self.factor * self.slot_bytes

    @property
    def contiguous(self) -> bool:
        """Whether slot ``s`` is simply at ``s * slot_bytes``."""
        return self.block_stride == self.factor * self.slot_bytes

    @property
    def slot_pitch(self) -> int | None:
        """Bytes from one slot row to the next, when all slots are one row apart:
        ``slot_bytes`` for a contiguous tier, ``block_stride`` when ``factor`` is 1,
        else ``None`` (slots within a block and across blocks are spaced differently)."""
        if self.contiguous:
            return self.slot_bytes
        if self.factor == 1:
            return self.block_stride
        return None

    def slot_rows(self) -> torch.Tensor | None:
        """Every slot as a row of a ``(num_blocks * factor, slot_bytes)`` view (strided
        by :attr:`slot_pitch`), or ``None`` where no such view exists."""
        pitch = self.slot_pitch
        if pitch is None:
            return None
        span = self.span
        return torch.as_strided(
            span,
            (self.num_blocks * self.factor, self.slot_bytes),
            (pitch, 1),
            span.storage_offset(),
        )

    def slot_grid(self) -> torch.Tensor:
        """The slots as a ``(num_blocks, factor, slot_bytes)`` view: ``[s // factor,
        s % factor]`` is slot ``s``. Exists for every tier."""
        span = self.span
        return torch.as_strided(
            span,
            (self.num_blocks, self.factor, self.slot_bytes),
            (self.block_stride, self.slot_bytes, 1),
            span.storage_offset(),
        )

    def slot_offsets(self, slots: BlockIds) -> npt.NDArray[np.uint64]:
        """Byte offset of each slot from the tier's first byte (vectorised)."""
        return slot_byte_offsets(
            slots, slot_bytes=self.slot_bytes, factor=self.factor, block_stride=self.block_stride
        )

    def block(self, block_id: int) -> torch.Tensor:
        """Tier block ``block_id`` as a ``(factor, slot_bytes)`` view."""
        return self.slot_grid()[block_id]

    def check_layout(self, layout: KVLayout) -> None:
        if layout.slot_bytes > self.slot_bytes:
            raise LayoutError(
                f"a cache block of layout {layout.name} needs {layout.slot_bytes} bytes, "
                f"the tier's slots hold {self.slot_bytes}"
            )

    def release(self) -> None:
        """Unpin the memory (if a runtime pinned it), then drop it. Idempotent.

        Unpinning comes first: the registration must end while the memory it
        covers is still allocated.
        """
        release, self._release = self._release, None
        try:
            if release is not None:
                release()
        finally:
            self._memory = None
            self._span = None

    def __repr__(self) -> str:
        state = "released" if self._memory is None else ("pinned" if self.pinned else "pageable")
        gaps = (
            "" if self.contiguous else f" page_bytes={self.page_bytes} stride={self.block_stride}"
        )
        return (
            f"<HostTier blocks={self.num_blocks} factor={self.factor} "
            f"slot_bytes={self.slot_bytes}{gaps} {state}>"
        )
