"""What a device handler makes once and hands to its jobs in turn: stream sets,
staging buffers, events and id buffers, and the KV regions' tables on the device."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from offload_engine.device.runtimes.base import BlockCopy, DeviceRuntime, IdBuffer
from offload_engine.host import KVLayout
from offload_engine.vocabulary import Direction

if TYPE_CHECKING:
    from offload_engine.device.plan import DevicePlan


def stream_sets(runtime: DeviceRuntime, count: int) -> list[tuple[Any, tuple[Any, Any]]]:
    """``count`` (SM stream, two DMA streams) sets. Device-side copies go on a
    high-priority stream so that a concurrent GEMM does not hold them (and the DMA
    behind them) up; staged pieces alternate between the DMA streams, which keeps
    the copy engines busy across the per-copy setup of scattered slots."""
    return [
        (runtime.new_stream(priority=-1), (runtime.new_stream(), runtime.new_stream()))
        for _ in range(count)
    ]


class StagingBuffers:
    """``count`` device buffers of ``rows`` tier-slot-shaped rows, used in turn.

    ``free[b]`` is the event after which buffer ``b`` may be refilled (the end
    of the last piece that used it), or ``None`` before its first use. With
    ``device`` the buffers live in that peer device's memory (a borrowed link's).
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        count: int,
        rows: int,
        slot_bytes: int,
        *,
        device: int | None = None,
    ) -> None:
        self.rows = rows
        nbytes = rows * slot_bytes
        if device is None:
            self.buffers = [runtime.alloc_device(nbytes) for _ in range(count)]
        else:
            self.buffers = [runtime.alloc_device_on(device, nbytes) for _ in range(count)]
        self.free: list[Any] = [None] * count
        self.next = 0
        # per buffer, computed once: its address and its (rows, slot_bytes) view
        # (for block copies)
        self.addresses = [b.data_ptr() for b in self.buffers]
        self._address_array = np.array(self.addresses, dtype=np.int64)  # for the native planner
        self.addresses_at = self._address_array.ctypes.data
        self.views = [b.view(-1, slot_bytes) for b in self.buffers]
        self.slot_bytes = slot_bytes
        self._pitched: dict[int, tuple[int, list[Any]]] = {slot_bytes: (rows, self.views)}

    def rows_of(self, pitch: int) -> tuple[int, list[Any]]:
        """How many rows of ``pitch`` bytes a buffer holds, and each buffer as such
        rows (cached): a job that moves a part of each block packs its parts."""
        found = self._pitched.get(pitch)
        if found is None:
            rows = self.rows * self.slot_bytes // pitch
            views = [b[: rows * pitch].view(rows, pitch) for b in self.buffers]
            found = self._pitched[pitch] = (rows, views)
        return found


class JobResources:
    """Events and id buffers, handed to jobs and taken back when they are done.

    Events are made ahead (at start) rather than at a submit (the caller's thread)
    or a launch. Both lists are shared by the submitting thread (``event``), the
    launching threads and the reporting threads (``recycle``): every access holds
    ``_lock``.
    """

    def __init__(self, runtime: DeviceRuntime, keep_id_buffers: int) -> None:
        self._runtime = runtime
        self.keep = keep_id_buffers
        self._events: list[Any] = []
        self._id_buffers: list[IdBuffer] = []
        self._lock = threading.Lock()
        # bytes of the jobs handed back so far: with the bytes launched, the
        # handler's backlog (read without the lock: a stale value only delays
        # the auto policy's view by a job)
        self.finished_bytes = 0

    def add_events(self, count: int) -> None:
        made = [self._runtime.new_event() for _ in range(count)]
        with self._lock:
            self._events.extend(made)

    def event(self) -> Any:
        with self._lock:
            if self._events:
                return self._events.pop()
        return self._runtime.new_event()

    def events(self, count: int) -> list[Any]:
        """``count`` pooled events with one lock (a staged job takes two per piece)."""
        with self._lock:
            pool = self._events
            taken = pool[-count:] if count else []
            del pool[len(pool) - len(taken) :]
        while len(taken) < count:
            taken.append(self._runtime.new_event())
        return taken

    #: a staged job's events, ``max(2 * pieces, 1)`` of them: per piece, the event of
    #: its first half (a store's gather, a load's DMA) and of its second half; a job
    #: of no pieces takes one, recorded on a second half's stream. Here any of the
    #: pool's, every stream being this device's (:class:`PathResources`: not so)
    staged_events = events

    def id_buffer(self, plan: DevicePlan, total: int) -> IdBuffer:
        """A reused id buffer for ``total`` ids (no allocation per job), the plan's
        until the job is done."""
        buffer = None
        with self._lock:
            for i, candidate in enumerate(self._id_buffers):
                if candidate.capacity >= total:
                    buffer = self._id_buffers.pop(i)
                    break
        if buffer is None:
            buffer = self._runtime.new_id_buffer(max(64, 1 << max(total - 1, 0).bit_length()))
        plan.ids = buffer
        return buffer

    def recycle(self, plan: DevicePlan) -> None:
        # Safe to reuse once the job is done: a later wait on a recycled event
        # captured its record when it was enqueued, and a re-record only adds a
        # wait on already-enqueued work, never a cycle. The id buffer's upload and
        # every kernel that read it are done too.
        with self._lock:
            self.finished_bytes += plan.nbytes
            self._events.extend(plan.events)
            if plan.ids is not None and len(self._id_buffers) <= self.keep:
                self._id_buffers.append(plan.ids)
        plan.ids = None
        parts, plan.peer_parts = plan.peer_parts, []
        for pools, part in parts:  # a split job's peer parts, to their paths' pools
            pools.recycle(part)

    def clear(self) -> None:
        with self._lock:
            self._id_buffers.clear()


class PathResources(JobResources):
    """A borrowed link's events and id buffers (``device.multipath``): a staged
    part's two halves run on streams of two devices (the gather or scatter on this
    device, the DMAs on a peer), and an event may be recorded only on a stream of
    the device it was made on. So each half takes its events from a pool of its
    own: ``first`` and ``second`` make the events of a piece's first and second
    halves (``runtime.new_event``, or ``runtime.new_event_on`` of the peer)."""

    def __init__(
        self,
        runtime: DeviceRuntime,
        keep_id_buffers: int,
        *,
        first: Callable[[], Any],
        second: Callable[[], Any],
    ) -> None:
        super().__init__(runtime, keep_id_buffers)
        self._makers = (first, second)
        self._pools: tuple[list[Any], list[Any]] = ([], [])
        # which pool an event goes back to (an event's identity: both pools' events
        # live as long as the path, so no identity is reused while one is out)
        self._second_ids: set[int] = set()

    def _make(self, half: int, count: int) -> list[Any]:
        made = [self._makers[half]() for _ in range(count)]
        if half:
            with self._lock:
                self._second_ids.update(id(e) for e in made)
        return made

    def add_events(self, count: int) -> None:
        """``count`` events for each half."""
        made = (self._make(0, count), self._make(1, count))
        with self._lock:
            for pool, events in zip(self._pools, made, strict=True):
                pool.extend(events)

    def _take(self, half: int, count: int) -> list[Any]:
        with self._lock:
            pool = self._pools[half]
            taken = pool[max(len(pool) - count, 0) :] if count else []
            del pool[len(pool) - len(taken) :]
        return taken + (self._make(half, count - len(taken)) if len(taken) < count else [])

    def staged_events(self, count: int) -> list[Any]:  # type: ignore[override]
        """As :attr:`JobResources.staged_events`, each from its half's pool."""
        firsts, seconds = self._take(0, count // 2), self._take(1, count - count // 2)
        taken = [e for pair in zip(firsts, seconds, strict=False) for e in pair]
        return taken + seconds[len(firsts) :]

    def event(self) -> Any:
        raise TypeError("a borrowed link's events are per half: use staged_events")

    def events(self, count: int) -> list[Any]:
        raise TypeError("a borrowed link's events are per half: use staged_events")

    def _give_back(self, events: list[Any]) -> None:
        second = self._second_ids
        with self._lock:
            for e in events:
                self._pools[id(e) in second].append(e)

    def recycle(self, plan: DevicePlan) -> None:
        events, plan.events = plan.events, []
        self._give_back(events)
        super().recycle(plan)


class DeviceTables:
    """Each KV group's region tables on the device (uploaded once) and as torch byte
    views, from which a job's device-side block copies are made."""

    def __init__(
        self, runtime: DeviceRuntime, layout: KVLayout, direction: Direction, stream: Any
    ) -> None:
        self._layout = layout
        self._direction = direction
        self.tables: list[tuple[Any, Any, Any, Any, int]] = []
        for g in range(len(layout.groups)):
            tables = layout.region_tables(g)
            arrays = (tables.base, tables.stride, tables.size, tables.slot_offset)
            base, stride, size, offset = (runtime.upload(stream, a.view(np.int64)) for a in arrays)
            self.tables.append((base, stride, size, offset, int(tables.size.max())))
        # the same regions as torch byte views, for runtimes that copy with torch ops
        self.views = [layout.region_views(g) for g in range(len(layout.groups))]
        self.slot_offsets: list[tuple[int, ...]] = list(layout.slot_offsets)
        # per table: where its bytes start in a tier slot and how many there are
        self.spans: list[tuple[int, int]] = [(0, b) for b in layout.group_bytes]
        self._parts: dict[tuple[int, tuple[int, ...]], int | None] = {}
        self._lock = threading.Lock()

    def part(self, group: int, regions: tuple[int, ...]) -> int | None:
        """A table for a run of ``group``'s regions (a job with ``TransferSpec.tensors``
        of consecutive layers), which lie back to back in the group's tier slot: its
        index for :meth:`block_copy` and :attr:`spans`, or None for regions that are
        not a run. The device tables are slices of the group's (nothing is uploaded);
        their slot offsets still count from the slot's start, so a launch of this
        table puts its slot base :attr:`spans`' start bytes before the staging row,
        where the span's bytes are. The torch views' offsets count from the row."""
        key = (group, regions)
        with self._lock:
            if key in self._parts:
                return self._parts[key]
            first = regions[0]
            if regions != tuple(range(first, first + len(regions))):
                self._parts[key] = None
                return None
            end = first + len(regions)
            base, stride, size, offset, _ = self.tables[group]
            picked = (base[first:end], stride[first:end], size[first:end], offset[first:end])
            sizes = [self._layout.groups[group][i].size for i in regions]
            self.tables.append((*picked, max(sizes)))
            self.views.append(self.views[group][first:end])
            start = self._layout.slot_offsets[group][first]
            self.slot_offsets.append(tuple(o - start for o in self.slot_offsets[group][first:end]))
            self.spans.append((start, sum(sizes)))
            index = self._parts[key] = len(self.tables) - 1
            return index

    def block_copy(
        self,
        group: int,
        ids: torch.Tensor,
        slot_ids: torch.Tensor | None,
        count: int,
        slot_base: int,
        slot_view: torch.Tensor,
    ) -> BlockCopy:
        """A copy of ``count`` blocks of the group between the cache and slot rows: a
        staging buffer filled in order (``slot_ids`` None) or the tier itself."""
        base, stride, size, offset, max_size = self.tables[group]
        return BlockCopy(
            region_base=base,
            region_stride=stride,
            region_size=size,
            slot_offset=offset,
            max_region_size=max_size,
            cache_ids=ids,
            slot_ids=slot_ids,
            count=count,
            slot_base=slot_base,
            slot_bytes=slot_view.stride(0),  # the row pitch: a strided tier's too
            direction=self._direction,
            cache_views=self.views[group],
            slot_view=slot_view,
            slot_offsets=self.slot_offsets[group],
        )
