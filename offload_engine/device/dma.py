"""The ``dma`` strategy: every block region is one copy descriptor between the KV
cache and its tier slot, merged where neighbours continue each other, and sent
in batched copy calls on one DMA stream. No SM work, so a concurrent GEMM is not
slowed; each descriptor costs the copy engine a setup, so small regions move
well below the link's speed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offload_engine.device.plan import DevicePlan, after_last_effect, mark
from offload_engine.host import chunk_descriptors

if TYPE_CHECKING:
    from offload_engine.device.handler import DeviceCopyHandler


def enqueue_dma(h: DeviceCopyHandler, plan: DevicePlan, stream: Any) -> None:
    ops = h._ops
    ops.wait_event(stream, plan.ready)
    after_last_effect(h, (stream,))
    tier = h.tier
    regions = plan.regions
    native = h._native
    for m in plan.groups:
        tables = h.layout.region_tables(m.group, None if regions is None else regions[m.group])
        if native is not None:
            # the same descriptors, made by the native library in one call
            native.memcpy_chunks(stream, tables, m.cache_ids, m.slots, h._geometry, h.direction)
            continue
        dst, src, sizes = chunk_descriptors(
            tables,
            m.cache_ids,
            m.slots,
            tier_base=h._tier_base,
            slot_bytes=tier.slot_bytes,
            direction=h.direction,
            factor=tier.factor,
            block_stride=tier.block_stride,
        )
        ops.memcpy_batch(stream, dst, src, sizes, h.direction)
    h._last_effect = [(mark(h, plan, stream), stream)]
