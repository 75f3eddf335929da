"""A device job as planned at submit, and the ordering every strategy shares.

Jobs of one handler take effect in submission order: each job's writes wait for
the previous job's writes. The handler keeps, as ``_last_effect``, the events
after which the previous job's writes are done (each with the stream it was
recorded on); a strategy makes its writing streams wait on them and leaves its
own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offload_engine.device.config import CopyStrategy
from offload_engine.device.runtimes.base import IdBuffer
from offload_engine.fence import JobFence
from offload_engine.host import GroupMapping

if TYPE_CHECKING:
    from offload_engine.device.handler import DeviceCopyHandler


@dataclass
class DevicePlan:
    """A job planned at submit."""

    groups: list[GroupMapping]
    nbytes: int
    strategy: CopyStrategy  # AUTO until the handler's launch picks dma or staged
    ready: Any  # event recorded on the submitter's current stream
    events: list[Any] = field(default_factory=list)  # handed back to the pool when done
    # one event at the end of each stream the job used; the watcher checks them all,
    # since a device error surfaces at the next event recorded on its own stream
    checks: list[Any] = field(default_factory=list)
    ids: IdBuffer | None = None  # the job's block ids on their way up; reused when done
    # what the launch costs: blocks moved (every group together), or for dma (and
    # auto until it picks) the copy descriptors before merging (blocks x regions)
    units: int = 0
    # TransferSpec.tensors: per group, the regions moved (None: all of them)
    regions: tuple[tuple[int, ...], ...] | None = None
    fence: JobFence | None = None  # told at launch how a stream waits for this job
    # a staged job of ``regions``: per group, the index of the region table for its
    # part of each block (:meth:`RegionTables.part`); None: whole blocks
    parts: tuple[int, ...] | None = None


def after_last_effect(h: DeviceCopyHandler, streams: tuple[Any, ...]) -> None:
    """Make ``streams`` wait for the previous job's writes; an event recorded on the
    stream itself needs no wait (a stream runs its work in order)."""
    for event, on in h._last_effect:
        for stream in streams:
            if stream is not on:
                h._ops.wait_event(stream, event)


def mark(h: DeviceCopyHandler, plan: DevicePlan, stream: Any) -> Any:
    """Record a pooled event on ``stream`` that the watcher will check."""
    event = h._resources.event()
    h._ops.record(event, stream)
    plan.events.append(event)
    plan.checks.append(event)
    return event
