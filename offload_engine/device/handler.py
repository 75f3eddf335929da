"""The device copy handler: KV cache on an accelerator <-> host tier, on any runtime.

One handler serves one direction: a **store** handler for ``(device, CPU)`` and a
**load** handler for ``(CPU, device)``; :func:`~offload_engine.device.make_device_handlers`
builds the pair over one layout and one tier. The runtime (CUDA, NPU, fake)
supplies streams, events and copies; the device package holds the logic they
share, one concept a module:

- :mod:`~offload_engine.device.config`: the strategies and the validated knobs;
- :mod:`~offload_engine.device.pools`: stream sets, staging buffers, events and
  id buffers, the KV regions' tables on the device;
- :mod:`~offload_engine.device.dma`, :mod:`~offload_engine.device.staged` (with
  :mod:`~offload_engine.device.staged_native`), :mod:`~offload_engine.device.kernel`:
  one module per strategy;
- :mod:`~offload_engine.device.launch`: the launch paths, the launcher and
  watcher threads, polled completion;
- :mod:`~offload_engine.device.multipath`: large staged jobs split over the
  own host link and borrowed peers' links (``DeviceHandlerConfig.peers``).

At submit, :meth:`DeviceCopyHandler.prepare` records an event on the caller's
current stream and the job's first operation waits on it, so a store never
reads KV the model is still writing. ``docs/cuda.md`` explains the strategies,
the stream sets and what keeps a small job's launch cheap.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from offload_engine.device.config import CopyStrategy, DeviceHandlerConfig
from offload_engine.device.context import JobOrder, LaunchContext, SlotScratch
from offload_engine.device.launch import Launcher, enqueue
from offload_engine.device.multipath import Multipath, open_paths, release_streams
from offload_engine.device.peers import MAX_DEVICES, OwnerTraffic, PeerLedger, TrafficShare
from offload_engine.device.plan import DevicePlan
from offload_engine.device.policy import AutoPolicy, choose_strategy
from offload_engine.device.pools import DeviceTables, JobResources, StagingBuffers, stream_sets
from offload_engine.device.runtimes._native import LaunchProgram, StagedPlanner
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.device.staged import COPY2D_ROWS
from offload_engine.engine.handler import HandlerContext, LaunchedJob, TransferHandler
from offload_engine.errors import ConfigError, LayoutError, RuntimeUnavailableError
from offload_engine.host import GroupMapping, HostTier, KVLayout, LastMapping, map_transfer
from offload_engine.vocabulary import Direction, Medium, TransferSpec

log = logging.getLogger("offload_engine.device")


def _mostly_runs(slots: Any) -> bool:
    """Whether ``slots`` come mostly in runs of consecutive slots (ascending or
    descending, as an allocator hands them out): at least COPY2D_ROWS of them per
    break."""
    n = int(slots.shape[0])
    if n < COPY2D_ROWS:
        return False
    breaks = int(np.count_nonzero(np.abs(np.diff(slots)) != 1))
    return breaks * COPY2D_ROWS <= n


def _check_arguments(
    runtime: Any, layout: Any, tier: Any, config: Any, direction: Direction
) -> DeviceHandlerConfig:
    for value, cls, what in (
        (runtime, DeviceRuntime, "runtime"),
        (layout, KVLayout, "layout"),
        (tier, HostTier, "tier"),
    ):
        if not isinstance(value, cls):
            raise TypeError(f"{what} must be a {cls.__name__}, got {type(value).__name__}")
    if config is not None and not isinstance(config, DeviceHandlerConfig):
        raise TypeError(f"config must be a DeviceHandlerConfig, got {type(config).__name__}")
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
    if (
        config is not None
        and config.polled_completion
        and (type(runtime).query is DeviceRuntime.query)
    ):
        raise ConfigError(
            f"polled_completion needs a non-blocking event query, and the "
            f"{type(runtime).__name__} runtime has none (DeviceRuntime.query)"
        )
    return config or DeviceHandlerConfig()


def _aligned(runtime: DeviceRuntime, layout: KVLayout, tier: HostTier) -> bool:
    """Whether every address and size a block copy touches meets the runtime's alignment."""
    align = runtime.block_copy_alignment
    return (
        all(t.data_ptr() % align == 0 for t in [*layout.tensors, tier.span])
        and all(
            v % align == 0 for g in layout.groups for r in g for v in (r.offset, r.stride, r.size)
        )
        and tier.slot_bytes % align == 0
        and tier.block_stride % align == 0
    )


def _staging_rows(
    runtime: DeviceRuntime, layout: KVLayout, tier: HostTier, config: DeviceHandlerConfig
) -> int:
    """Rows (blocks) per staging buffer, 0 without staging; refuses a strategy the
    runtime, the alignment or the tier cannot serve."""
    align = runtime.block_copy_alignment
    aligned = _aligned(runtime, layout, tier)
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
    return rows


def _min_region(layout: KVLayout) -> int:
    return min(r.size for g in layout.groups for r in g)


def _strategy(layout: KVLayout, config: DeviceHandlerConfig, rows: int) -> CopyStrategy | None:
    """The strategy every job takes: the configured one, or for ``AUTO`` dma where
    the policy never stages (no staging rows, or regions large enough for a
    descriptor of their own); None where ``AUTO`` decides per job."""
    if config.strategy is not CopyStrategy.AUTO:
        return config.strategy
    if rows < 1 or _min_region(layout) >= config.dma_min_chunk_bytes:
        return CopyStrategy.DMA
    return None


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
        ledger: PeerLedger | None = None,
    ) -> None:
        config = _check_arguments(runtime, layout, tier, config, direction)
        if ledger is not None and not isinstance(ledger, PeerLedger):
            raise TypeError(f"ledger must be a PeerLedger or None, got {type(ledger).__name__}")
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
        # engine's loop, or with submitter_launch the submitting thread. A fenced job
        # (a layer-wise load part) launches on the submitting thread, whatever its
        # size: a stream waits on its fence soon after the submit, and the hand-offs
        # to the loop and the launcher put about a millisecond before its first copy
        self._inline_units = config.inline_launch_blocks if runtime.nonblocking_launch else 0
        self._submitter_launch = config.submitter_launch and self._inline_units > 0
        self.launch_in_submitter = self._inline_units > 0
        self.polled_completion = config.polled_completion
        self._stage_rows = _staging_rows(runtime, layout, tier, config)
        self._native, self.native_note = self._native_program()
        # what prepare needs per job, fixed here (it runs in the caller's thread, often
        # after that thread sat idle, when each line is cold): the strategy (None: auto
        # decides per job at launch, see _choose), what a launch costs per block of
        # each group (dma, and auto until it decides: a descriptor per region), the
        # name errors give, and a large common job's checks in one native call
        self._strategy = _strategy(layout, config, self._stage_rows)
        self._planner = self._staged_planner()
        # the peers whose links large staged jobs borrow (their paths open at start)
        self._peers, self._peer_rows = self._peer_devices()
        self._ledger = ledger
        self._multipath: Multipath | None = None
        # with a ledger, this handler's own bytes in flight are announced on its
        # device (as the host numbers it), so borrowers elsewhere keep off its link
        self._traffic = self._own_traffic(ledger)
        regions = [len(g) for g in layout.groups]
        per_region = self._strategy in (CopyStrategy.DMA, None)
        self._unit_regions = regions if per_region else [1] * len(regions)
        self._job_strategy = self._strategy or CopyStrategy.AUTO  # AUTO: decided at launch
        self._policy = AutoPolicy.of(config)
        self._min_region = _min_region(layout)
        # bytes of the jobs launched so far; less the bytes of those handed back
        # (JobResources.finished_bytes), the backlog the auto policy weighs. Only
        # launch writes it, and launches never overlap
        self._launched_bytes = 0
        self._who = self.name
        # what the launch code calls to enqueue work: the program, or the runtime
        self._ops: Any = runtime if self._native is None else self._native
        self._check = None if self._native is None else self._native.check_pairs
        self._last_mapping = LastMapping()  # a layer-wise load's parts pair their blocks once
        self._resources = JobResources(runtime, keep_id_buffers=config.max_inflight)
        # looked up per job, so a subclass's (or a test's) _enqueue and _recycle are used
        self._launcher = Launcher(
            runtime,
            enqueue=lambda plan: self._enqueue(plan),  # noqa: PLW0108
            recycle=lambda plan: self._recycle(plan),  # noqa: PLW0108
            inline_units=self._inline_units,
            polled_completion=config.polled_completion,
            name=f"offload-engine-{runtime.name}-{direction.value}",
        )
        self._started = False

    def _native_program(self) -> tuple[LaunchProgram | None, str | None]:
        """The program that records a launch's calls (None: they go to the runtime one
        by one), and why there is none."""
        if self.config.native_launch is False:
            return None, None
        if self._may_borrow():
            # the native launch does not split a job over peers' links yet
            if self.config.native_launch is True:
                raise ConfigError(
                    "peers: a job split over peers' links launches from Python so far; "
                    "set native_launch to 'auto' or False"
                )
            log.info("%s launches from Python: it may split jobs over peers' links", self.name)
            return None, "jobs split over peers' links launch from Python"
        try:
            return self.runtime.native_program(), None
        except RuntimeUnavailableError as exc:
            if self.config.native_launch is True:
                raise ConfigError(f"native_launch is True, but {exc}") from None
            log.info("%s launches from Python: %s", self.name, exc)
            return None, str(exc)

    def _may_borrow(self) -> bool:
        """Whether ``config.peers`` names a device to borrow (whether this handler
        does, :meth:`_peer_devices` settles: it stages jobs, the paths open)."""
        return bool(self._named_peers())

    def _named_peers(self) -> tuple[int, ...]:
        """The devices ``config.peers`` names: under ``"auto"`` every peer the runtime
        offers. A named device the runtime does not offer, or the handler's own, is a
        ``ConfigError``."""
        config, rt = self.config, self.runtime
        wanted = config.peers
        if not wanted:
            return ()
        offered = rt.peer_devices()
        own = rt.device_index
        if wanted == "auto":
            return tuple(d for d in offered if d != own)
        for d in wanted:
            if d == own:
                raise ConfigError(f"peers names device {d}, the handler's own device")
            if d not in offered:
                raise ConfigError(
                    f"peers names device {d}, which the {rt.name} runtime does not offer "
                    f"as a peer of device {own} (it offers {list(offered)})"
                )
        return tuple(wanted)

    def _staged_planner(self) -> StagedPlanner | None:
        """The staged strategy's planner (the native launch's program, or one of its
        own), or None where jobs are not staged. Without the native library there is
        none: an explicit ``STAGED`` is refused and ``AUTO`` falls back to ``dma``."""
        if self._strategy in (CopyStrategy.DMA, CopyStrategy.KERNEL):
            return None
        if self._native is not None:
            return self._native
        try:
            return StagedPlanner()
        except OSError as exc:
            if self.config.strategy is CopyStrategy.STAGED:
                raise ConfigError(
                    f"the staged strategy is planned by the native library, which is "
                    f"unavailable: {exc}"
                ) from None
            log.info("%s copies with dma: the staged planner is unavailable: %s", self.name, exc)
            self._strategy = CopyStrategy.DMA
            self._stage_rows = 0
            return None

    def _peer_devices(self) -> tuple[tuple[int, ...], int]:
        """The peers named by ``config.peers`` that this handler will borrow, and the
        slot rows of each peer staging buffer. A peer the runtime does not offer, or
        the handler's own device, is a ``ConfigError``; a handler that stages no job
        borrows none (only staged jobs split)."""
        config = self.config
        devices = self._named_peers()
        if not devices:
            return (), 0
        slot_bytes = self.layout.slot_bytes
        rows = config.peer_staging_bytes // config.staging_buffers // slot_bytes
        if rows < 1:
            raise ConfigError(
                f"peer_staging_bytes must hold one tier slot ({slot_bytes} bytes) per staging "
                f"buffer ({config.staging_buffers}), got {config.peer_staging_bytes}"
            )
        if self._planner is None or self._stage_rows < 1:
            log.info("%s borrows no peer's link: it stages no job", self.name)
            return (), 0
        return devices, rows

    def _own_traffic(self, ledger: PeerLedger | None) -> TrafficShare | None:
        if ledger is None:
            return None
        own = self.runtime.device_index
        host = self.runtime.host_device_index(own)
        if host is None or not 0 <= host < MAX_DEVICES:
            log.warning(
                "%s does not announce its traffic in the peer ledger: the host's index of "
                "device %d is unknown (CUDA_VISIBLE_DEVICES names it otherwise than by index)",
                self.name,
                own,
            )
            return None
        return OwnerTraffic.of(ledger).share(host)

    @property
    def ledger(self) -> PeerLedger | None:
        """The host's peer ledger this handler was given (its owner closes it)."""
        return self._ledger

    @property
    def borrowed(self) -> tuple[int, ...]:
        """The peer devices whose host links this handler borrows: those of
        ``config.peers`` whose paths opened at start (none before start and after
        close)."""
        multipath = self._multipath
        return () if multipath is None else multipath.devices

    # ------------------------------------------------------------ lifecycle

    def start(self, context: HandlerContext) -> None:
        rt = self.runtime
        self._pool = stream_sets(rt, self._stream_sets())
        rows = self._stage_rows
        slot_bytes = self.layout.slot_bytes
        buffers = self.config.staging_buffers
        setup = self._pool[0][0]
        self._tables = DeviceTables(rt, self.layout, self.direction, setup)
        tier = self.tier
        tier_base = tier.span.data_ptr()
        self._ctx = LaunchContext(
            runtime=rt,
            ops=self._ops,
            layout=self.layout,
            tier=tier,
            direction=self.direction,
            store=self._store,
            tables=self._tables,
            resources=self._resources,
            tier_base=tier_base,
            # where tier slot s starts, as the native dma descriptors take it
            geometry=(tier_base, tier.slot_bytes, tier.factor, tier.block_stride),
            # the tier's slot rows (strided by the slot pitch), for the kernel strategy;
            # None where the slots are not evenly spaced, which refuses that strategy
            tier_view=tier.slot_rows(),
            pool=self._pool,
            staging=StagingBuffers(rt, buffers, rows, slot_bytes) if rows else None,
            planner=self._planner,
            native=self._native,
            native_sets={},
            slots=SlotScratch(),
        )
        self._order = JobOrder()
        if self._peers:
            paths = open_paths(
                self._ctx,
                self._peers,
                buffers=buffers,
                rows=self._peer_rows,
                events=4 * self.max_inflight,
                who=self.name,
            )
            if paths:
                self._multipath = Multipath(
                    paths, min_blocks=self.config.peer_min_blocks, ledger=self._ledger
                )
        done = rt.new_event()
        rt.record(done, setup)
        rt.synchronize(done)
        # a small job uses three or four events, and max_inflight jobs are in flight
        self._resources.add_events(4 * self.max_inflight)
        self._launcher.start(self._pool[0][0], context.call_soon)
        self._started = True

    def owns_thread(self, thread: threading.Thread) -> bool:
        return self._launcher.owns_thread(thread)

    def _stream_sets(self) -> int:
        if self.config.streams is not None:
            return self.config.streams
        # a runtime without a batched copy issues a call per descriptor: more stream
        # sets keep more of those calls' copies in flight
        return 1 if getattr(self.runtime, "batched", True) else 4

    async def aclose(self) -> None:
        if not self._started:
            return
        self._started = False
        await self._launcher.stop(
            self.config.close_timeout,
            f"of {self.name} still waiting on device work (the device may be hung)",
        )
        if self._traffic is not None:
            self._traffic.close()  # jobs left behind no longer count as this link's traffic
        # device memory goes now, not whenever the collector breaks the handler's cycles
        ctx = self._ctx
        del self._ctx, self._tables
        ctx.native_sets.clear()  # they hold the staging buffers and stream handles
        self._resources.clear()
        pool, self._pool = self._pool, []
        multipath, self._multipath = self._multipath, None
        streams = [s for sm, dmas in pool for s in (sm, *dmas)]
        if multipath is not None:
            streams += multipath.streams()
        release_streams(self.runtime, streams, self.name)  # logs a failure: closed either way

    # ------------------------------------------------------------ submit

    def prepare(self, spec: TransferSpec) -> DevicePlan:
        # runs in the caller's thread, often after it sat idle: every step here is
        # cold code, so the fixed facts come from __init__
        job = map_transfer(
            spec,
            self.layout,
            self.tier,
            who=self._who,
            expect=self.direction,
            check=self._check,
            last=self._last_mapping,
        )
        ready = self._resources.event()
        self.runtime.record_current(ready)
        groups = job.groups
        regions = job.regions
        strategy = self._job_strategy
        parts = None
        if regions is not None:
            # a part of each block (some layers): staged where each group's part is
            # one span of its slot (one descriptor per block instead of one per region,
            # or one 2D copy per run of consecutive slots; see _parts), else dma,
            # region by region
            parts = self._parts(groups, regions)
            if parts is None:
                strategy = CopyStrategy.DMA
                units = sum(m.cache_ids.shape[0] * len(regions[m.group]) for m in groups)
            else:
                strategy = CopyStrategy.STAGED
                units = sum(m.cache_ids.shape[0] for m in groups)
        elif len(groups) == 1:
            units = groups[0].cache_ids.shape[0] * self._unit_regions[0]
        else:
            units = sum(m.cache_ids.shape[0] * self._unit_regions[m.group] for m in groups)
        return DevicePlan(
            groups,
            job.nbytes,
            strategy,
            ready,
            [ready],
            units=units,
            regions=regions,
            fence=spec.fence,
            parts=parts,
        )

    def _parts(
        self, groups: list[GroupMapping], regions: tuple[tuple[int, ...], ...]
    ) -> tuple[int, ...] | None:
        """Per KV group, the region table of a staged job's part of each block, or None
        where the job goes by dma: a handler that does not stage, a group whose part
        leaves gaps in its slot, or one whose part is a single region (dma moves it
        as one descriptor a block) over slots that are mostly not consecutive (where
        they are, staging moves each run of them as one 2D copy, at the link's rate
        where a descriptor per block of a small region is not)."""
        if self._strategy not in (CopyStrategy.STAGED, None) or self._planner is None:
            return None
        parts = [0] * len(self.layout.groups)
        for m in groups:
            chosen = regions[m.group]
            if len(chosen) == 1 and not _mostly_runs(m.slots):
                return None
            index = self._tables.part(m.group, chosen)
            if index is None:
                return None
            parts[m.group] = index
        return tuple(parts)

    # ------------------------------------------------------------ launch and completion

    def launch_here(self, prepared: DevicePlan) -> bool:
        return self._submitter_launch or prepared.fence is not None

    def launch(self, job: LaunchedJob[DevicePlan]) -> None:
        plan = job.prepared
        if plan.strategy is CopyStrategy.AUTO:
            self._choose(plan)
        self._launched_bytes += plan.nbytes
        if self._traffic is not None:
            self._traffic.started(plan.nbytes)
        self._launcher.launch(job)

    def _choose(self, plan: DevicePlan) -> None:
        """The ``auto`` policy's strategy for ``plan``, against the bytes launched
        ahead of it and not yet finished; a staged job's launch cost is its blocks."""
        strategy = choose_strategy(
            self._policy,
            min_region_bytes=self._min_region,
            descriptors=plan.units,
            backlog_bytes=self._launched_bytes - self._resources.finished_bytes,
        )
        plan.strategy = strategy
        if strategy is CopyStrategy.STAGED:
            plan.units = sum(int(m.cache_ids.shape[0]) for m in plan.groups)

    def poll(self) -> None:
        """Report the leading run of finished jobs (event queries, no waiting)."""
        self._launcher.poll()

    def watch(self, delta: int) -> None:
        """While someone waits, the watcher thread reports each job as it finishes."""
        self._launcher.watch(delta)

    def _enqueue(self, plan: DevicePlan) -> None:
        """Put one job's work on the streams (jobs take effect in submission order)."""
        enqueue(self._ctx, self._order, plan, self._multipath)

    def _recycle(self, plan: DevicePlan) -> None:
        """Hand a finished job's events and id buffer back to the pools."""
        self._resources.recycle(plan)
        if self._traffic is not None:
            self._traffic.finished(plan.nbytes)
