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

from offload_engine.engine.handler import LaunchedJob
from offload_engine.engine.threadpool import ThreadPoolHandler
from offload_engine.errors import LayoutError
from offload_engine.host.layout import KVLayout
from offload_engine.host.mapping import GroupMapping, LastMapping, map_transfer
from offload_engine.host.tier import HostTier
from offload_engine.vocabulary import (
    Direction,
    Medium,
    TransferSpec,
)


@dataclass(frozen=True)
class HostPlan:
    """A planned host copy: per group, cache-block and slot index tensors."""

    direction: Direction
    groups: list[GroupMapping]
    nbytes: int
    regions: tuple[tuple[int, ...], ...] | None = None  # TransferSpec.tensors' regions


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
        self._last_mapping = LastMapping()  # a layer-wise load's parts pair their blocks once
        # (num_blocks, size) strided byte views of every region, and the matching
        # (num_slots, size) column slices of the tier's slot rows, built once. A
        # tier whose slots are not evenly spaced (blocks of several slots with
        # gaps between blocks) has no slot rows: its (num_blocks, factor, size)
        # grid is indexed by (block, slot-in-block) pairs instead.
        rows = tier.slot_rows()
        self._grid = rows is None
        slots = tier.slot_grid() if rows is None else rows
        self._views: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...] = tuple(
            tuple(
                (view, slots[..., off : off + view.shape[1]])
                for view, off in zip(layout.region_views(g), layout.slot_offsets[g], strict=True)
            )
            for g in range(len(layout.groups))
        )

    def prepare(self, spec: TransferSpec) -> HostPlan:
        job = map_transfer(spec, self.layout, self.tier, who=self.name, last=self._last_mapping)
        return HostPlan(job.direction, job.groups, job.nbytes, job.regions)

    def execute(self, job: LaunchedJob[HostPlan]) -> int:
        plan = job.prepared
        factor = self.tier.factor
        for m in plan.groups:  # index tensors are built here, off the submitting thread
            cache_idx = torch.from_numpy(m.cache_ids.copy())
            slot_idx = torch.from_numpy(m.slots.copy())
            views = self._views[m.group]
            if plan.regions is not None:
                views = tuple(views[i] for i in plan.regions[m.group])
            if self._grid:
                where = (slot_idx // factor, slot_idx % factor)
                for cache_view, tier_grid in views:
                    if plan.direction is Direction.STORE:
                        tier_grid.index_put_(where, cache_view.index_select(0, cache_idx))
                    else:
                        cache_view.index_copy_(0, cache_idx, tier_grid[where])
                continue
            for cache_view, tier_view in views:
                if plan.direction is Direction.STORE:
                    tier_view.index_copy_(0, slot_idx, cache_view.index_select(0, cache_idx))
                else:
                    cache_view.index_copy_(0, cache_idx, tier_view.index_select(0, slot_idx))
        return plan.nbytes

    async def aclose(self) -> None:
        await super().aclose()
        self._views = ()
