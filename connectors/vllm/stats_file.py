"""The adapter's stats file: the engine's and the adapter's counters as JSON, for a
run to read after vLLM is gone. vLLM-free.

Each write replaces the file atomically. While serving, a snapshot goes out at most
every ``interval`` seconds (``"final": false``), so a worker that vLLM kills before its
shutdown runs (the OpenAI server's Ctrl-C past its shutdown timeout) leaves one at
most that old; the shutdown writes the last one (``"final": true``, with the results
never handed to vLLM as ``undelivered_at_shutdown``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds between snapshots while serving.
STATS_INTERVAL_S = 2.0


class StatsFile:
    """Where one worker's counters go (``path``), and when the next snapshot is due."""

    def __init__(self, path: str, log: logging.Logger, interval: float | None = None) -> None:
        self.path = path
        self._log = log
        self._interval = STATS_INTERVAL_S if interval is None else interval
        self._due = time.monotonic() + self._interval
        self._failed = False  # a snapshot could not be written (logged once)

    def due(self) -> bool:
        """Whether the next snapshot is due."""
        return time.monotonic() >= self._due

    def snapshot(self, counters: Callable[[], dict[str, Any]]) -> None:
        """The periodic write: never raises into vLLM's step (a failure is logged once)."""
        self._due = time.monotonic() + self._interval
        try:
            self._write(counters(), undelivered=None)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                self._log.warning("offload-engine could not write stats to %s: %s", self.path, exc)

    def final(self, counters: dict[str, Any], undelivered: int) -> None:
        """The shutdown's write, with the count of results never handed to vLLM."""
        self._write(counters, undelivered=undelivered)
        self._log.info("offload-engine stats written to %s", self.path)

    def _write(self, data: dict[str, Any], *, undelivered: int | None) -> None:
        if undelivered is not None:
            data["adapter"]["undelivered_at_shutdown"] = undelivered
        data["final"] = undelivered is not None
        data["pid"] = os.getpid()
        data["written_at"] = time.time()
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, self.path)
