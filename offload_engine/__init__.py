"""offload-engine: move LLM KV-cache blocks between memory tiers, fast.

The curated public API: the names in ``__all__``. Three more namespaces are
public: :mod:`offload_engine.runtimes` (which device runtimes this machine can
use: :func:`~offload_engine.runtimes.probe_runtimes`), :mod:`offload_engine.testing`
(the testing kit: fakes, random caches, test servers) and
:mod:`offload_engine.connectors` with every module under it (adapters to serving
systems). Every other module is private and may change without notice.

The device runtimes :class:`CudaRuntime` and :class:`NpuRuntime` are imported
on first use (module ``__getattr__``), so ``import offload_engine`` never loads
a runtime module, the CUDA driver bindings or ``torch_npu``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from offload_engine.device import (
    CopyStrategy,
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.peers import PeerLedger
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.disk import (
    DiskHandler,
    DiskStore,
    DiskStoreStats,
    EvictionPolicy,
    LRUPolicy,
    disk_handlers,
    page_aligned_tier,
)
from offload_engine.engine import (
    EngineStats,
    HandlerContext,
    HandlerStats,
    LaunchedJob,
    OffloadingQueueManager,
    SyncOffloadingEngine,
    ThreadPoolHandler,
    TransferHandler,
)
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
    LedgerUnavailableError,
    NoHandlerError,
    OffloadError,
    QueueFullError,
    RuntimeUnavailableError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
    TierFullError,
    TierUnavailableError,
    TrailerError,
    TransferError,
    UnknownJobError,
    WrongThreadError,
)
from offload_engine.fence import JobFence
from offload_engine.host.handler import HostCopyHandler
from offload_engine.host.layout import KVLayout, Region
from offload_engine.host.tier import HostTier
from offload_engine.keyed import LayoutDigest, Trailer
from offload_engine.remote.mooncake_store import MooncakeStore, MooncakeStoreConfig
from offload_engine.remote.redis_store import RedisStore, RedisStoreConfig
from offload_engine.remote.store import RemoteStore
from offload_engine.remote.tier import RemoteHandler, RemoteTier, RemoteTierStats
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

if TYPE_CHECKING:
    from offload_engine.device.runtimes.cuda import CudaRuntime
    from offload_engine.device.runtimes.npu import NpuRuntime

__version__ = "0.1.0"

#: exported names whose modules load on first use: name -> module
_LAZY = {
    "CudaRuntime": "offload_engine.device.runtimes.cuda",
    "NpuRuntime": "offload_engine.device.runtimes.npu",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # not cached here: the runtime module stays the one place the name is bound
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BlockCountMismatchError",
    "BlockSpec",
    "CacheBlocks",
    "ConfigError",
    "CopyStrategy",
    "CudaRuntime",
    "DeviceCopyHandler",
    "DeviceHandlerConfig",
    "DeviceRuntime",
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
    "JobFence",
    "JobTimeoutError",
    "KVLayout",
    "KeyMissError",
    "KeyedBlocks",
    "LRUPolicy",
    "LaunchedJob",
    "LayoutDigest",
    "LayoutError",
    "LayoutMismatchError",
    "LedgerUnavailableError",
    "Medium",
    "NoHandlerError",
    "NpuRuntime",
    "OffloadError",
    "OffloadingQueueManager",
    "PeerLedger",
    "QueueFullError",
    "Region",
    "RemoteHandler",
    "MooncakeStore",
    "MooncakeStoreConfig",
    "RedisStore",
    "RedisStoreConfig",
    "RemoteStore",
    "RemoteTier",
    "RemoteTierStats",
    "RuntimeUnavailableError",
    "StoreAuthError",
    "StoreError",
    "StoreUnavailableError",
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
    "make_device_handlers",
    "npu_blocks",
    "page_aligned_tier",
    "pinned_host_tier",
    "remote_blocks",
]
