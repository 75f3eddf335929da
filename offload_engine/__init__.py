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
    InvalidKeyError,
    InvalidTransferError,
    JobCancelledError,
    JobFailedError,
    JobTimeoutError,
    KeyMissError,
    LayoutError,
    LayoutMismatchError,
    NoHandlerError,
    OffloadError,
    QueueFullError,
    RuntimeUnavailableError,
    TierFullError,
    TierUnavailableError,
    TrailerError,
    TransferError,
    UnknownJobError,
    WrongThreadError,
)
from offload_engine.handler import HandlerContext, LaunchedJob, TransferHandler
from offload_engine.handlers.disk import DiskHandler, disk_handlers, page_aligned_tier
from offload_engine.handlers.host import HostCopyHandler
from offload_engine.handlers.threadpool import ThreadPoolHandler
from offload_engine.hosts import SyncOffloadingEngine
from offload_engine.keyed import LayoutDigest, Trailer
from offload_engine.layout import KVLayout, Region
from offload_engine.manager import OffloadingQueueManager
from offload_engine.stats import EngineStats, HandlerStats
from offload_engine.stores.disk import DiskStore, DiskStoreStats, EvictionPolicy, LRUPolicy
from offload_engine.tier import HostTier
from offload_engine.vocabulary import (
    BlockSpec,
    CacheBlocks,
    Direction,
    KeyedBlocks,
    Medium,
    TierBlocks,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
    gpu_blocks,
    host_cache_blocks,
    npu_blocks,
    remote_blocks,
)

__version__ = "0.1.0"

__all__ = [
    "BlockCountMismatchError",
    "BlockSpec",
    "CacheBlocks",
    "ConfigError",
    "Direction",
    "DiskHandler",
    "DiskStore",
    "DiskStoreStats",
    "DuplicateJobIdError",
    "EngineBrokenError",
    "EngineClosedError",
    "EngineNotRunningError",
    "EngineNotStartedError",
    "EngineStats",
    "EvictionPolicy",
    "HandlerContext",
    "HandlerRegistrationError",
    "HandlerStats",
    "HostCopyHandler",
    "HostTier",
    "InvalidBlockIdsError",
    "InvalidKeyError",
    "InvalidTransferError",
    "JobCancelledError",
    "JobFailedError",
    "JobTimeoutError",
    "KVLayout",
    "KeyMissError",
    "KeyedBlocks",
    "LRUPolicy",
    "LaunchedJob",
    "LayoutDigest",
    "LayoutError",
    "LayoutMismatchError",
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
    "TierFullError",
    "TierUnavailableError",
    "Trailer",
    "TrailerError",
    "TransferError",
    "TransferHandler",
    "TransferResult",
    "TransferSpec",
    "UnknownJobError",
    "WrongThreadError",
    "__version__",
    "cpu_blocks",
    "disk_blocks",
    "disk_handlers",
    "gpu_blocks",
    "host_cache_blocks",
    "npu_blocks",
    "page_aligned_tier",
    "remote_blocks",
]
