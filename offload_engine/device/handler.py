"""Device handler: KV cache on an accelerator <-> host tier, on any runtime.

One class serves one direction: a **store** handler for ``(device, CPU)`` and a
**load** handler for ``(CPU, device)``; :func:`make_device_handlers` builds the
pair over one layout and one tier, :func:`pinned_host_tier` the tier. The
runtime (CUDA, NPU, fake) supplies streams, events and copies; this module
holds the logic they share. A job is copied by one :class:`CopyStrategy`,
chosen per job (``AUTO``) or forced: ``DMA`` (merged batched copy
descriptors), ``STAGED`` (gather on the device into slot-shaped staging, then
DMA whole slots; double-buffered) or ``KERNEL`` (an SM copy to mapped pinned
memory).

At submit, :meth:`DeviceCopyHandler.prepare` records an event on the caller's
current stream and the job's first operation waits on it. ``launch`` only
queues the job: a launcher thread enqueues the device work and a watcher
thread sleeps on the job's events and reports (with ``polled_completion``, the
caller's ``get_finished`` queries them instead, and the watcher only serves
callers that wait). Device-side copies ask for a
high-priority stream; runtimes without stream priorities (NPU) ignore it.
``docs/cuda.md`` explains the strategies, the stream sets, what keeps a small
job's launch cheap, and the measurements behind them.
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from offload_engine._checks import check_int, check_seconds
from offload_engine._loop import ThreadSignal, join_threads
from offload_engine.device.runtimes._native import LaunchProgram
from offload_engine.device.runtimes.base import BlockCopy, DeviceRuntime, IdBuffer
from offload_engine.engine.handler import HandlerContext, LaunchedJob, TransferHandler
from offload_engine.errors import (
    ConfigError,
    LayoutError,
    RuntimeUnavailableError,
)
from offload_engine.host.layout import (
    GroupMapping,
    KVLayout,
    chunk_descriptors,
    merge_runs,
)
from offload_engine.host.tier import HostTier, map_transfer
from offload_engine.vocabulary import (
    Direction,
    Medium,
    TransferSpec,
)

_STOP = object()
log = logging.getLogger("offload_engine.device")
#: ``DeviceHandlerConfig.native_launch`` unless given (docs/performance.md, stepperf6)
NATIVE_LAUNCH_DEFAULT: bool | Literal["auto"] = "auto"


class CopyStrategy(enum.Enum):
    AUTO = "auto"
    DMA = "dma"
    STAGED = "staged"
    KERNEL = "kernel"


@dataclass(frozen=True)
class DeviceHandlerConfig:
    """Tuning of a device handler; every field is validated at construction.

    ``staging_bytes`` is the device memory for the staged strategy, split in
    ``staging_buffers`` buffers (0 bytes disables it): with more buffers, more
    pieces can be gathered ahead of the copy engine, which hides gathers that
    wait for SMs a concurrent GEMM holds. ``dma_min_chunk_bytes``: ``AUTO`` picks
    ``dma`` when every region of a block is at least this large, else
    ``staged`` when there is staging memory. ``streams``: stream sets jobs
    rotate over (``None``: one with a batched copy API, four without).
    ``max_inflight``: jobs launched and not yet finished.
    ``close_timeout``: how long close waits for device work already abandoned
    by the engine before reporting the device broken.
    ``inline_launch_blocks``: a job of at most this many blocks (``dma``: block
    regions, one copy descriptor each) is put on the streams by the engine's
    loop thread when the launcher thread has nothing pending, which spares the
    launcher's wake-up; larger jobs, and jobs behind them, go through the
    launcher thread. 0 sends every job through the launcher thread, as does a
    runtime whose launches may wait (``nonblocking_launch`` false: NPU).
    ``submitter_launch``: such small jobs are launched by the thread that
    submits them when nothing is queued before them, sparing the loop's wake-up
    too: the least CPU per job in all, but the submitter pays the launch (a CUDA
    graph step then starts later; see docs/performance.md).
    ``polled_completion``: a finished job is found by the caller's own poll (the
    engine's ``get_finished``), one event query per stream the job used, and
    reported there, without waking the watcher thread; the watcher reports
    only while someone waits (a ``wait``, close, a full queue, a deadline).
    With ``submitter_launch`` too, a small job wakes no other thread at all.
    ``native_launch``: a job's driver calls are recorded and issued by one
    native call that releases the GIL (:mod:`offload_engine.device.runtimes._native`;
    CUDA with the NVRTC kernel and a C compiler). ``"auto"`` uses it where the
    runtime has it and keeps the Python calls elsewhere (logged); ``True``
    refuses a runtime without it; ``False`` always calls from Python.
    """

    strategy: CopyStrategy = CopyStrategy.AUTO
    staging_bytes: int = 256 << 20
    staging_buffers: int = 2
    dma_min_chunk_bytes: int = 512 << 10
    streams: int | None = None
    max_inflight: int = 16
    close_timeout: float = 30.0
    inline_launch_blocks: int = 64
    submitter_launch: bool = False
    polled_completion: bool = False
    native_launch: bool | Literal["auto"] = NATIVE_LAUNCH_DEFAULT

    def __post_init__(self) -> None:
        if not (isinstance(self.native_launch, bool) or self.native_launch == "auto"):
            raise ConfigError(
                f"native_launch must be 'auto', True or False, got {self.native_launch!r}"
            )
        for key in ("submitter_launch", "polled_completion"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be a bool, got {getattr(self, key)!r}")
        if not isinstance(self.strategy, CopyStrategy):
            raise ConfigError(f"strategy must be a CopyStrategy, got {self.strategy!r}")
        for key in ("staging_bytes", "dma_min_chunk_bytes", "inline_launch_blocks"):
            value = getattr(self, key)
            check_int(value, key, minimum=0)
        if self.streams is not None:
            check_int(self.streams, "streams (or None)")
        for key in ("max_inflight", "staging_buffers"):
            check_int(getattr(self, key), key)
        if self.staging_buffers < 2:
            raise ConfigError(f"staging_buffers must be at least 2, got {self.staging_buffers}")
        check_seconds(self.close_timeout, "close_timeout")


@dataclass
class DevicePlan:
    """A job planned at submit."""

    groups: list[GroupMapping]
    nbytes: int
    strategy: CopyStrategy
    ready: Any  # event recorded on the submitter's current stream
    events: list[Any] = field(default_factory=list)  # handed back to the pool when done
    # one event at the end of each stream the job used; the watcher checks them all,
    # since a device error surfaces at the next event recorded on its own stream
    checks: list[Any] = field(default_factory=list)
    ids: IdBuffer | None = None  # the job's block ids on their way up; reused when done
    # what the launch costs: blocks moved (every group together), or for dma the
    # copy descriptors before merging (blocks x regions)
    units: int = 0


class _Staging:
    """``count`` device buffers of ``rows`` tier-slot-shaped rows, used in turn.

    ``free[b]`` is the event after which buffer ``b`` may be refilled (the end
    of the last piece that used it), or ``None`` before its first use.
    """

    def __init__(self, runtime: DeviceRuntime, count: int, rows: int, slot_bytes: int) -> None:
        self.rows = rows
        self.buffers = [runtime.alloc_device(rows * slot_bytes) for _ in range(count)]
        self.free: list[Any] = [None] * count
        self.next = 0
        # per buffer, computed once: its rows' addresses (for slot descriptors), its
        # address and its (rows, slot_bytes) view (for block copies)
        offsets = np.arange(rows, dtype=np.uint64) * np.uint64(slot_bytes)
        self.row_addresses = [np.uint64(b.data_ptr()) + offsets for b in self.buffers]
        self.addresses = [b.data_ptr() for b in self.buffers]
        self._address_array = np.array(self.addresses, dtype=np.int64)  # for the native planner
        self.addresses_at = self._address_array.ctypes.data
        self.views = [b.view(-1, slot_bytes) for b in self.buffers]

    def take(self) -> int:
        b = self.next
        self.next = (b + 1) % len(self.buffers)
        return b


class DeviceCopyHandler(TransferHandler[DevicePlan]):
    """Moves blocks between a device KV cache and a pinned host tier, one direction."""

    def __init__(
        self,
        runtime: DeviceRuntime,
        layout: KVLayout,
        tier: HostTier,
        *,
        direction: Direction,
        config: DeviceHandlerConfig | None = None,
    ) -> None:
        for value, cls, what in (
            (runtime, DeviceRuntime, "runtime"),
            (layout, KVLayout, "layout"),
            (tier, HostTier, "tier"),
        ):
            if not isinstance(value, cls):
                raise TypeError(f"{what} must be a {cls.__name__}, got {type(value).__name__}")
        if config is not None and not isinstance(config, DeviceHandlerConfig):
            raise TypeError(f"config must be a DeviceHandlerConfig, got {type(config).__name__}")
        config = config or DeviceHandlerConfig()
        if direction not in (Direction.STORE, Direction.LOAD):
            raise ConfigError(f"a device handler stores or loads, got {direction}")
        for i, t in enumerate(layout.tensors):
            if not runtime.is_device_tensor(t):
                raise LayoutError(
                    f"KV tensor {i} (shape {tuple(t.shape)}, {t.dtype}) is on {t.device}, not in "
                    f"{runtime.name} device memory"
                )
        if tier.memory.dtype.itemsize != 1:
            raise LayoutError(f"tier memory must be bytes, got {tier.memory.dtype}")
        if not runtime.is_pinned(tier.span):
            raise LayoutError(
                "the host tier is not pinned: DMA needs registered host memory "
                "(build it with pinned_host_tier)"
            )
        tier.check_layout(layout)
        self.runtime = runtime
        self.layout = layout
        self.tier = tier
        self.config = config
        self.direction = direction
        store = direction is Direction.STORE
        self._store = store  # the direction, as a flag for the per-job branches
        self.src, self.dst = (runtime.medium, Medium.CPU) if store else (Medium.CPU, runtime.medium)
        self.ordered = True
        self.max_inflight = config.max_inflight
        # small jobs launch on the thread that hands them over (see launch): the
        # engine's loop, or with submitter_launch the submitting thread
        self._inline_units = config.inline_launch_blocks if runtime.nonblocking_launch else 0
        self.launch_in_submitter = config.submitter_launch and self._inline_units > 0
        if config.polled_completion and type(runtime).query is DeviceRuntime.query:
            raise ConfigError(
                f"polled_completion needs a non-blocking event query, and the "
                f"{type(runtime).__name__} runtime has none (DeviceRuntime.query)"
            )
        self.polled_completion = config.polled_completion
        # polled completion: launched jobs nobody reported yet, in launch order,
        # and how many callers wait (while any do, jobs go to the watcher instead)
        self._polled: collections.deque[LaunchedJob[DevicePlan]] = collections.deque()
        self._watchers = 0
        self._poll_lock = threading.Lock()
        align = runtime.block_copy_alignment
        aligned = (
            all(v % align == 0 for t in [*layout.tensors, tier.span] for v in (t.data_ptr(),))
            and all(
                v % align == 0
                for g in layout.groups
                for r in g
                for v in (r.offset, r.stride, r.size)
            )
            and tier.slot_bytes % align == 0
            and tier.block_stride % align == 0
        )
        block_copies = runtime.supports_block_copy and aligned
        rows = (
            config.staging_bytes // config.staging_buffers // layout.slot_bytes
            if config.staging_bytes and block_copies
            else 0
        )
        if config.strategy is CopyStrategy.STAGED and rows < 1:
            raise ConfigError(
                f"the staged strategy needs block copies on the {runtime.name} runtime with "
                f"{align}-byte aligned regions, and staging_bytes >= {config.staging_buffers} x "
                f"{layout.slot_bytes} (one block per buffer); got {config.staging_bytes}"
            )
        if config.strategy is CopyStrategy.KERNEL and not (
            runtime.supports_kernel_strategy and aligned and tier.slot_pitch is not None
        ):
            raise ConfigError(
                f"the kernel strategy needs a {runtime.name} copy kernel, {align}-byte aligned "
                "regions and tier slots, and evenly spaced tier slots (a tier with gaps between "
                f"its blocks of {tier.factor} slots has none: use dma or staged)"
            )
        self._stage_rows = rows
        self._regions = [len(g) for g in layout.groups]
        min_region = min(r.size for g in layout.groups for r in g)
        self._auto = (
            CopyStrategy.DMA
            if min_region >= config.dma_min_chunk_bytes or rows < 1
            else CopyStrategy.STAGED
        )
        # the native launch: a program that records the launch's calls (None: they go
        # to the runtime one by one); native_note says why it is not used
        self._native: LaunchProgram | None = None
        self.native_note: str | None = None
        if config.native_launch is not False:
            try:
                self._native = runtime.native_program()
            except RuntimeUnavailableError as exc:
                if config.native_launch is True:
                    raise ConfigError(f"native_launch is True, but {exc}") from None
                self.native_note = str(exc)
                log.info("%s launches from Python: %s", self.name, exc)
        # what the launch code calls to enqueue work: the program, or the runtime
        self._ops: Any = runtime if self._native is None else self._native
        # what prepare needs per job, fixed here: the strategy, what a launch costs per
        # block of each group (dma: a descriptor per region), the name errors give, and
        # a large common job's checks in one native call (map_transfer)
        self._strategy = config.strategy if config.strategy is not CopyStrategy.AUTO else self._auto
        self._unit_regions = (
            self._regions if self._strategy is CopyStrategy.DMA else [1] * len(self._regions)
        )
        self._who = self.name
        self._check = None if self._native is None else self._native.check_pairs
        self._rows: dict[Any, Any] = {}  # the native launch's op templates (_staged_native)
        # a staged job's tier slots, for the native planner (which makes them addresses)
        self._slots = np.empty(1024, dtype=np.int64)
        self._slots_at = self._slots.ctypes.data
        self._events: list[Any] = []
        self._id_buffers: list[IdBuffer] = []  # guarded by _events_lock
        self._events_lock = threading.Lock()
        self._started = False

    # ------------------------------------------------------------ lifecycle

    def start(self, context: HandlerContext) -> None:
        rt = self.runtime
        # (SM stream, two DMA streams): device-side copies go on a high-priority
        # stream so a concurrent GEMM does not hold them (and the DMA behind them)
        # up; staged pieces alternate between the DMA streams, which keeps the copy
        # engines busy across the per-copy setup of scattered slots
        self._pool = [
            (rt.new_stream(priority=-1), (rt.new_stream(), rt.new_stream()))
            for _ in range(self._stream_sets())
        ]
        self._seq = 0
        self._pieces = 0  # staged pieces so far; their DMAs alternate between two streams
        # the events after which the previous job's writes (its effect) are done,
        # each with the stream it was recorded on (a wait on that stream is implied)
        self._last_effect: list[tuple[Any, Any]] = []
        self._staging = (
            _Staging(rt, self.config.staging_buffers, self._stage_rows, self.layout.slot_bytes)
            if self._stage_rows
            else None
        )
        # region tables on the device, uploaded once
        setup = self._pool[0][0]
        self._tables: list[tuple[Any, Any, Any, Any, int]] = []
        for g in range(len(self.layout.groups)):
            tables = self.layout.region_tables(g)
            arrays = (tables.base, tables.stride, tables.size, tables.slot_offset)
            base, stride, size, offset = (rt.upload(setup, a.view(np.int64)) for a in arrays)
            self._tables.append((base, stride, size, offset, int(tables.size.max())))
        # the same regions as torch byte views, for runtimes that copy with torch ops
        self._views = [self.layout.region_views(g) for g in range(len(self.layout.groups))]
        self._tier_base = self.tier.span.data_ptr()
        # each group's bytes per staging row, as a descriptor size column
        rows = max(self._stage_rows, 1)
        self._used_sizes = [np.full(rows, b, dtype=np.uint64) for b in self.layout.group_bytes]
        # the tier's slot rows (strided by the slot pitch), for the kernel strategy;
        # None where the slots are not evenly spaced, which refuses that strategy
        self._tier_view = self.tier.slot_rows()
        done = rt.new_event()
        rt.record(done, setup)
        rt.synchronize(done)
        # events made now rather than at a submit (the caller's thread) or a launch:
        # a small job uses three or four, and max_inflight jobs are in flight
        self._events.extend(rt.new_event() for _ in range(4 * self.max_inflight))
        # launcher: enqueues each job's device work (driver calls release the GIL, so
        # the store and load handlers' launchers run in parallel, off the event loop);
        # watcher: sleeps on each job's events in order and reports the outcome.
        self._launch_q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._pending = 0  # jobs handed to the launcher thread and not yet enqueued
        self._pending_lock = threading.Lock()
        self._watch_q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._threads_done = ThreadSignal(context.call_soon)
        name = f"offload-engine-{self.runtime.name}-{self.direction.value}"
        self._threads = [
            threading.Thread(target=self._launch_loop, name=f"{name}-launch", daemon=True),
            threading.Thread(target=self._watch_loop, name=f"{name}-watch", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._started = True

    def owns_thread(self, thread: threading.Thread) -> bool:
        return thread in getattr(self, "_threads", ())

    def _stream_sets(self) -> int:
        if self.config.streams is not None:
            return self.config.streams
        return 1 if getattr(self.runtime, "batched", True) else 4

    async def aclose(self) -> None:
        if not self._started:
            return
        self._started = False
        self.watch(1)  # jobs never polled (abandoned at close) are awaited by the watcher
        self._launch_q.put(_STOP)  # the launcher passes it on to the watcher
        await join_threads(
            self._threads,
            self._threads_done,
            self.config.close_timeout,
            f"of {self.name} still waiting on device work (the device may be hung)",
        )
        self._staging = None
        self._views = []
        self._id_buffers.clear()
        self._tables.clear()
        self._pool = []

    # ------------------------------------------------------------ events and id buffers

    def _event(self) -> Any:
        with self._events_lock:
            if self._events:
                return self._events.pop()
        return self.runtime.new_event()

    def _take_events(self, count: int) -> list[Any]:
        """``count`` pooled events with one lock (a staged job takes two per piece)."""
        with self._events_lock:
            pool = self._events
            taken = pool[-count:] if count else []
            del pool[len(pool) - len(taken) :]
        while len(taken) < count:
            taken.append(self.runtime.new_event())
        return taken

    def _after_last_effect(self, streams: tuple[Any, ...]) -> None:
        """Make ``streams`` wait for the previous job's writes (jobs take effect in
        submission order); an event recorded on the stream itself needs no wait."""
        for event, on in self._last_effect:
            for stream in streams:
                if stream is not on:
                    self._ops.wait_event(stream, event)

    def _recycle(self, plan: DevicePlan) -> None:
        # Safe to reuse once the job is done: a later wait on a recycled event
        # captured its record when it was enqueued, and a re-record only adds a
        # wait on already-enqueued work, never a cycle. The id buffer's upload and
        # every kernel that read it are done too.
        with self._events_lock:
            self._events.extend(plan.events)
            if plan.ids is not None and len(self._id_buffers) <= self.max_inflight:
                self._id_buffers.append(plan.ids)
        plan.ids = None

    def _id_buffer(self, plan: DevicePlan, total: int) -> IdBuffer:
        """A reused id buffer for ``total`` ids (no allocation per job), the plan's
        until the job is done."""
        buffer = None
        with self._events_lock:
            for i, candidate in enumerate(self._id_buffers):
                if candidate.capacity >= total:
                    buffer = self._id_buffers.pop(i)
                    break
        if buffer is None:
            buffer = self.runtime.new_id_buffer(max(64, 1 << max(total - 1, 0).bit_length()))
        plan.ids = buffer
        return buffer

    def _upload_ids(self, plan: DevicePlan, stream: Any, arrays: list[Any]) -> list[torch.Tensor]:
        """Put the job's id arrays on the device with one upload, from a buffer the
        handler reuses once the job is done (no allocation per job)."""
        total = sum(int(a.shape[0]) for a in arrays)
        buffer = self._id_buffer(plan, total)
        host = buffer.host
        if len(arrays) == 1:
            host[:total] = arrays[0]
            return [self._ops.upload_ids(stream, buffer, total)]
        at = 0
        for a in arrays:
            host[at : at + a.shape[0]] = a
            at += int(a.shape[0])
        device = self._ops.upload_ids(stream, buffer, total)
        out = []
        at = 0
        for a in arrays:
            out.append(device[at : at + a.shape[0]])
            at += int(a.shape[0])
        return out

    # ------------------------------------------------------------ submit

    def prepare(self, spec: TransferSpec) -> DevicePlan:
        # runs in the caller's thread, often after it sat idle: every step here is
        # cold code, so the fixed facts come from __init__ (docs/performance.md, stepperf8)
        job = map_transfer(
            spec, self.layout, self.tier, who=self._who, expect=self.direction, check=self._check
        )
        ready = self._event()
        self.runtime.record_current(ready)
        groups = job.groups
        if len(groups) == 1:
            units = groups[0].cache_ids.shape[0] * self._unit_regions[0]
        else:
            units = sum(m.cache_ids.shape[0] * self._unit_regions[m.group] for m in groups)
        return DevicePlan(groups, job.nbytes, self._strategy, ready, [ready], units=units)

    # ------------------------------------------------------------ launch

    def launch(self, job: LaunchedJob[DevicePlan]) -> None:
        # A small job goes on the streams right here (the engine's loop thread, or
        # with submitter_launch the submitting thread when nothing was queued) when
        # the launcher thread has nothing pending, so jobs still launch in order; this
        # spares the launcher's wake-up and GIL hand-offs, which cost more than the
        # launch itself. Launch calls never overlap and only they add to ``_pending``,
        # so a zero read here stays zero.
        if self._pending == 0 and 0 < job.prepared.units <= self._inline_units:
            self._launch_one(job)
            return
        with self._pending_lock:
            self._pending += 1
        self._launch_q.put(job)

    def _launch_one(self, job: LaunchedJob[DevicePlan]) -> None:
        try:
            self._enqueue(job.prepared)
        except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
            job.fail(exc)
            self._recycle(job.prepared)
            return
        if self.polled_completion:
            with self._poll_lock:
                if not self._watchers:
                    self._polled.append(job)
                    return
        self._watch_q.put(job)

    # ------------------------------------------------------------ polled completion

    def poll(self) -> None:
        """Report the leading run of finished jobs (event queries, no waiting)."""
        if not self._polled:
            return
        done: list[tuple[LaunchedJob[DevicePlan], BaseException | None]] = []
        query = self.runtime.query
        with self._poll_lock:
            polled = self._polled
            while polled:
                job = polled[0]
                error: BaseException | None = None
                try:
                    if not all(query(event) for event in job.prepared.checks):
                        break
                except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                    error = exc
                polled.popleft()
                done.append((job, error))
        # reported outside the lock (a report takes the engine's lock); the engine
        # delivers an ordered handler's results in launch order whoever reports
        for job, error in done:
            if error is None:
                job.succeed(job.prepared.nbytes)
            else:
                job.fail(error)
            self._recycle(job.prepared)

    def watch(self, delta: int) -> None:
        """While someone waits, the watcher thread reports each job as it finishes."""
        with self._poll_lock:
            self._watchers += delta
            if self._watchers > 0:
                while self._polled:
                    self._watch_q.put(self._polled.popleft())

    def _launch_loop(self) -> None:
        # the SM stream is this thread's current stream throughout, so a kernel
        # launch (which goes on the current stream) needs no stream switch per job
        with self.runtime.launcher_context(self._pool[0][0]):
            while True:
                item = self._launch_q.get()
                if item is _STOP:
                    self._watch_q.put(_STOP)
                    return
                self._launch_one(item)  # type: ignore[arg-type]
                with self._pending_lock:
                    self._pending -= 1

    def _enqueue(self, plan: DevicePlan) -> None:
        """Put one job's work on the streams. Jobs take effect in submission order:
        each job's writes wait for the previous job's writes. With the native launch,
        the calls are recorded and then issued by one native call."""
        native = self._native
        if native is None:
            self._enqueue_calls(plan)
            return
        native.begin()
        self._enqueue_calls(plan)
        native.run()

    def _enqueue_calls(self, plan: DevicePlan) -> None:
        """The job's calls, made on ``self._ops``: the runtime, or the native program."""
        rt = self._ops
        sm, dmas = self._pool[self._seq % len(self._pool)]
        self._seq += 1
        if plan.strategy is CopyStrategy.STAGED:
            self._enqueue_staged(plan, sm, dmas)
            return
        stream = dmas[0] if plan.strategy is CopyStrategy.DMA else sm
        rt.wait_event(stream, plan.ready)
        self._after_last_effect((stream,))
        if plan.strategy is CopyStrategy.DMA:
            for m in plan.groups:
                dst, src, sizes = chunk_descriptors(
                    self.layout.region_tables(m.group),
                    m.cache_ids,
                    m.slots,
                    tier_base=self._tier_base,
                    slot_bytes=self.tier.slot_bytes,
                    direction=self.direction,
                    factor=self.tier.factor,
                    block_stride=self.tier.block_stride,
                )
                rt.memcpy_batch(stream, dst, src, sizes, self.direction)
        elif plan.groups:
            if self._tier_view is None:  # pragma: no cover - refused at construction
                raise ConfigError("the kernel strategy needs evenly spaced tier slots")
            arrays = [a for m in plan.groups for a in (m.cache_ids, m.slots)]
            ids = self._upload_ids(plan, stream, arrays)
            for k, m in enumerate(plan.groups):
                n = int(m.cache_ids.shape[0])
                copy = self._block_copy(
                    m, ids[2 * k], ids[2 * k + 1], n, self._tier_base, self._tier_view
                )
                rt.copy_blocks(stream, copy)
        self._last_effect = [(self._mark(plan, stream), stream)]

    def _mark(self, plan: DevicePlan, stream: Any) -> Any:
        """Record a pooled event on ``stream`` that the watcher will check."""
        event = self._event()
        self._ops.record(event, stream)
        plan.events.append(event)
        plan.checks.append(event)
        return event

    def _block_copy(
        self,
        m: GroupMapping,
        ids: torch.Tensor,
        slot_ids: torch.Tensor | None,
        count: int,
        slot_base: int,
        slot_view: torch.Tensor,
    ) -> BlockCopy:
        """A copy of ``count`` blocks of the group between the cache and slot rows: a
        staging buffer filled in order (``slot_ids`` None) or the tier itself."""
        base, stride, size, offset, max_size = self._tables[m.group]
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
            direction=self.direction,
            cache_views=self._views[m.group],
            slot_view=slot_view,
            slot_offsets=self.layout.slot_offsets[m.group],
        )

    def _enqueue_staged(self, plan: DevicePlan, sm: Any, dmas: tuple[Any, Any]) -> None:
        """A store gathers each piece on the SM stream, then DMAs it to the host; a load
        DMAs each piece into staging, then scatters it on the SM stream. With several
        buffers, later pieces' first halves run while earlier pieces' second halves do;
        consecutive pieces' DMAs go on alternate DMA streams.

        The job's writes (store: the DMAs, load: the scatters) wait for the previous
        job's writes; the other half of each piece is only held by buffer reuse.
        Every piece records events the watcher checks, since a device error
        surfaces at the next event recorded on its own stream.
        """
        rt = self._ops
        staging = self._staging
        if staging is None:  # pragma: no cover - guarded at construction
            raise ConfigError("no staging memory")
        store = self._store
        if self._native is not None:
            self._staged_native(plan, sm, dmas, staging, self._native)
            return
        record, wait, copy = rt.record, rt.wait_event, rt.memcpy_batch
        wait(sm, plan.ready)
        self._after_last_effect(dmas if store else (sm,))
        # Each group's blocks go through staging in tier-address order, so a run of
        # consecutive tier slots (ascending or descending in the job, as an
        # allocator that reuses freed slots last-in first-out hands them out) fills
        # consecutive staging rows and moves as one DMA descriptor.
        tier_base = np.uint64(self._tier_base)
        order = [self._tier_order(m, tier_base) for m in plan.groups]
        # every group's ids in one upload, before any piece
        ids = self._upload_ids(plan, sm, [cache_ids for cache_ids, _ in order])
        rows_per = staging.rows
        pieces = sum(-(-int(m.cache_ids.shape[0]) // rows_per) for m in plan.groups)
        # two events per piece (its first half done, its second half done; an empty
        # job records one), taken from the pool at once
        events = self._take_events(max(2 * pieces, 1))
        plan.events.extend(events)
        checks = plan.checks
        last: dict[int, Any] = {}  # last event per DMA stream (stores end on both)
        end = None
        at = 0
        for m, group_ids, (_, tier_rows) in zip(plan.groups, ids, order, strict=True):
            n = int(m.cache_ids.shape[0])
            # a group of one piece merges that piece (fewer numpy calls than planning)
            runs = self._runs(m.group, tier_rows, staging) if n > rows_per else None
            sizes_all = self._used_sizes[m.group]
            for k, lo in enumerate(range(0, n, rows_per)):
                hi = min(lo + rows_per, n)
                b = staging.take()
                self._pieces += 1
                parity = self._pieces % 2
                dma = dmas[parity]
                first, second = (sm, dma) if store else (dma, sm)
                if runs is None:  # a single piece, or no two neighbours continue
                    tier = tier_rows[lo:hi]
                    rows = staging.row_addresses[b][: hi - lo]
                    sizes = sizes_all[: hi - lo]
                    if n <= rows_per:  # (merge_runs is symmetric in its two sides)
                        tier, rows, sizes = merge_runs(tier, rows, sizes)
                else:  # one per run of consecutive tier slots within the piece
                    run_tier, run_rows, run_bytes, cuts = runs
                    c0, c1 = cuts[k], cuts[k + 1]
                    tier = run_tier[c0:c1]
                    rows = run_rows[b][c0:c1]
                    sizes = run_bytes[c0:c1]
                dst, src = (tier, rows) if store else (rows, tier)
                piece_ids = group_ids if lo == 0 and hi == n else group_ids[lo:hi]
                at_b = (staging.addresses[b], staging.views[b])  # the buffer's rows
                if staging.free[b] is not None:
                    wait(first, staging.free[b])
                if store:
                    rt.copy_blocks(sm, self._block_copy(m, piece_ids, None, hi - lo, *at_b))
                else:
                    copy(dma, dst, src, sizes, self.direction)
                full, end = events[at], events[at + 1]
                at += 2
                record(full, first)
                wait(second, full)
                if store:
                    copy(dma, dst, src, sizes, self.direction)
                else:
                    rt.copy_blocks(sm, self._block_copy(m, piece_ids, None, hi - lo, *at_b))
                record(end, second)
                checks += (full, end)
                staging.free[b] = last[parity] = end
        if store and len(last) == 2:
            # the next job's DMA streams wait for both ends (no join needed)
            self._last_effect = [(last[0], dmas[0]), (last[1], dmas[1])]
        elif end is None:  # an empty job still takes its place in the order
            stream = dmas[0] if store else sm
            end = events[at]
            record(end, stream)
            checks.append(end)
            self._last_effect = [(end, stream)]
        else:
            self._last_effect = [(end, dmas[parity] if store else sm)]

    def _staged_native(
        self, plan: DevicePlan, sm: Any, dmas: tuple[Any, Any], staging: _Staging, program: Any
    ) -> None:
        """:meth:`_enqueue_staged`'s calls, in the same order with the same arguments,
        with the pieces planned by the native library (``oe_staged_build``): Python
        only gathers the job's cache ids (into the id buffer) and tier slots, and
        keeps the handler's state."""
        store = self._store
        program.wait_event(sm, plan.ready)
        self._after_last_effect(dmas if store else (sm,))
        groups = plan.groups
        sizes_n = [int(m.cache_ids.shape[0]) for m in groups]
        total = sum(sizes_n)
        rows_per = staging.rows
        pieces = sum(-(-n // rows_per) for n in sizes_n)
        buffer = self._id_buffer(plan, total)
        host = buffer.host
        slots = self._slots
        if total > slots.shape[0]:
            slots = self._slots = np.empty(2 * total, dtype=np.int64)
            self._slots_at = slots.ctypes.data
        at = 0
        for m, n in zip(groups, sizes_n, strict=True):
            host[at : at + n] = m.cache_ids
            slots[at : at + n] = m.slots
            at += n
        ids_device = program.upload_ids_at(sm, buffer, total)
        events = self._take_events(max(2 * pieces, 1))
        plan.events.extend(events)
        if pieces == 0:  # an empty job still takes its place in the order
            stream = dmas[0] if store else sm
            program.record(events[0], stream)
            plan.checks.append(events[0])
            self._last_effect = [(events[0], stream)]
            return
        nbuf = len(staging.buffers)
        fixed, group_words, piece_words = self._planner_words(program, sm, dmas, staging)
        header = [
            *fixed,
            0,  # 13 to 15: the program's buffers, filled in by build_staged
            0,
            0,
            self._slots_at,
            program.host_ids_at(buffer),
            ids_device,
            staging.next,
            self._pieces,
            len(groups),
            *[0 if e is None else e.cuda_event for e in staging.free],
        ]
        for m, n in zip(groups, sizes_n, strict=True):
            header += (n, *group_words[m.group])
        header += [e.cuda_event for e in events]
        program.build_staged(header, piece_words * pieces, 3 * total)
        # the state _enqueue_staged leaves
        first = staging.next
        staging.next = (first + pieces) % nbuf
        self._pieces += pieces
        for i in range(max(pieces - nbuf, 0), pieces):  # each buffer's last piece
            staging.free[(first + i) % nbuf] = events[2 * i + 1]
        plan.checks += events
        last = self._pieces % 2
        if store and pieces >= 2:  # the last piece of each parity: the last two pieces
            ends = {last: events[2 * pieces - 1], 1 - last: events[2 * pieces - 3]}
            self._last_effect = [(ends[0], dmas[0]), (ends[1], dmas[1])]
        else:
            self._last_effect = [(events[2 * pieces - 1], dmas[last] if store else sm)]

    def _planner_words(
        self, program: Any, sm: Any, dmas: tuple[Any, Any], staging: _Staging
    ) -> tuple[list[int], list[tuple[int, int]], int]:
        """What ``oe_staged_build``'s header holds for a stream set whatever the job
        (its words 0 to 12), per group its bytes per block and the address of its
        launch op template, and the most words a piece's ops take; made once per
        stream set."""
        found = self._rows.get(id(sm))
        if found is not None:
            return found  # type: ignore[no-any-return]
        batch = program.batch_row(self.direction)
        tier = self.tier
        fixed = [
            self._store,
            sm.cuda_stream,
            dmas[0].cuda_stream,
            dmas[1].cuda_stream,
            len(staging.buffers),
            staging.rows,
            self.layout.slot_bytes,
            batch.ctypes.data,
            staging.addresses_at,
            self._tier_base,
            tier.slot_bytes,
            tier.factor,
            tier.block_stride,
        ]
        groups = []
        templates = [batch]  # kept alive with their addresses
        ids = torch.zeros(1, dtype=torch.int64)  # a placeholder: each piece sets its own
        for g in range(len(self.layout.groups)):
            mapping = GroupMapping(g, np.zeros(1, np.int64), np.zeros(1, np.int64))
            template = self._block_copy(
                mapping, ids, None, 1, staging.addresses[0], staging.views[0]
            )
            words = program.launch_row(template, sm)
            templates.append(words)
            groups.append((self.layout.group_bytes[g], words.ctypes.data))
        # a piece: at most two waits and two records (3 words each), a batch, a launch
        piece_words = 4 * 3 + len(batch) + max(len(t) for t in templates[1:])
        found = self._rows[id(sm)] = (fixed, groups, piece_words)
        self._rows[id(sm), "templates"] = templates
        return found

    def _runs(self, group: int, tier_rows: Any, staging: _Staging) -> tuple[Any, ...] | None:
        """A group's runs of consecutive tier slots, cut at piece boundaries, planned
        once per job: each run's tier address, its staging row's address in each
        buffer, its bytes, and per piece where its runs begin (and end), so a piece
        only slices them. None when no two neighbours continue each other
        (scattered slots, or a group that does not fill a staging row, so staging
        rows cannot merge): the descriptors are then one per block. These are the
        descriptors ``merge_runs`` makes from each piece's rows."""
        size = self.layout.group_bytes[group]
        n = int(tier_rows.shape[0])
        if n < 2 or size != self.layout.slot_bytes:
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
        offsets = (starts % rows_per).astype(np.uint64) * np.uint64(self.layout.slot_bytes)
        run_rows = [offsets + np.uint64(a) for a in staging.addresses]
        cuts = np.searchsorted(starts, np.arange(0, n + rows_per, rows_per)).tolist()
        return tier_rows[starts], run_rows, run_bytes, cuts

    def _tier_order(self, m: GroupMapping, tier_base: np.uint64) -> tuple[Any, Any]:
        """The group's cache ids and tier row addresses, sorted by tier address
        (stable: blocks bound for one slot keep their order)."""
        rows = tier_base + self.tier.slot_offsets(m.slots)
        if rows.shape[0] < 2 or bool((rows[1:] > rows[:-1]).all()):
            return m.cache_ids, rows
        order = np.argsort(rows, kind="stable")
        return m.cache_ids[order], rows[order]

    # ------------------------------------------------------------ completion

    def _watch_loop(self) -> None:
        try:
            while True:
                item = self._watch_q.get()
                if item is _STOP:
                    return
                job: LaunchedJob[DevicePlan] = item  # type: ignore[assignment]
                plan = job.prepared
                try:
                    for event in plan.checks:
                        self.runtime.synchronize(event)
                except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                    job.fail(exc)
                else:
                    job.succeed(plan.nbytes)
                self._recycle(plan)
        finally:
            self._threads_done.set()


def pinned_host_tier(
    runtime: DeviceRuntime,
    layout: KVLayout,
    num_blocks: int,
    *,
    factor: int = 1,
    buffer: torch.Tensor | None = None,
    offset: int = 0,
    page_bytes: int | None = None,
    block_stride: int | None = None,
    owner: str = "the buffer",
) -> HostTier:
    """A host tier for ``layout``, registered with the runtime in chunks;
    ``tier.release()`` unregisters it.

    Without ``buffer`` the memory is allocated plainly (no power-of-two
    rounding). With one (a contiguous CPU byte tensor someone else owns, such as
    vLLM's shared offload region) the tier lives inside it, as
    :meth:`HostTier.over` places it, and ``buffer`` is registered as it is, never
    copied; give it as ``(rows, row_bytes)`` to make the registration chunks
    end on row boundaries. Release unregisters it and leaves the memory to its
    owner.
    """
    if not isinstance(runtime, DeviceRuntime) or not isinstance(layout, KVLayout):
        raise TypeError(
            f"pinned_host_tier takes a DeviceRuntime and a KVLayout, got "
            f"{type(runtime).__name__} and {type(layout).__name__}"
        )
    for key, value in (("num_blocks", num_blocks), ("factor", factor)):
        check_int(value, f"pinned_host_tier {key}")
    if buffer is None:
        rows = num_blocks * factor
        memory = torch.empty((rows, layout.slot_bytes), dtype=torch.uint8)
        unpin = runtime.pin_host(memory)
        return HostTier(
            num_blocks, layout.slot_bytes, factor=factor, memory=memory, release=unpin, pinned=True
        )
    place: dict[str, Any] = {
        "num_blocks": num_blocks,
        "slot_bytes": layout.slot_bytes,
        "factor": factor,
        "offset": offset,
        "page_bytes": page_bytes,
        "block_stride": block_stride,
        "owner": owner,
    }
    HostTier.over(buffer, **place).release()  # validate before registering anything
    unpin = runtime.pin_host(buffer)
    try:
        return HostTier.over(buffer, release=unpin, pinned=True, **place)
    except BaseException:
        unpin()
        raise


def make_device_handlers(
    runtime: DeviceRuntime,
    layout: KVLayout,
    tier: HostTier,
    config: DeviceHandlerConfig | None = None,
) -> tuple[DeviceCopyHandler, DeviceCopyHandler]:
    """The store (device -> CPU) and load (CPU -> device) handlers over one tier."""
    return (
        DeviceCopyHandler(runtime, layout, tier, direction=Direction.STORE, config=config),
        DeviceCopyHandler(runtime, layout, tier, direction=Direction.LOAD, config=config),
    )
