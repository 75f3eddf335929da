"""A device job as planned at submit.

The order jobs take effect in is :class:`~offload_engine.device.context.JobOrder`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from offload_engine.device.config import CopyStrategy
from offload_engine.device.runtimes.base import IdBuffer
from offload_engine.fence import JobFence
from offload_engine.host import GroupMapping


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
    # part of each block (:meth:`DeviceTables.part`); None: whole blocks
    parts: tuple[int, ...] | None = None
    # a job split over borrowed links: each peer part's plan, with the pools its
    # events and id buffer came from and go back to once the job is done (the own
    # link's part leaves its events and ids on this plan)
    peer_parts: list[tuple[Any, DevicePlan]] = field(default_factory=list)
