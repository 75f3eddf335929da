"""The ``staged`` strategy with the native launch: the planner
(``oe_staged_build``) writes the job's pieces straight into the launch program,
with the driver's stream and event handles, and the program issues them with
the rest of the job's calls in one native call. Python only gathers the job's
cache ids (into the id buffer) and tier slots, fills the planner's
:class:`StagedHeader`, and keeps the jobs' state
(:func:`~offload_engine.device.staged.leave_state`).

The header's stream-set fields, the batch op template and each group's launch
op template are made once per stream set (:class:`NativeStreamSet`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from offload_engine.device.plan import DevicePlan
from offload_engine.device.pools import StagingBuffers
from offload_engine.device.runtimes._native import StagedHeader
from offload_engine.device.staged import (
    copy2d_words,
    empty_job,
    gather,
    job_rows,
    leave_state,
    stream_set_header,
)

if TYPE_CHECKING:
    from offload_engine.device.context import JobOrder, LaunchContext

#: the most words one piece's ops take besides its launch: at most two waits and
#: two records (3 words each) and a batch
_PIECE_WORDS = 4 * 3


@dataclass
class NativeStreamSet:
    """What the planner needs of one stream set, whatever the job."""

    header: StagedHeader  # its stream-set fields filled in
    # per (region table, row pitch): bytes per block, launch template's address,
    # where the bytes start in a tier slot
    groups: dict[tuple[int, int], tuple[int, int, int]]
    piece_words: int  # the most words a piece's ops take
    templates: list[Any]  # the op templates, kept alive with their addresses
    program: Any
    sm: Any
    staging: StagingBuffers

    def entry(self, ctx: LaunchContext, table: int, pitch: int) -> tuple[int, int, int]:
        """A region table's words of the planner's tail for staging rows of ``pitch``
        bytes, its launch template made on first use (a part's table is made after
        the stream set, and the kernel's row pitch is in the template)."""
        found = self.groups.get((table, pitch))
        if found is None:
            ids = torch.zeros(1, dtype=torch.int64)  # a placeholder: each piece sets its own
            staging = self.staging
            view = staging.rows_of(pitch)[1][0]
            template = ctx.tables.block_copy(table, ids, None, 1, staging.addresses[0], view)
            words = self.program.launch_row(template, self.sm)
            self.templates.append(words)
            start, size = ctx.tables.spans[table]
            found = self.groups[(table, pitch)] = (size, words.ctypes.data, start)
        return found


def native_stream_set(
    ctx: LaunchContext, program: Any, sm: Any, dmas: tuple[Any, Any], staging: StagingBuffers
) -> NativeStreamSet:
    """The stream set's planner facts, made on first use."""
    found: NativeStreamSet | None = ctx.native_sets.get(id(sm))
    if found is not None:
        return found
    rt = ctx.runtime
    batch = program.batch_row(ctx.direction)
    streams = (rt.stream_handle(sm), rt.stream_handle(dmas[0]), rt.stream_handle(dmas[1]))
    header = stream_set_header(ctx, staging, streams, batch.ctypes.data)
    found = NativeStreamSet(header, {}, 0, [batch], program, sm, staging)
    for g in range(len(ctx.layout.groups)):
        found.entry(ctx, g, ctx.layout.slot_bytes)
    # a part's template has the same words as its group's (the same kernel)
    found.piece_words = _PIECE_WORDS + len(batch) + max(len(t) for t in found.templates[1:])
    ctx.native_sets[id(sm)] = found
    return found


def enqueue_staged_native(
    ctx: LaunchContext,
    order: JobOrder,
    plan: DevicePlan,
    sm: Any,
    dmas: tuple[Any, Any],
    staging: StagingBuffers,
    program: Any,
) -> None:
    """:func:`offload_engine.device.staged.enqueue_staged`'s calls, planned natively."""
    store = ctx.store
    program.wait_event(sm, plan.ready)
    order.after_last_effect(program, dmas if store else (sm,))
    groups = plan.groups
    sizes_n = [int(m.cache_ids.shape[0]) for m in groups]
    total = sum(sizes_n)
    rows, pitch = job_rows(ctx, plan, staging)
    pieces = sum(-(-n // rows) for n in sizes_n)
    buffer = gather(ctx, plan, total)
    ids_device = program.upload_ids_at(sm, buffer, total)
    events = ctx.resources.staged_events(max(2 * pieces, 1))
    plan.events.extend(events)
    if pieces == 0:
        empty_job(ctx, order, plan, sm, dmas, events[0])
        return
    found = native_stream_set(ctx, program, sm, dmas, staging)
    header = found.header
    header.slots = ctx.slots.at
    header.host_ids = program.host_ids_at(buffer)
    header.device_ids = ids_device
    header.next_buffer = staging.next
    header.pieces_before = order.pieces
    header.groups = len(groups)
    header.rows, header.row_bytes = rows, pitch
    handle = ctx.runtime.event_handle
    tail = [0 if e is None else handle(e) for e in staging.free]
    parts = plan.parts
    for m, n in zip(groups, sizes_n, strict=True):
        tail += (n, *found.entry(ctx, m.group if parts is None else parts[m.group], pitch))
    tail += [handle(e) for e in events]
    program.build_staged(header, tail, found.piece_words * pieces + copy2d_words(total), 3 * total)
    leave_state(ctx, order, plan, (sm, dmas), staging, events, pieces)
