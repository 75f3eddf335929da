"""What keyed tiers talk to: local files (:mod:`offload_engine.stores.disk`, behind the
disk tier), and the distributed stores a remote tier keeps its objects in: Redis/Valkey
and Mooncake Store.

A public package: the remote store protocol (:class:`RemoteStore`), its two backends
and their configurations, and real servers on 127.0.0.1 for tests and
benchmarks (:class:`RedisServer`, :class:`RedisClusterServers`,
:class:`MooncakeMaster`).

The backends import their client libraries lazily, so this package imports
without them; constructing a backend whose client is missing raises
:class:`~offload_engine.ConfigError` naming the package to install.
"""

from offload_engine.stores.base import Parts, RemoteStore
from offload_engine.stores.mooncake_store import MooncakeStore, MooncakeStoreConfig
from offload_engine.stores.redis_store import RedisStore, RedisStoreConfig
from offload_engine.stores.servers import (
    MooncakeMaster,
    RedisClusterServers,
    RedisServer,
    TlsFiles,
    free_port,
)

__all__ = [
    "MooncakeMaster",
    "MooncakeStore",
    "MooncakeStoreConfig",
    "Parts",
    "RedisClusterServers",
    "RedisServer",
    "RedisStore",
    "RedisStoreConfig",
    "RemoteStore",
    "TlsFiles",
    "free_port",
]
