"""The ``auto`` copy strategy: which of ``dma`` and ``staged`` a job takes, decided
per job at launch from the layout's regions, the job's size and the handler's
backlog.

What each strategy costs on the hardware:

- ``dma`` puts one copy descriptor per block region on the copy engine (merged
  where neighbours continue each other). It uses no SMs, so a concurrent GEMM
  or decode step is not slowed. Each descriptor costs the driver about 0.5 to
  1 microsecond of CPU, and the copy engine moves a small piece (a per-layer layout's
  32 or 64 KiB regions) below the link's rate: a job of many small regions is
  bounded by descriptors, not by the link.
- ``staged`` gathers a job's regions on the device into slot-shaped staging rows
  with an SM kernel, then DMAs whole contiguous pieces at the link's rate. A
  large job reaches 0.97 to 0.99 of a contiguous copy, but its gathers take SMs
  that a concurrent GEMM was using.

Hence the rule (:func:`choose_strategy`):

1. **Large regions take ``dma``** (every region at least ``dma_min_chunk_bytes``,
   e.g. a cross-layer layout's one 2 MiB region a block): each descriptor then
   moves at the link's rate and there is nothing to gather.
2. **Small jobs take ``dma``** (at most ``dma_max_descriptors`` descriptors, block
   regions before merging; the default 256 is 4 blocks of a per-layer layout of
   64 regions). Their driver calls are few, and a staged job would add a gather
   and a second stream hop for little. Beyond a few hundred, descriptors hold
   up the model: the driver serialises them with the kernel launches of a step
   that launches from Python (eager), so on an H100 a 16-block dma job of
   32 KiB regions each way slowed an eager decode step 22 to 47 points more than
   the same bytes as one copy. As a CUDA graph dma stays within a point of that
   copy, and staged costs 1 to 3 points more (its gather's and scatter's own
   traffic in device memory), so a deployment whose steps all run as graphs
   does better with a larger ``dma_max_descriptors``.
3. **While the link is saturated, medium jobs of mid-sized regions take ``dma``
   too**: when at least ``dma_backlog_bytes`` are already launched and unfinished
   on the handler, a new job's bytes wait for the link whichever way they go, and
   its descriptors are issued while the link drains the backlog ahead. A gather
   would burn SMs on work that then waits for the link, so jobs of up to
   ``dma_backlog_descriptors`` descriptors take ``dma``, but only where the copy
   engine moves the layout's regions at the link's rate (every region at least
   ``dma_backlog_min_region_bytes``). Below that, ``dma`` cannot drain the backlog
   at the link's rate and the link never catches up: on an H200, a stream of
   8-block jobs of 32 KiB regions moved too little of the link under this rule
   without that floor (0.83 to 0.87 storing, 0.56 to 0.61 loading),
   and 0.91 and 0.90 with those jobs staged; of 128 KiB regions, ``dma`` moves 0.95
   to 0.99 of it.
4. **Everything else takes ``staged``**: a large job of small regions, where
   tens of thousands of descriptors would be far below the link's rate (a
   512-block job of a per-layer layout is 32,768 of them).

``staged`` is only ever chosen where the handler can stage (staging memory,
block copies, the native planner); ``auto`` never chooses ``kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload_engine.device.config import CopyStrategy

if TYPE_CHECKING:
    from offload_engine.device.config import DeviceHandlerConfig


@dataclass(frozen=True)
class AutoPolicy:
    """The ``auto`` strategy's thresholds (``DeviceHandlerConfig``'s fields of the
    same names, validated there)."""

    dma_min_chunk_bytes: int
    dma_max_descriptors: int
    dma_backlog_bytes: int
    dma_backlog_descriptors: int
    dma_backlog_min_region_bytes: int = 128 << 10

    @classmethod
    def of(cls, config: DeviceHandlerConfig) -> AutoPolicy:
        return cls(
            config.dma_min_chunk_bytes,
            config.dma_max_descriptors,
            config.dma_backlog_bytes,
            config.dma_backlog_descriptors,
            config.dma_backlog_min_region_bytes,
        )

    def describe(self) -> str:
        """The rule in one line, as ``offload-engine info`` shows it."""
        return (
            f"dma when every region is >= {_size(self.dma_min_chunk_bytes)} or a job needs "
            f"<= {self.dma_max_descriptors} descriptors (<= "
            f"{max(self.dma_backlog_descriptors, self.dma_max_descriptors)} while "
            f">= {_size(self.dma_backlog_bytes)} are in flight and every region is "
            f">= {_size(self.dma_backlog_min_region_bytes)}), else staged"
        )


def choose_strategy(
    policy: AutoPolicy,
    *,
    min_region_bytes: int,
    descriptors: int,
    backlog_bytes: int,
    can_stage: bool = True,
) -> CopyStrategy:
    """The strategy ``auto`` takes for one job (see the module's docstring).

    ``min_region_bytes``: the layout's smallest block region; ``descriptors``:
    the job's copy descriptors under ``dma`` (blocks x regions, before merging);
    ``backlog_bytes``: bytes launched and unfinished on the handler ahead of the
    job; ``can_stage``: whether the handler has the staged strategy at all.
    """
    if not can_stage or min_region_bytes >= policy.dma_min_chunk_bytes:
        return CopyStrategy.DMA
    if descriptors <= policy.dma_max_descriptors:
        return CopyStrategy.DMA
    if (
        backlog_bytes >= policy.dma_backlog_bytes
        and descriptors <= policy.dma_backlog_descriptors
        and min_region_bytes >= policy.dma_backlog_min_region_bytes
    ):
        return CopyStrategy.DMA
    return CopyStrategy.STAGED


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
