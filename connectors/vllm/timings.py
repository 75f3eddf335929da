"""Where an engine job's time goes, as the worker sees it.

For each direction, the last :data:`WINDOW` jobs: submit to done (the engine's
``latency``), the copy itself (the handler's ``seconds``), and done to collected:
how long the result waited before the worker picked it up in ``get_finished`` (or a
``wait``). The last one is what the engine's threads add on the way (each needs
the GIL, which a busy vLLM thread holds for up to Python's switch interval, 5 ms)
plus the worker's step cadence. A load's TTFT pays all three, so the stats file
shows them (``adapter.timings``). Not thread-safe: the bridge calls it under its
lock.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from offload_engine import Direction, TransferResult

#: jobs kept per direction
WINDOW = 256
#: steps listed one by one in :meth:`StepClock.summary`
RECENT = 32


class JobClock:
    """Per direction, the last :data:`WINDOW` jobs' three times (seconds)."""

    def __init__(self) -> None:
        self._submitted_at: dict[int, float] = {}
        self._samples: dict[Direction, deque[tuple[float, float, float]]] = {
            d: deque(maxlen=WINDOW) for d in Direction
        }

    def submitted(self, job_id: int) -> None:
        self._submitted_at[job_id] = time.perf_counter()

    def collected(self, result: TransferResult, direction: Direction | None, now: float) -> None:
        """``result`` reached the worker at ``now`` (``time.perf_counter()``)."""
        at = self._submitted_at.pop(result.job_id, None)
        if at is None or direction is None:
            return
        waited = max(0.0, now - at - result.latency)
        self._samples[direction].append((result.latency, result.seconds, waited))

    def summary(self) -> dict[str, dict[str, float | int]]:
        """Per direction with jobs: medians in ms of each time, and the 90th
        percentile and the largest of done to collected."""
        out: dict[str, dict[str, float | int]] = {}
        for direction, samples in self._samples.items():
            if not samples:
                continue
            latency, copy, waited = (sorted(column) for column in zip(*samples, strict=True))
            out[direction.value] = {
                "jobs": len(samples),
                "submit_to_done_ms_p50": 1e3 * statistics.median(latency),
                "copy_ms_p50": 1e3 * statistics.median(copy),
                "done_to_collected_ms_p50": 1e3 * statistics.median(waited),
                "done_to_collected_ms_p90": 1e3 * waited[int(0.9 * (len(waited) - 1))],
                "done_to_collected_ms_max": 1e3 * waited[-1],
            }
        return out


class StepClock:
    """The last :data:`WINDOW` steps with layer-wise loads, as vLLM's thread saw them:
    from the loads' submit (``handle_preemptions``) to the forward pass's end
    (``wait_for_save``), and the part of it spent blocked in the waits (a part not yet
    launched). Written by vLLM's worker thread only."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=WINDOW)

    def step(self, span: float, blocked: float, parts: int) -> None:
        self._samples.append((span, blocked, parts))

    def summary(self) -> dict[str, Any]:
        """Medians in ms of the span and of the blocked time, and both for each of the
        last :data:`RECENT` steps, oldest first; empty with no step."""
        samples = list(self._samples)
        if not samples:
            return {}
        span, blocked, parts = zip(*samples, strict=True)
        return {
            "steps": len(samples),
            "start_to_forward_end_ms_p50": 1e3 * statistics.median(span),
            "blocked_in_waits_ms_p50": 1e3 * statistics.median(blocked),
            "parts_p50": statistics.median(parts),
            "recent_ms": [[round(1e3 * s, 2), round(1e3 * b, 2)] for s, b, _ in samples[-RECENT:]],
        }
