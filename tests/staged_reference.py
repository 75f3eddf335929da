"""The staged strategy's plan, made call by call in Python: the slow reference that
the library's one planner (``oe_staged_build`` in ``_native_launch.c``) is checked
against, op for op (``tests/test_native_launch.py``).

A store gathers each piece on the SM stream, then DMAs it; a load the reverse.
Each KV group's blocks go through staging in tier-address order (stable), cut
into pieces of ``rows`` blocks that take the staging buffers in turn; within a
piece, blocks whose tier rows continue each other (and whose staging rows do: a
group that fills a row) move as one DMA descriptor. A piece is: [wait first <-
its buffer's last event] first half, record, wait, second half, record.
Consecutive pieces' DMAs alternate between the two DMA streams.
:func:`use_reference` makes a handler plan with this module instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from offload_engine.device.kernel import upload_ids
from offload_engine.device.plan import DevicePlan
from offload_engine.device.pools import StagingBuffers
from offload_engine.device.staged import COPY2D_ROWS
from offload_engine.errors import ConfigError
from offload_engine.host.layout import KVLayout, merge_runs
from offload_engine.host.mapping import GroupMapping

#: the largest pitch a 2D copy takes (MAX_PITCH in _native_launch.c)
MAX_PITCH = 0x7FFFFFFF

if TYPE_CHECKING:
    from offload_engine.device.context import JobOrder, LaunchContext


def tier_order(ctx: LaunchContext, m: GroupMapping, tier_base: np.uint64) -> tuple[Any, Any]:
    """The group's cache ids and tier row addresses, sorted by tier address
    (stable: blocks bound for one slot keep their order)."""
    rows = tier_base + ctx.tier.slot_offsets(m.slots)
    if rows.shape[0] < 2 or bool((rows[1:] > rows[:-1]).all()):
        return m.cache_ids, rows
    order = np.argsort(rows, kind="stable")
    return m.cache_ids[order], rows[order]


def plan_runs(
    layout: KVLayout, group: int, tier_rows: Any, staging: StagingBuffers
) -> tuple[Any, ...] | None:
    """A group's runs of consecutive tier slots, cut at piece boundaries, planned
    once per job: each run's tier address, its staging row's address in each
    buffer, its bytes, and per piece where its runs begin (and end), so a piece
    only slices them. None when no two neighbours continue each other
    (scattered slots, or a group that does not fill a staging row, so staging
    rows cannot merge): the descriptors are then one per block. These are the
    descriptors ``merge_runs`` makes from each piece's rows."""
    size = layout.group_bytes[group]
    n = int(tier_rows.shape[0])
    if n < 2 or size != layout.slot_bytes:
        return None
    run_starts = np.empty(n, dtype=np.bool_)
    np.not_equal(tier_rows[1:], tier_rows[:-1] + np.uint64(size), out=run_starts[1:])
    if run_starts[1:].all():
        return None
    rows_per = staging.rows
    run_starts[::rows_per] = True  # a piece starts a run
    starts = np.flatnonzero(run_starts)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = n
    run_bytes = (ends - starts).astype(np.uint64) * np.uint64(size)
    offsets = (starts % rows_per).astype(np.uint64) * np.uint64(layout.slot_bytes)
    run_rows = [offsets + np.uint64(a) for a in staging.addresses]
    cuts = np.searchsorted(starts, np.arange(0, n + rows_per, rows_per)).tolist()
    return tier_rows[starts], run_rows, run_bytes, cuts


@dataclass
class _Group:
    """One KV group of a staged job, sorted by tier address."""

    mapping: GroupMapping
    ids: Any  # the group's cache ids on the device
    tier_rows: Any  # their tier row addresses
    runs: tuple[Any, ...] | None  # plan_runs, for a group of several pieces


def copy2d_runs(tier_rows: Any, size: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """A piece's 2D copies, for a group that moves part of each slot: runs of at
    least COPY2D_ROWS rows one stride apart, as ``(first row, rows, stride)``, and
    the rows left to descriptors."""
    tier = [int(t) for t in tier_rows]
    runs, single = [], []
    i, n = 0, len(tier)
    while i < n:
        if n - i >= COPY2D_ROWS:
            d = tier[i + 1] - tier[i]
            j = i
            if size <= d <= MAX_PITCH:
                j = i + 1
                while j + 1 < n and tier[j + 1] - tier[j] == d:
                    j += 1
            if j + 1 - i >= COPY2D_ROWS:
                runs.append((i, j + 1 - i, d))
                i = j + 1
                continue
        single.append(i)
        i += 1
    return runs, single


def _rows(staging: StagingBuffers, b: int) -> Any:
    """Buffer ``b``'s row addresses, for slot descriptors."""
    offsets = np.arange(staging.rows, dtype=np.uint64) * np.uint64(staging.slot_bytes)
    return np.uint64(staging.addresses[b]) + offsets


def _piece_descriptors(
    ctx: LaunchContext, g: _Group, k: int, lo: int, hi: int, b: int, staging: StagingBuffers
) -> tuple[Any, Any, Any]:
    """A piece's DMA descriptors (dst, src, sizes)."""
    if g.runs is None:  # a single piece, or no two neighbours continue
        tier = g.tier_rows[lo:hi]
        rows = _rows(staging, b)[: hi - lo]
        sizes = np.full(hi - lo, ctx.layout.group_bytes[g.mapping.group], dtype=np.uint64)
        if int(g.mapping.cache_ids.shape[0]) <= staging.rows:
            tier, rows, sizes = merge_runs(tier, rows, sizes)  # symmetric in its two sides
    else:  # one per run of consecutive tier slots within the piece
        run_tier, run_rows, run_bytes, cuts = g.runs
        c0, c1 = cuts[k], cuts[k + 1]
        tier, rows, sizes = run_tier[c0:c1], run_rows[b][c0:c1], run_bytes[c0:c1]
    return (tier, rows, sizes) if ctx.store else (rows, tier, sizes)


def _piece(
    ctx: LaunchContext,
    staging: StagingBuffers,
    g: _Group,
    k: int,
    lo: int,
    streams: tuple[Any, Any],
    events: tuple[Any, Any],
) -> None:
    """Enqueue one piece: [wait for its buffer] first half, record, wait, second
    half, record; a store gathers (SM) then DMAs, a load the reverse."""
    ops = ctx.ops
    n = int(g.mapping.cache_ids.shape[0])
    hi = min(lo + staging.rows, n)
    b = staging.next
    staging.next = (b + 1) % len(staging.buffers)
    first, second = streams
    full, end = events
    group = g.mapping.group
    size = ctx.layout.group_bytes[group]
    runs: list[tuple[int, int, int]] = []
    if size < ctx.layout.slot_bytes:  # rows with gaps between them: runs go as 2D copies
        runs, single = copy2d_runs(g.tier_rows[lo:hi], size)
        keep = np.array(single, dtype=np.int64)
        tier = g.tier_rows[lo:hi][keep]
        rows = _rows(staging, b)[: hi - lo][keep]
        sizes = np.full(len(single), size, dtype=np.uint64)
        dst, src = (tier, rows) if ctx.store else (rows, tier)
    else:
        dst, src, sizes = _piece_descriptors(ctx, g, k, lo, hi, b, staging)
    piece_ids = g.ids if lo == 0 and hi == n else g.ids[lo:hi]
    copy = ctx.tables.block_copy(
        g.mapping.group, piece_ids, None, hi - lo, staging.addresses[b], staging.views[b]
    )
    sm_stream, dma_stream = (first, second) if ctx.store else (second, first)
    if staging.free[b] is not None:
        ops.wait_event(first, staging.free[b])
    for half in (0, 1):
        if (half == 0) == ctx.store:
            ops.copy_blocks(sm_stream, copy)
        else:
            ops.memcpy_batch(dma_stream, dst, src, sizes, ctx.direction)
            pitch = ctx.layout.slot_bytes
            for row, height, stride in runs:
                t, r = int(g.tier_rows[lo + row]), int(_rows(staging, b)[row])
                d, s, pitches = (t, r, (stride, pitch)) if ctx.store else (r, t, (pitch, stride))
                ops.memcpy_2d(dma_stream, d, s, size, height, pitches, ctx.direction)
        if half == 0:
            ops.record(full, first)
            ops.wait_event(second, full)
    ops.record(end, second)
    staging.free[b] = end


def enqueue_staged_reference(
    ctx: LaunchContext, order: JobOrder, plan: DevicePlan, sm: Any, dmas: tuple[Any, Any]
) -> None:
    """Put a staged job's pieces on the streams, call by call on ``ctx.ops``."""
    staging = ctx.staging
    if staging is None:  # pragma: no cover - guarded at construction
        raise ConfigError("no staging memory")
    store = ctx.store
    ctx.ops.wait_event(sm, plan.ready)
    order.after_last_effect(ctx.ops, dmas if store else (sm,))
    tier_base = np.uint64(ctx.tier_base)
    in_tier_order = [tier_order(ctx, m, tier_base) for m in plan.groups]
    # every group's ids in one upload, before any piece
    ids = upload_ids(ctx, plan, sm, [cache_ids for cache_ids, _ in in_tier_order])
    rows_per = staging.rows
    groups = []
    for m, group_ids, (_, tier_rows) in zip(plan.groups, ids, in_tier_order, strict=True):
        # a group of one piece merges that piece (fewer numpy calls than planning)
        several = int(m.cache_ids.shape[0]) > rows_per
        runs = plan_runs(ctx.layout, m.group, tier_rows, staging) if several else None
        groups.append(_Group(m, group_ids, tier_rows, runs))
    pieces = sum(-(-int(m.cache_ids.shape[0]) // rows_per) for m in plan.groups)
    # two events per piece (its first half done, its second half done; an empty
    # job records one), taken from the pool at once
    events = ctx.resources.events(max(2 * pieces, 1))
    plan.events.extend(events)
    last: dict[int, Any] = {}  # last event per DMA stream (stores end on both)
    at = 0
    for g in groups:
        for k, lo in enumerate(range(0, int(g.mapping.cache_ids.shape[0]), rows_per)):
            order.pieces += 1
            dma = dmas[order.pieces % 2]
            streams = (sm, dma) if store else (dma, sm)
            _piece(ctx, staging, g, k, lo, streams, (events[at], events[at + 1]))
            last[order.pieces % 2] = events[at + 1]
            at += 2
    plan.checks += events[:at]
    if pieces == 0:  # an empty job still takes its place in the order
        stream = dmas[0] if store else sm
        ctx.ops.record(events[0], stream)
        plan.checks.append(events[0])
        order.last_effect = [(events[0], stream)]
    elif store and len(last) == 2:
        # the next job's DMA streams wait for both ends (no join needed)
        order.last_effect = [(last[0], dmas[0]), (last[1], dmas[1])]
    else:
        order.last_effect = [(events[at - 1], dmas[order.pieces % 2] if store else sm)]


def use_reference(monkeypatch: Any) -> None:
    """Make every handler without the native launch plan its staged jobs here."""
    from offload_engine.device import launch

    monkeypatch.setattr(launch, "enqueue_staged", enqueue_staged_reference)
