"""The remote tier: keyed objects in a store several instances share (Redis, Mooncake).

Other media import the remote tier from here (``from offload_engine.remote import RemoteTier``),
never from its modules. The store clients (redis-py, Mooncake) are imported by each store
when it connects, so importing this package loads neither.
"""

from offload_engine.remote.mooncake_store import MooncakeStore, MooncakeStoreConfig
from offload_engine.remote.redis_store import RedisStore, RedisStoreConfig
from offload_engine.remote.store import RemoteStore
from offload_engine.remote.tier import RemoteHandler, RemoteTier, RemoteTierStats

__all__ = [
    "MooncakeStore",
    "MooncakeStoreConfig",
    "RedisStore",
    "RedisStoreConfig",
    "RemoteHandler",
    "RemoteStore",
    "RemoteTier",
    "RemoteTierStats",
]
