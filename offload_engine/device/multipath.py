"""A staged job split over the device's own host link and borrowed peers' links.

A **peer path** is a staged job's path through a peer device: its staging
buffers live in the peer's memory and its two DMA streams are the peer's, so its
bytes cross the peer's own host link; the block copy (a store's gather, a load's
scatter) runs on an SM stream of this device and reaches the peer's staging
directly (peer access, over NVLink). So a peer part of a job *is* a staged job,
launched by :func:`~offload_engine.device.staged.enqueue_staged` with a launch
context whose staging buffers and stream set are the path's
(:class:`PeerPath`).

Each path has an SM stream of its own: a part's block copies wait for its
staging buffers to be free, and on one SM stream those waits would hold every
other part's copies behind them, one part after another. Each path also has
its own pools of events (and id buffers): a stream wait covers an event's latest
record, and a path that waits on its staging buffers' last events must not find
them recorded again by another path's part meanwhile (that would only delay it,
but it would put the parts one after another again). An event may be recorded
only on a stream of the device it was made on (CUDA's rule; any stream may wait
on it), so a path's events come from two pools
(:class:`~offload_engine.device.pools.PathResources`): this device's for its SM
stream, the peer's for its DMA streams.

**Which jobs split.** A staged job of whole blocks of at least ``min_blocks``
blocks (``DeviceHandlerConfig.peer_min_blocks``) is cut into one contiguous run
of blocks per path, in tier-address order (so runs of consecutive tier slots
stay whole), the own link's first, with :func:`~offload_engine.device.peers.split_units`
in proportion to each path's ``rate``. Rates are not measured yet: every path,
the own link's included, weighs 1, which fits links of one kind (one PCIe
generation). A peer part of fewer than :data:`PEER_MIN_PART_BLOCKS` blocks folds
into the own link. A job of some layers (``TransferSpec.tensors``), a ``dma`` or
``kernel`` job, and a job launched with the native launch stay on the own link.
With a :class:`~offload_engine.device.peers.PeerLedger`, a peer whose owner has
announced traffic of its own is skipped for that job.

**Order.** The parts of a job run at once: each part waits for the previous
job's writes (``JobOrder.last_effect`` as the job found it; every part's waits
are enqueued before any part records an event, so none waits on a pooled event
that an earlier part of the job has just recorded again), and the job's effect
is every part's, so the next job's writes wait for all of them; the job's checks
are every part's, so it is reported once its parts have landed, and fails if a
part failed.

**Cost.** Each borrowed peer holds ``peer_staging_bytes`` of its memory per
handler (a store and a load handler: twice that), one SM stream on this device
and two streams on the peer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from offload_engine.device.config import CopyStrategy
from offload_engine.device.peers import MAX_DEVICES, PeerLedger, split_units
from offload_engine.device.plan import DevicePlan
from offload_engine.device.pools import PathResources, StagingBuffers
from offload_engine.device.staged import enqueue_staged
from offload_engine.errors import EngineClosedError, TransferError
from offload_engine.host import GroupMapping

if TYPE_CHECKING:
    from offload_engine.device.context import JobOrder, LaunchContext
    from offload_engine.device.runtimes.base import DeviceRuntime

log = logging.getLogger("offload_engine.device")

#: a peer's part of fewer blocks than this folds into the own link: a borrowed path
#: costs its own block copies, DMAs and events, which a couple of blocks do not repay
PEER_MIN_PART_BLOCKS = 8

#: a stream set: (SM stream, (DMA stream, DMA stream))
StreamSet = tuple[Any, tuple[Any, Any]]


@dataclass(eq=False)
class PeerPath:
    """One borrowed link: the peer ``device``, its staging buffers (in its memory),
    its stream set (an SM stream of this device, two DMA streams of the peer), the
    launch context a part on it takes, and its ``rate`` (a weight for
    :func:`~offload_engine.device.peers.split_units`; 1 until rates are measured)."""

    device: int
    staging: StagingBuffers
    streams: StreamSet
    ctx: LaunchContext
    rate: float = 1.0
    #: the peer as the host numbers it (the ledger's index); None: unknown
    host_device: int | None = None


def open_paths(
    ctx: LaunchContext,
    devices: Sequence[int],
    *,
    buffers: int,
    rows: int,
    events: int,
    who: str,
) -> list[PeerPath]:
    """A path per peer in ``devices``, each with ``buffers`` staging buffers of
    ``rows`` slot rows in the peer's memory and ``events`` events to start
    with (half on each device). A peer whose staging or streams cannot be had is logged and left
    out: its share stays on the other links."""
    rt = ctx.runtime
    paths = []
    for device in devices:
        made: list[Any] = []
        try:
            staging = StagingBuffers(rt, buffers, rows, ctx.layout.slot_bytes, device=device)
            made.append(rt.new_stream(priority=-1))
            made.append(rt.new_stream_on(device))
            made.append(rt.new_stream_on(device))
            pools = path_resources(ctx, device)
            pools.add_events(events // 2)
        except (RuntimeError, MemoryError) as exc:
            log.warning("%s does not borrow device %d's host link: %s", who, device, exc)
            release_streams(rt, made, who)
            continue
        streams: StreamSet = (made[0], (made[1], made[2]))
        path_ctx = dataclasses.replace(
            ctx, staging=staging, pool=[streams], native_sets={}, resources=pools
        )
        host = rt.host_device_index(device)
        if host is not None and not 0 <= host < MAX_DEVICES:
            host = None
        paths.append(PeerPath(device, staging, streams, path_ctx, host_device=host))
    return paths


def path_resources(ctx: LaunchContext, device: int) -> PathResources:
    """A path's pools: a piece's gather (store) or scatter (load) records events of
    this device on the path's SM stream, its DMAs events of peer ``device`` on the
    peer's streams (the gather is a store's first half, the scatter a load's second)."""
    rt = ctx.runtime

    def on_peer() -> Any:
        return rt.new_event_on(device)

    own = rt.new_event
    first, second = (own, on_peer) if ctx.store else (on_peer, own)
    return PathResources(rt, keep_id_buffers=ctx.resources.keep, first=first, second=second)


def release_streams(runtime: DeviceRuntime, streams: Sequence[Any], who: str) -> None:
    """Give ``streams`` back; a failure is logged (the handler closes either way)."""
    for stream in streams:
        try:
            runtime.release_stream(stream)
        except TransferError as exc:
            log.warning("%s could not release a stream: %s", who, exc)


class Multipath:
    """A handler's borrowed links and which jobs take them (see the module's
    docstring). Only the launching thread calls :meth:`split` (launches never
    overlap); ``paths`` is fixed once the handler has started."""

    def __init__(
        self, paths: Sequence[PeerPath], *, min_blocks: int, ledger: PeerLedger | None
    ) -> None:
        self.paths = tuple(paths)
        self.min_blocks = min_blocks
        self.ledger = ledger

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(p.device for p in self.paths)

    def _free(self) -> list[PeerPath]:
        """The paths whose owners announced no traffic of their own (every path
        without a ledger, and a peer whose host index is unknown; none with a ledger
        closed under the handler)."""
        ledger = self.ledger
        if ledger is None:
            return list(self.paths)
        try:
            return [
                p for p in self.paths if p.host_device is None or not ledger.busy(p.host_device)
            ]
        except EngineClosedError:
            return []

    def split(self, plan: DevicePlan) -> list[tuple[PeerPath | None, DevicePlan]] | None:
        """The parts of a staged ``plan`` as ``(path, part)``, the own link's first
        (path None), or None where the job stays whole on the own link."""
        if plan.strategy is not CopyStrategy.STAGED or plan.regions is not None:
            return None
        total = sum(int(m.cache_ids.shape[0]) for m in plan.groups)
        if total < self.min_blocks:
            return None
        paths = self._free()
        if not paths:
            return None
        ranges = split_units(total, [1.0, *(p.rate for p in paths)], min_units=PEER_MIN_PART_BLOCKS)
        if all(start == stop for start, stop in ranges[1:]):
            return None
        parts = part_plans(plan, ranges)
        return [
            (path, part)
            for path, part in zip([None, *paths], parts, strict=True)
            if part is not None
        ]

    def streams(self) -> list[Any]:
        """Every stream the paths hold (for the handler's close)."""
        return [s for p in self.paths for s in (p.streams[0], *p.streams[1])]


def part_plans(plan: DevicePlan, ranges: Sequence[tuple[int, int]]) -> list[DevicePlan | None]:
    """A plan per ``(start, stop)`` range of the job's blocks, taken group after
    group with each group's blocks in tier-slot order (None for an empty range).
    A part shares the job's ``ready`` event; its checks are the job's once it is
    launched (:func:`enqueue_split`)."""
    ordered = []
    for m in plan.groups:
        by_slot = np.argsort(m.slots, kind="stable")
        ordered.append((m.group, m.cache_ids[by_slot], m.slots[by_slot]))
    parts: list[DevicePlan | None] = []
    for start, stop in ranges:
        if start == stop:
            parts.append(None)
            continue
        groups, at = [], 0
        for group, ids, slots in ordered:
            n = int(ids.shape[0])
            lo, hi = max(start - at, 0), min(stop - at, n)
            if lo < hi:
                groups.append(GroupMapping(group, ids[lo:hi], slots[lo:hi]))
            at += n
        parts.append(DevicePlan(groups, 0, CopyStrategy.STAGED, plan.ready, units=stop - start))
    return parts


def enqueue_split(
    ctx: LaunchContext,
    order: JobOrder,
    plan: DevicePlan,
    own: StreamSet,
    parts: list[tuple[PeerPath | None, DevicePlan]],
) -> None:
    """Launch a job's parts at once, each on its path (``own``: the own link's
    stream set; see the module's docstring for the order). The job's checks are
    every part's; the own link's part leaves its events and id buffer on ``plan``,
    a peer part stays in ``plan.peer_parts`` for its path's pools. Where a part's
    launch raises, the parts launched so far are the job's, and the next job
    waits for them."""
    ops = ctx.ops
    launches = []
    for path, part in parts:
        part_ctx, (sm, dmas) = (ctx, own) if path is None else (path.ctx, path.streams)
        order.after_last_effect(ops, dmas if ctx.store else (sm,))
        launches.append((part_ctx, sm, dmas, part))
    effects: list[tuple[Any, Any]] = []
    try:
        for part_ctx, sm, dmas, part in launches:
            order.last_effect = []  # waited for above
            try:
                enqueue_staged(part_ctx, order, part, sm, dmas)
            finally:
                plan.checks += part.checks
                if part_ctx is ctx:
                    plan.events += part.events
                    plan.ids, part.ids = part.ids, None
                else:
                    plan.peer_parts.append((part_ctx.resources, part))
                effects += order.last_effect
    finally:
        order.last_effect = effects
