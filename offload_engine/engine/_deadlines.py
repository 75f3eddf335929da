"""The deadline heap: which jobs time out when, and when the timer task must wake.

Guarded by the manager's lock (every ``*_locked`` method runs under it). The
timer task sleeps on :attr:`Deadlines.wake` until the earliest deadline; a
submit with an earlier deadline takes that event so the task re-arms.
"""

from __future__ import annotations

import heapq
import itertools
import math

import anyio

from offload_engine.engine._jobs import Job


class Deadlines:
    __slots__ = ("_heap", "_next", "_seq", "wake")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Job]] = []  # (deadline, seq, job)
        self._seq = itertools.count()
        self._next = math.inf  # the deadline the timer task sleeps towards
        self.wake: anyio.Event | None = None  # set while the timer task sleeps

    def push_locked(self, deadline: float, job: Job, live: int) -> anyio.Event | None:
        """Track ``job``'s deadline; return the timer's event if it must re-arm.

        ``live`` is the number of unresolved jobs: past twice that, entries of
        finished jobs are dropped so they do not pin memory.
        """
        heap = self._heap
        if len(heap) > 1024 and len(heap) > 2 * live:
            heap[:] = [e for e in heap if e[2].outcome is None]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, next(self._seq), job))
        if deadline < self._next:
            self._next = deadline
            event, self.wake = self.wake, None
            return event
        return None

    def expired_locked(self, now: float) -> list[Job]:
        """Pop every unresolved job whose deadline is at or before ``now``."""
        heap = self._heap
        expired: list[Job] = []
        while heap and heap[0][0] <= now:
            job = heapq.heappop(heap)[2]
            if job.outcome is None:
                expired.append(job)
        return expired

    def due_locked(self, now: float) -> bool:
        """Whether some deadline is at or before ``now``."""
        heap = self._heap
        return bool(heap) and heap[0][0] <= now

    def arm_locked(self, now: float) -> tuple[float, anyio.Event]:
        """The timer task's next sleep: (seconds until the earliest deadline, its event)."""
        heap = self._heap
        self._next = heap[0][0] if heap else math.inf
        if self.wake is None:
            self.wake = anyio.Event()
        return self._next - now, self.wake
