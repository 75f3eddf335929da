"""The disk tier: a keyed store of checksummed objects in segment files, and its handlers."""

from offload_engine.disk.handler import DiskHandler, disk_handlers, page_aligned_tier
from offload_engine.disk.policy import EvictionPolicy, LRUPolicy
from offload_engine.disk.store import DiskStore, DiskStoreStats

__all__ = [
    "DiskHandler",
    "DiskStore",
    "DiskStoreStats",
    "EvictionPolicy",
    "LRUPolicy",
    "disk_handlers",
    "page_aligned_tier",
]
