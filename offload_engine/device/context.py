"""What a device handler's launch is given: the fixed facts of the handler
(:class:`LaunchContext`, made once when it starts) and the state its jobs share
(:class:`JobOrder`: what the previous job left, and the turn of the stream sets).

The strategy modules (``dma``, ``kernel``, ``staged``, ``staged_native``) take these
two and a job's plan, never the handler: nothing in them reads or writes a
handler's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from offload_engine.host import HostTier, KVLayout
from offload_engine.vocabulary import Direction

if TYPE_CHECKING:
    from offload_engine.device.plan import DevicePlan
    from offload_engine.device.pools import DeviceTables, JobResources, StagingBuffers
    from offload_engine.device.runtimes._native import LaunchProgram, StagedPlanner
    from offload_engine.device.runtimes.base import DeviceRuntime


class SlotScratch:
    """A staged job's tier slots for the native planner (which makes them addresses),
    in an array reused from job to job and grown when a job needs more."""

    __slots__ = ("array", "at")

    def __init__(self, size: int = 1024) -> None:
        self.array: npt.NDArray[np.int64] = np.empty(size, dtype=np.int64)
        self.at: int = self.array.ctypes.data

    def take(self, total: int) -> npt.NDArray[np.int64]:
        """The array, with room for ``total`` slots."""
        if total > self.array.shape[0]:
            self.array = np.empty(2 * total, dtype=np.int64)
            self.at = self.array.ctypes.data
        return self.array


@dataclass(frozen=True, eq=False)
class LaunchContext:
    """The facts every launch of one handler needs, fixed once it has started."""

    runtime: DeviceRuntime
    #: what the launch calls to enqueue work: the native program, or the runtime
    ops: Any
    layout: KVLayout
    tier: HostTier
    direction: Direction
    store: bool
    #: the layout's region tables on the device
    tables: DeviceTables
    #: pooled events and id buffers
    resources: JobResources
    #: where tier slot 0 starts, and (that, slot bytes, factor, block stride) for the
    #: native dma descriptors
    tier_base: int
    geometry: tuple[int, int, int, int]
    #: the tier's slot rows for the kernel strategy (None: slots not evenly spaced)
    tier_view: Any
    #: the stream sets jobs take in turn: (SM stream, (DMA stream, DMA stream))
    pool: list[tuple[Any, tuple[Any, Any]]]
    staging: StagingBuffers | None
    planner: StagedPlanner | None
    native: LaunchProgram | None
    #: the staged planner's facts per stream set, made on first use
    native_sets: dict[Any, Any]
    slots: SlotScratch

    def mark(self, plan: DevicePlan, stream: Any) -> Any:
        """Record a pooled event on ``stream`` that the watcher will check."""
        event = self.resources.event()
        self.ops.record(event, stream)
        plan.events.append(event)
        plan.checks.append(event)
        return event


class JobOrder:
    """The state one handler's jobs share, in launch order: jobs take effect in
    submission order, each job's writes waiting for the previous job's writes.

    ``last_effect``: the events after which the previous job's writes are done, each
    with the stream it was recorded on; ``pieces``: staged pieces so far (their DMAs
    alternate between two streams); ``seq``: jobs launched (the next stream set)."""

    __slots__ = ("last_effect", "pieces", "seq")

    def __init__(self) -> None:
        self.last_effect: list[tuple[Any, Any]] = []
        self.pieces = 0
        self.seq = 0

    def after_last_effect(self, ops: Any, streams: tuple[Any, ...]) -> None:
        """Make ``streams`` wait for the previous job's writes; an event recorded on the
        stream itself needs no wait (a stream runs its work in order)."""
        for event, on in self.last_effect:
            for stream in streams:
                if stream is not on:
                    ops.wait_event(stream, event)

    def next_set(self, pool: list[tuple[Any, tuple[Any, Any]]]) -> tuple[Any, tuple[Any, Any]]:
        """The stream set the next job takes."""
        found = pool[self.seq % len(pool)]
        self.seq += 1
        return found
