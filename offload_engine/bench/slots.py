"""Tier slots per job as a serving engine's host-tier allocator hands them out.

Which slots a job gets decides how many copy descriptors a staged job needs:
a run of consecutive slots moves as one. Benchmarks use :func:`allocator_slots`
beside random slots, and report the two separately.
"""

from __future__ import annotations

import collections

import numpy as np
import numpy.typing as npt


def allocator_slots(capacity: int, per_job: int, jobs: int) -> list[npt.NDArray[np.int64]]:
    """Tier slots per job as vLLM's ``CPUOffloadingManager`` allocates them
    (``vllm/v1/kv_offload/cpu/manager.py``): fresh chunks in ascending order while
    any are left, then chunks from the free list with ``list.pop()``, which the
    eviction of the least recently stored chunks refills in eviction order. So jobs
    get runs of consecutive slots, ascending and then descending by turns."""
    if not 0 < per_job <= capacity:
        raise ValueError(f"jobs of {per_job} slots do not fit a tier of {capacity}")
    fresh = 0
    free: list[int] = []
    stored: collections.deque[int] = collections.deque()  # oldest first (LRU)
    out = []
    for _ in range(jobs):
        while capacity - fresh + len(free) < per_job:
            free.append(stored.popleft())
        n_fresh = min(per_job, capacity - fresh)
        chunks = list(range(fresh, fresh + n_fresh))
        fresh += n_fresh
        chunks += [free.pop() for _ in range(per_job - n_fresh)]
        stored.extend(chunks)
        out.append(np.array(chunks, dtype=np.int64))
    return out
