"""The ``staged`` strategy: a store gathers each piece of a job on the device into a
staging buffer whose rows are shaped like tier slots, then moves the piece to the
host with one DMA descriptor per run of consecutive tier slots; a load does the
reverse. Whole-slot descriptors move at the link's speed where per-region ones do
not, and the gather is a short SM copy of device memory, so a concurrent GEMM
loses little.

A job is cut into pieces of ``rows`` blocks per KV group; pieces take the staging
buffers in turn, so later pieces' first halves run while earlier pieces' second
halves do, and consecutive pieces' DMAs alternate between the two DMA streams.
The job's writes (store: the DMAs, load: the scatters) wait for the previous
job's writes; the other half of each piece is only held by buffer reuse. Every
piece records events the watcher checks, since a device error surfaces at the
next event recorded on its own stream. Each group's blocks go through staging in
tier-address order, so a run of consecutive tier slots (ascending or descending
in the job, as an allocator that reuses freed slots last-in first-out hands them
out) fills consecutive staging rows and moves as one DMA descriptor; a group that
moves part of each slot (some layers) leaves gaps between its rows, so a run of
consecutive slots there moves as one 2D copy.

**One planner.** The pieces are planned by the native library
(``oe_staged_build`` in ``runtimes/_native_launch.c``, through a
:class:`~offload_engine.device.runtimes._native.StagedPlanner`), which writes
them as launch-program ops: planning them in Python costs more CPU than a native
launch of the whole job. With the native launch
(:mod:`offload_engine.device.staged_native`) those ops are issued as driver
calls; a runtime that launches from Python (NPU, the fakes, CUDA without the
native launch) gets them here, planned with stream and event *indices* for
handles, and this module makes the same calls on the runtime, op by op. Without
the native library (no C compiler) there is no staged strategy: ``AUTO`` picks
``dma`` and an explicit ``STAGED`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from offload_engine.device.plan import DevicePlan
from offload_engine.device.pools import StagingBuffers
from offload_engine.device.runtimes._native import (
    BATCH_WORDS,
    COPY2D_WORDS,
    LAUNCH_GRID_X,
    LAUNCH_IDS,
    LAUNCH_NPARAMS,
    LAUNCH_PARAMS,
    LAUNCH_SLOT_BASE,
    LAUNCH_STREAM,
    OP_BATCH,
    OP_COPY2D,
    OP_LAUNCH,
    OP_RECORD,
    OP_WAIT,
    StagedHeader,
    StagedPlanner,
)
from offload_engine.device.runtimes.base import IdBuffer
from offload_engine.errors import ConfigError

if TYPE_CHECKING:
    from offload_engine.device.context import JobOrder, LaunchContext

#: the stream indices the planner is given for a Python launch
_SM, _DMA0, _DMA1 = 1, 2, 3
#: a launch op template for a Python launch: the group in the function's word, the
#: SM stream's index, and seven parameter words, of which the planner sets the
#: ids' (a byte offset into the job's ids) and the slot base (a staging buffer's
#: address), and the block count in the grid's x
_LAUNCH_WORDS = LAUNCH_SLOT_BASE + 1


def gather(ctx: LaunchContext, plan: DevicePlan, total: int) -> IdBuffer:
    """The job's cache ids into a reused id buffer and its tier slots into the
    handler's slot array (``ctx.slots``), group after group (the planner sorts both
    in place by tier address); the id buffer."""
    buffer = ctx.resources.id_buffer(plan, total)
    host = buffer.host
    slots = ctx.slots.take(total)
    at = 0
    for m in plan.groups:
        n = int(m.cache_ids.shape[0])
        host[at : at + n] = m.cache_ids
        slots[at : at + n] = m.slots
        at += n
    return buffer


def leave_state(
    ctx: LaunchContext,
    order: JobOrder,
    plan: DevicePlan,
    streams: tuple[Any, tuple[Any, Any]],
    staging: StagingBuffers,
    events: list[Any],
    pieces: int,
) -> None:
    """The state after a staged job of ``pieces`` pieces (at least one): the staging
    buffers' last events and turn, the pieces' parity, the job's checks and last
    effect."""
    sm, dmas = streams
    nbuf = len(staging.buffers)
    first = staging.next
    staging.next = (first + pieces) % nbuf
    order.pieces += pieces
    for i in range(max(pieces - nbuf, 0), pieces):  # each buffer's last piece
        staging.free[(first + i) % nbuf] = events[2 * i + 1]
    plan.checks += events
    last = order.pieces % 2
    if ctx.store and pieces >= 2:  # the last piece of each parity: the last two pieces
        ends = {last: events[2 * pieces - 1], 1 - last: events[2 * pieces - 3]}
        order.last_effect = [(ends[0], dmas[0]), (ends[1], dmas[1])]
    else:
        order.last_effect = [(events[2 * pieces - 1], dmas[last] if ctx.store else sm)]


def empty_job(
    ctx: LaunchContext,
    order: JobOrder,
    plan: DevicePlan,
    sm: Any,
    dmas: tuple[Any, Any],
    event: Any,
) -> None:
    """An empty job still takes its place in the order: one event on the stream its
    writes would have gone on."""
    stream = dmas[0] if ctx.store else sm
    ctx.ops.record(event, stream)
    plan.checks.append(event)
    order.last_effect = [(event, stream)]


#: a run of at least this many tier rows one stride apart (consecutive slots of a
#: group that moves part of each slot: some layers of a block) goes as one 2D copy.
#: On an H100 a 2D copy of 512 rows of 64 KiB from 2 MiB-apart pinned rows ran at
#: 0.96 of a contiguous copy (49.8 against 51.7 GB/s) for about 30 us of driver
#: CPU, where one copy per row ran at 14 GB/s and cost 1.9 ms
COPY2D_ROWS = 4


def copy2d_words(total: int) -> int:
    """The most words the 2D copies of a job of ``total`` blocks take (a run has at
    least :data:`COPY2D_ROWS` rows and never crosses a piece)."""
    return COPY2D_WORDS * (total // COPY2D_ROWS)


#: a packed staging row's pitch is a multiple of this (the block-copy kernels move
#: aligned words, and the copy engines prefer aligned rows)
ROW_ALIGN = 256


def job_rows(ctx: LaunchContext, plan: DevicePlan, staging: StagingBuffers) -> tuple[int, int]:
    """``(rows per staging buffer, row pitch)`` for ``plan``. A job that moves a part
    of each block (some layers) packs the parts into rows of their own size, so a
    piece holds many more blocks than slot-shaped rows would (fewer pieces, each
    DMA longer); whole blocks, or parts of different sizes, take slot-shaped rows."""
    slot_bytes = ctx.layout.slot_bytes
    if plan.parts is None:
        return staging.rows, slot_bytes
    spans = {ctx.tables.spans[plan.parts[m.group]][1] for m in plan.groups}
    if len(spans) != 1:
        return staging.rows, slot_bytes
    pitch = -(-spans.pop() // ROW_ALIGN) * ROW_ALIGN
    return staging.rows_of(min(pitch, slot_bytes))[0], min(pitch, slot_bytes)


def stream_set_header(
    ctx: LaunchContext,
    staging: StagingBuffers,
    streams: tuple[int, int, int],
    batch_template: int,
) -> StagedHeader:
    """The planner's header with a stream set's facts filled in: ``streams`` is the SM
    stream and the two DMA streams, as the launch names them (driver handles for the
    native launch, stream indices for the Python one); the job's fields are set per job."""
    tier = ctx.tier
    return StagedHeader(
        store=ctx.store,
        sm_stream=streams[0],
        dma_streams=streams[1:],
        buffers=len(staging.buffers),
        rows=staging.rows,
        row_bytes=ctx.layout.slot_bytes,
        batch_template=batch_template,
        buffer_addresses=staging.addresses_at,
        tier_base=ctx.tier_base,
        slot_bytes=tier.slot_bytes,
        factor=tier.factor,
        block_stride=tier.block_stride,
        copy2d_rows=COPY2D_ROWS,
    )


@dataclass
class _PythonSet:
    """The planner's facts for a Python launch, whatever the job."""

    header: StagedHeader
    batch: Any  # the batch op template
    # per region table (DeviceTables' index): bytes per block, launch template's
    # address, where the bytes start in a tier slot
    groups: list[tuple[int, int, int]]
    templates: list[Any]  # kept alive with their addresses
    buffer_index: dict[int, int]  # a staging buffer's address -> its index

    def entry(self, ctx: LaunchContext, table: int) -> tuple[int, int, int]:
        """A region table's words of the planner's tail (a part's made on first use):
        the launch template names the table in its function word."""
        while len(self.groups) <= table:
            t = len(self.groups)
            template = np.zeros(_LAUNCH_WORDS, dtype=np.int64)
            template[:2] = (OP_LAUNCH, t)
            template[LAUNCH_STREAM] = _SM
            template[LAUNCH_NPARAMS] = _LAUNCH_WORDS - LAUNCH_PARAMS
            self.templates.append(template)
            start, size = ctx.tables.spans[t]
            self.groups.append((size, template.ctypes.data, start))
        return self.groups[table]


def _python_set(ctx: LaunchContext, staging: StagingBuffers) -> _PythonSet:
    found: _PythonSet | None = ctx.native_sets.get("python")
    if found is not None:
        return found
    # one descriptor per batch op call: memcpy_batch cuts its own driver calls
    batch = np.array([OP_BATCH, 0, 0, 0, 0, 0, 1, 0, 0], dtype=np.int64)
    header = stream_set_header(ctx, staging, (_SM, _DMA0, _DMA1), batch.ctypes.data)
    header.device_ids = 0  # the launch ops' id words are then byte offsets into the job's ids
    index = {a: b for b, a in enumerate(staging.addresses)}
    found = ctx.native_sets["python"] = _PythonSet(header, batch, [], [], index)
    return found


def enqueue_staged(
    ctx: LaunchContext, order: JobOrder, plan: DevicePlan, sm: Any, dmas: tuple[Any, Any]
) -> None:
    """Plan a staged job with the native planner and make its calls on the runtime."""
    staging, planner, ops = ctx.staging, ctx.planner, ctx.ops
    if staging is None or planner is None:  # pragma: no cover - guarded at construction
        raise ConfigError("no staging memory or no staged planner")
    ops.wait_event(sm, plan.ready)
    order.after_last_effect(ops, dmas if ctx.store else (sm,))
    sizes_n = [int(m.cache_ids.shape[0]) for m in plan.groups]
    total = sum(sizes_n)
    rows, pitch = job_rows(ctx, plan, staging)
    pieces = sum(-(-n // rows) for n in sizes_n)
    buffer = gather(ctx, plan, total)
    events = ctx.resources.staged_events(max(2 * pieces, 1))
    plan.events.extend(events)
    if pieces:
        found = _python_set(ctx, staging)
        objects = [None, *(e for e in staging.free if e is not None), *events]
        handles, k = [], 1
        for e in staging.free:
            k += e is not None
            handles.append(k - 1 if e is not None else 0)
        header = found.header
        header.slots = ctx.slots.at
        header.host_ids = buffer.host.ctypes.data
        header.next_buffer = staging.next
        header.pieces_before = order.pieces
        header.groups = len(plan.groups)
        header.rows, header.row_bytes = rows, pitch
        tail = handles
        parts = plan.parts
        for m, n in zip(plan.groups, sizes_n, strict=True):
            tail += (n, *found.entry(ctx, m.group if parts is None else parts[m.group]))
        tail += range(k, k + len(events))
        planner.begin()
        # a piece: at most two waits and two records (3 words each), a batch, a launch
        piece_words = 4 * 3 + BATCH_WORDS + _LAUNCH_WORDS
        planner.build_staged(header, tail, piece_words * pieces + copy2d_words(total), 3 * total)
    ids = ops.upload_ids(sm, buffer, total)
    if not pieces:
        empty_job(ctx, order, plan, sm, dmas, events[0])
        return
    # the state first, as the native launch leaves it before its program runs (a
    # failing call then leaves both paths alike)
    index = found.buffer_index
    leave_state(ctx, order, plan, (sm, dmas), staging, events, pieces)
    _issue(ctx, planner, (sm, *dmas), objects, ids, staging.rows_of(pitch)[1], index)


def _issue(
    ctx: LaunchContext,
    planner: StagedPlanner,
    streams: tuple[Any, ...],
    objects: list[Any],
    ids: Any,
    rows: list[Any],
    buffer_index: dict[int, int],
) -> None:
    """Make the planned ops' calls on the runtime, in order (``rows``: each staging
    buffer as the job's rows)."""
    ops, direction, tables = ctx.ops, ctx.direction, ctx.tables
    words = planner.words.tolist()
    desc = planner.descriptor_array
    at, n = 0, len(words)
    while at < n:
        code = words[at]
        if code == OP_WAIT:
            ops.wait_event(streams[words[at + 1] - 1], objects[words[at + 2]])
            at += 3
        elif code == OP_RECORD:
            ops.record(objects[words[at + 1]], streams[words[at + 2] - 1])
            at += 3
        elif code == OP_BATCH:
            _, stream, d, s, z, count = words[at : at + 6]  # (BATCH_STREAM to BATCH_COUNT)
            batch = (desc[d : d + count], desc[s : s + count], desc[z : z + count])
            ops.memcpy_batch(streams[stream - 1], *batch, direction)
            at += BATCH_WORDS
        elif code == OP_COPY2D:
            _, stream, dst, src, width, height, dst_pitch, src_pitch = words[at : at + 8]
            pitches = (dst_pitch, src_pitch)
            ops.memcpy_2d(streams[stream - 1], dst, src, width, height, pitches, direction)
            at += COPY2D_WORDS
        else:  # OP_LAUNCH: the region table, the block count, the ids' offset, the buffer
            group, count = words[at + 1], words[at + LAUNCH_GRID_X]
            first, address = words[at + LAUNCH_IDS] // 8, words[at + LAUNCH_SLOT_BASE]
            piece_ids = ids[first : first + count] if count != ids.shape[0] else ids
            b = buffer_index[address + tables.spans[group][0]]  # see DeviceTables.part
            copy = tables.block_copy(group, piece_ids, None, count, address, rows[b])
            ops.copy_blocks(streams[words[at + LAUNCH_STREAM] - 1], copy)
            at += _LAUNCH_WORDS
