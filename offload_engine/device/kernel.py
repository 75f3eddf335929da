"""The ``kernel`` strategy: an SM copy kernel reads the KV regions and writes the
tier's mapped pinned memory directly (or the reverse), one launch per KV group.
Near the link's speed for any region size, but the kernel takes SMs (and memory
bandwidth) from a concurrent GEMM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from offload_engine.device.plan import DevicePlan
from offload_engine.errors import ConfigError

if TYPE_CHECKING:
    from offload_engine.device.context import JobOrder, LaunchContext


def upload_ids(
    ctx: LaunchContext, plan: DevicePlan, stream: Any, arrays: list[Any]
) -> list[torch.Tensor]:
    """Put the job's id arrays on the device with one upload, from a buffer the
    handler reuses once the job is done (no allocation per job)."""
    total = sum(int(a.shape[0]) for a in arrays)
    buffer = ctx.resources.id_buffer(plan, total)
    host = buffer.host
    if len(arrays) == 1:
        host[:total] = arrays[0]
        return [ctx.ops.upload_ids(stream, buffer, total)]
    at = 0
    for a in arrays:
        host[at : at + a.shape[0]] = a
        at += int(a.shape[0])
    device = ctx.ops.upload_ids(stream, buffer, total)
    out = []
    at = 0
    for a in arrays:
        out.append(device[at : at + a.shape[0]])
        at += int(a.shape[0])
    return out


def enqueue_kernel(ctx: LaunchContext, order: JobOrder, plan: DevicePlan, stream: Any) -> None:
    ctx.ops.wait_event(stream, plan.ready)
    order.after_last_effect(ctx.ops, (stream,))
    if plan.groups:
        tier_view = ctx.tier_view
        if tier_view is None:  # pragma: no cover - refused at construction
            raise ConfigError("the kernel strategy needs evenly spaced tier slots")
        arrays = [a for m in plan.groups for a in (m.cache_ids, m.slots)]
        ids = upload_ids(ctx, plan, stream, arrays)
        for k, m in enumerate(plan.groups):
            n = int(m.cache_ids.shape[0])
            copy = ctx.tables.block_copy(
                m.group, ids[2 * k], ids[2 * k + 1], n, ctx.tier_base, tier_view
            )
            ctx.ops.copy_blocks(stream, copy)
    order.last_effect = [(ctx.mark(plan, stream), stream)]
