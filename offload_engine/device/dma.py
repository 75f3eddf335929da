"""The ``dma`` strategy: every block region is one copy descriptor between the KV
cache and its tier slot, merged where neighbours continue each other, and sent
in batched copy calls on one DMA stream. No SM work, so a concurrent GEMM is not
slowed; each descriptor costs the copy engine a setup, so small regions move
well below the link's speed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offload_engine.device.plan import DevicePlan
from offload_engine.host import chunk_descriptors

if TYPE_CHECKING:
    from offload_engine.device.context import JobOrder, LaunchContext


def enqueue_dma(ctx: LaunchContext, order: JobOrder, plan: DevicePlan, stream: Any) -> None:
    ops = ctx.ops
    ops.wait_event(stream, plan.ready)
    order.after_last_effect(ops, (stream,))
    tier = ctx.tier
    regions = plan.regions
    native = ctx.native
    direction = ctx.direction
    for m in plan.groups:
        tables = ctx.layout.region_tables(m.group, None if regions is None else regions[m.group])
        if native is not None:
            # the same descriptors, made by the native library in one call
            native.memcpy_chunks(stream, tables, m.cache_ids, m.slots, ctx.geometry, direction)
            continue
        dst, src, sizes = chunk_descriptors(
            tables,
            m.cache_ids,
            m.slots,
            tier_base=ctx.tier_base,
            slot_bytes=tier.slot_bytes,
            direction=direction,
            factor=tier.factor,
            block_stride=tier.block_stride,
        )
        ops.memcpy_batch(stream, dst, src, sizes, direction)
    order.last_effect = [(ctx.mark(plan, stream), stream)]
