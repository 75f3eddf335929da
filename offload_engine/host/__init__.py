"""Host memory: the host tier (a pool of blocks), KV layouts, and the host copy handler."""

from offload_engine.host.tier import HostTier

__all__ = ["HostTier"]
