"""The engine: the manager, its sync facade, completions, stats and the handler contract.

It imports no medium: every medium stands on :mod:`offload_engine.engine.handler`.
The names below are what the media and the top-level package take from it.
"""

from offload_engine.engine.handler import (
    HandlerContext,
    LaunchedJob,
    LoopCaller,
    TransferHandler,
)
from offload_engine.engine.manager import OffloadingQueueManager
from offload_engine.engine.stats import EngineStats, HandlerStats
from offload_engine.engine.sync import SyncOffloadingEngine
from offload_engine.engine.threadpool import ThreadPoolHandler

__all__ = [
    "EngineStats",
    "HandlerContext",
    "HandlerStats",
    "LaunchedJob",
    "LoopCaller",
    "OffloadingQueueManager",
    "SyncOffloadingEngine",
    "ThreadPoolHandler",
    "TransferHandler",
]
