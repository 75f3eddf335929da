"""offload-engine: move LLM KV-cache blocks between memory tiers, fast.

The curated public API. Everything not named here is private.
"""

from offload_engine.errors import (
    BlockCountMismatchError,
    ConfigError,
    DuplicateJobIdError,
    EngineBrokenError,
    EngineClosedError,
    EngineNotRunningError,
    EngineNotStartedError,
    HandlerRegistrationError,
    InvalidBlockIdsError,
    InvalidTransferError,
    JobCancelledError,
    JobFailedError,
    JobTimeoutError,
    LayoutError,
    NoHandlerError,
    OffloadError,
    QueueFullError,
    RuntimeUnavailableError,
    TransferError,
    UnknownJobError,
    WrongThreadError,
)
from offload_engine.handlers.base import HandlerContext, LaunchedJob, TransferHandler
from offload_engine.handlers.host import HostCopyHandler
from offload_engine.handlers.threadpool import ThreadPoolHandler
from offload_engine.layout import KVLayout, Region
from offload_engine.manager import OffloadingQueueManager
from offload_engine.stats import EngineStats, HandlerStats
from offload_engine.sync import SyncOffloadingEngine
from offload_engine.tier import HostTier
from offload_engine.vocabulary import (
    BlockSpec,
    CacheBlocks,
    Direction,
    Medium,
    TierBlocks,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
    npu_blocks,
)

__version__ = "0.1.0"

__all__ = [
    "BlockCountMismatchError",
    "BlockSpec",
    "CacheBlocks",
    "ConfigError",
    "Direction",
    "DuplicateJobIdError",
    "EngineBrokenError",
    "EngineClosedError",
    "EngineNotRunningError",
    "EngineNotStartedError",
    "EngineStats",
    "HandlerContext",
    "HandlerRegistrationError",
    "HandlerStats",
    "HostCopyHandler",
    "HostTier",
    "InvalidBlockIdsError",
    "InvalidTransferError",
    "JobCancelledError",
    "JobFailedError",
    "JobTimeoutError",
    "KVLayout",
    "LaunchedJob",
    "LayoutError",
    "Medium",
    "NoHandlerError",
    "OffloadError",
    "OffloadingQueueManager",
    "QueueFullError",
    "Region",
    "RuntimeUnavailableError",
    "SyncOffloadingEngine",
    "ThreadPoolHandler",
    "TierBlocks",
    "TransferError",
    "TransferHandler",
    "TransferResult",
    "TransferSpec",
    "UnknownJobError",
    "WrongThreadError",
    "__version__",
    "cpu_blocks",
    "gpu_blocks",
    "host_cache_blocks",
    "npu_blocks",
]
