"""A vLLM job sent to the engine in parts (a layer-wise load or store), folded back into
the one result vLLM expects. vLLM-free; :class:`~.bridge.EngineBridge` keeps one
:class:`PartedJob` per such job, under its lock."""

from __future__ import annotations

import dataclasses

from offload_engine import CacheBlocks, Direction, OffloadError, TierBlocks, TransferResult

#: Engine ids of the parts count up from here, far above vLLM's job ids (a counter from
#: 0 per scheduler), so the two never meet.
FIRST_PART_ID = 1 << 62


@dataclasses.dataclass
class PartedJob:
    """Its blocks, converted once when it was opened (or why they were refused), how
    many parts it has, how many were handed in and came back, and what came back so far."""

    direction: Direction
    parts: int
    blocks: tuple[CacheBlocks, TierBlocks] | OffloadError  # or why they were refused
    submitted: int = 0  # parts handed in
    done: int = 0  # parts whose result came back or that were refused
    pending: set[int] = dataclasses.field(default_factory=set)  # parts in the engine
    nbytes: int = 0
    seconds: float = 0.0
    latency: float = 0.0
    error: BaseException | None = None

    def add(self, job_id: int, part: TransferResult) -> TransferResult | None:
        """Count a part's result (or refusal); the job's result, under ``job_id``, once
        every announced part is in: failed with the first part's error if any failed,
        its bytes the parts' sum, its seconds and latency the longest part's."""
        self.pending.discard(part.job_id)
        self.done += 1
        self.nbytes += part.bytes_moved
        self.seconds = max(self.seconds, part.seconds)
        self.latency = max(self.latency, part.latency)
        if not part.success and self.error is None:
            self.error = part.error
        if self.done < self.parts:
            return None
        ok = self.error is None
        return TransferResult(
            job_id, ok, self.nbytes if ok else 0, self.seconds, self.error, self.latency
        )
