"""Host memory: the host tier (a pool of blocks), KV layouts, and the host copy handler.

Other media import host memory from here (``from offload_engine.host import HostTier``),
never from its modules: what they use of it is re-exported below.
"""

from offload_engine.host.handler import HostCopyHandler
from offload_engine.host.layout import (
    KVLayout,
    Region,
    RegionTables,
    byte_view,
    chunk_descriptors,
    merge_runs,
)
from offload_engine.host.mapping import GroupMapping, LastMapping, TierTransfer, map_transfer
from offload_engine.host.tier import HostTier

__all__ = [
    "GroupMapping",
    "HostCopyHandler",
    "HostTier",
    "KVLayout",
    "LastMapping",
    "Region",
    "RegionTables",
    "TierTransfer",
    "byte_view",
    "chunk_descriptors",
    "map_transfer",
    "merge_runs",
]
