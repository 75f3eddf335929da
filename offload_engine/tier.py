"""The host-memory tier: a pool of tier blocks, each ``factor`` slots of a cache block.

The memory is one ``(num_blocks * factor, slot_bytes)`` uint8 tensor, so slot
``s`` of the pool is row ``s`` and tier block ``b`` is rows
``[b * factor, (b + 1) * factor)``. By default it is plain pageable memory; a
device runtime passes an allocation it has pinned (registered with the driver)
and releases it at close.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload_engine._checks import check_int
from offload_engine.errors import ConfigError, InvalidTransferError, LayoutError
from offload_engine.layout import GroupMapping, KVLayout, check_destinations, map_blocks
from offload_engine.vocabulary import CacheBlocks, Direction, TierBlocks, TransferSpec


def _physical_memory() -> int:
    """This host's physical memory in bytes (a bound no pageable tier may pass)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 56


class HostTier:
    """``num_blocks`` tier blocks of ``factor`` slots of ``slot_bytes`` each."""

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
        self.pinned = pinned
        self._memory: torch.Tensor | None = memory
        self._release = release

    @classmethod
    def for_layout(cls, layout: KVLayout, num_blocks: int, *, factor: int = 1) -> HostTier:
        """A pageable tier sized for ``layout``'s blocks."""
        if not isinstance(layout, KVLayout):
            raise TypeError(f"for_layout takes a KVLayout, got {type(layout).__name__}")
        return cls(num_blocks, layout.slot_bytes, factor=factor)

    @property
    def memory(self) -> torch.Tensor:
        """The ``(num_blocks * factor, slot_bytes)`` uint8 tensor."""
        if self._memory is None:
            raise LayoutError("this host tier has been released")
        return self._memory

    @property
    def released(self) -> bool:
        return self._memory is None

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.factor * self.slot_bytes

    def block(self, block_id: int) -> torch.Tensor:
        """Tier block ``block_id`` as a ``(factor, slot_bytes)`` view."""
        f = self.factor
        return self.memory[block_id * f : (block_id + 1) * f]

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

    def __repr__(self) -> str:
        state = "released" if self._memory is None else ("pinned" if self.pinned else "pageable")
        return (
            f"<HostTier blocks={self.num_blocks} factor={self.factor} "
            f"slot_bytes={self.slot_bytes} {state}>"
        )


@dataclass(frozen=True)
class TierTransfer:
    """A job between a KV layout and a host tier, mapped at submit."""

    direction: Direction
    groups: list[GroupMapping]
    nbytes: int


def map_transfer(
    spec: TransferSpec,
    layout: KVLayout,
    tier: HostTier,
    *,
    who: str,
    expect: Direction | None = None,
) -> TierTransfer:
    """Check that ``spec`` moves blocks between the KV cache and the tier (the
    ``expect``-ed way, if given), and pair every cache block with its tier slot.
    A job that writes one destination twice is refused (:func:`check_destinations`).

    Raises :class:`InvalidTransferError`, :class:`BlockCountMismatchError`,
    :class:`InvalidBlockIdsError` or, for a released tier, :class:`LayoutError`.
    """
    direction = spec.direction
    if direction is Direction.COPY or (expect is not None and direction is not expect):
        want = f"a {expect.value}" if expect is not None else "a store or a load"
        raise InvalidTransferError(
            f"{who} needs {want} between a KV cache and a tier, got "
            f"{type(spec.src).__name__} -> {type(spec.dst).__name__}"
        )
    cache, blocks = (spec.src, spec.dst) if direction is Direction.STORE else (spec.dst, spec.src)
    if not isinstance(cache, CacheBlocks) or not isinstance(blocks, TierBlocks):
        raise InvalidTransferError(f"{who} needs CacheBlocks and TierBlocks, got {spec!r}")
    if tier.released:
        raise LayoutError(f"{who}: the host tier has been released")
    groups = map_blocks(
        cache,
        blocks,
        factor=tier.factor,
        num_cache_blocks=layout.num_blocks,
        num_tier_blocks=tier.num_blocks,
        num_groups=len(layout.groups),
    )
    check_destinations(
        groups,
        direction=direction,
        aliases=layout.group_aliases,
        factor=tier.factor,
    )
    nbytes = sum(int(m.cache_ids.size) * layout.group_bytes[m.group] for m in groups)
    return TierTransfer(direction, groups, nbytes)
