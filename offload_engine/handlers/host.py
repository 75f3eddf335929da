"""Host handler: copies blocks between a KV cache in host memory and a host tier.

It serves the ``CPU -> CPU`` pair in both directions: a job whose source is
:class:`~offload_engine.CacheBlocks` is a store, one whose destination is, a
load. It is the engine's default where no accelerator exists, and the
reference the device handlers are tested against.

Each job is planned at submit (vectorised id arithmetic, typed errors) and
executed on a worker thread as one gather + one scatter per (group, region)
with torch indexing, which releases the GIL while it copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload_engine.errors import InvalidTransferError, LayoutError
from offload_engine.handler import LaunchedJob
from offload_engine.handlers.threadpool import ThreadPoolHandler
from offload_engine.layout import KVLayout, byte_view, check_destinations, map_blocks
from offload_engine.tier import HostTier
from offload_engine.vocabulary import (
    CacheBlocks,
    Direction,
    Medium,
    TierBlocks,
    TransferSpec,
)


@dataclass(frozen=True)
class HostPlan:
    """A planned host copy: per group, cache-block and slot index tensors."""

    store: bool
    groups: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]  # (group, cache idx, slot idx)
    nbytes: int


class HostCopyHandler(ThreadPoolHandler[HostPlan]):
    """CPU <-> CPU copies between ``layout`` (host tensors) and ``tier``."""

    src = Medium.CPU
    dst = Medium.CPU

    def __init__(
        self,
        layout: KVLayout,
        tier: HostTier,
        *,
        workers: int = 1,
        thread_name: str = "offload-engine-host",
        close_timeout: float = 30.0,
    ) -> None:
        if not isinstance(layout, KVLayout) or not isinstance(tier, HostTier):
            raise TypeError(
                f"HostCopyHandler takes a KVLayout and a HostTier, got "
                f"{type(layout).__name__} and {type(tier).__name__}"
            )
        super().__init__(workers=workers, thread_name=thread_name, close_timeout=close_timeout)
        if layout.device.type != "cpu":
            raise LayoutError(
                f"HostCopyHandler needs a KV cache in host memory; layout {layout.name} is on "
                f"{layout.device}"
            )
        tier.check_layout(layout)
        self.layout = layout
        self.tier = tier
        bases = [byte_view(t) for t in layout.tensors]
        # (num_blocks, size) strided byte views of every region, and the matching
        # (num_slots, size) column slices of the tier, built once.
        self._views: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...] = tuple(
            tuple(
                (
                    torch.as_strided(
                        bases[r.tensor], (layout.num_blocks, r.size), (r.stride, 1), r.offset
                    ),
                    tier.memory[:, off : off + r.size],
                )
                for r, off in zip(regions, offsets, strict=True)
            )
            for regions, offsets in zip(layout.groups, layout.slot_offsets, strict=True)
        )

    def prepare(self, spec: TransferSpec) -> HostPlan:
        direction = spec.direction
        if direction is Direction.STORE:
            cache, tier = spec.src, spec.dst
        elif direction is Direction.LOAD:
            cache, tier = spec.dst, spec.src
        else:
            raise InvalidTransferError(
                f"{self.name} moves blocks between a KV cache and a tier, got "
                f"{type(spec.src).__name__} -> {type(spec.dst).__name__}"
            )
        if not isinstance(cache, CacheBlocks) or not isinstance(tier, TierBlocks):
            raise InvalidTransferError(
                f"{self.name} needs CacheBlocks and TierBlocks, got {spec.src!r} -> {spec.dst!r}"
            )
        mapping = map_blocks(
            cache,
            tier,
            factor=self.tier.factor,
            num_cache_blocks=self.layout.num_blocks,
            num_tier_blocks=self.tier.num_blocks,
            num_groups=len(self.layout.groups),
        )
        store = direction is Direction.STORE
        check_destinations(
            mapping, store=store, aliases=self.layout.group_aliases, factor=self.tier.factor
        )
        groups = tuple((m.group, torch.tensor(m.cache_ids), torch.tensor(m.slots)) for m in mapping)
        nbytes = sum(int(m.cache_ids.size) * self.layout.group_bytes[m.group] for m in mapping)
        return HostPlan(store, groups, nbytes)

    def execute(self, job: LaunchedJob[HostPlan]) -> int:
        plan = job.prepared
        for group, cache_idx, slot_idx in plan.groups:
            for cache_view, tier_view in self._views[group]:
                if plan.store:
                    tier_view.index_copy_(0, slot_idx, cache_view.index_select(0, cache_idx))
                else:
                    cache_view.index_copy_(0, cache_idx, tier_view.index_select(0, slot_idx))
        return plan.nbytes

    async def aclose(self) -> None:
        await super().aclose()
        self._views = ()
