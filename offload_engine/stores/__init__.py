"""Distributed stores a remote tier keeps its objects in: Redis/Valkey and Mooncake Store.

The backends import their client libraries lazily, so this package imports
without them; constructing a backend whose client is missing raises
:class:`~offload_engine.ConfigError` naming the package to install.
"""

from offload_engine.stores.base import Parts, RemoteStore
from offload_engine.stores.mooncake_store import MooncakeStore, MooncakeStoreConfig
from offload_engine.stores.redis_store import RedisStore, RedisStoreConfig

__all__ = [
    "MooncakeStore",
    "MooncakeStoreConfig",
    "Parts",
    "RedisStore",
    "RedisStoreConfig",
    "RemoteStore",
]
