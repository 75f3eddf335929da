"""Real store servers for the remote-tier tests, started on 127.0.0.1 and stopped by each test."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from offload_engine import (
    HostTier,
    LayoutDigest,
    MooncakeStore,
    MooncakeStoreConfig,
    RedisStore,
    RedisStoreConfig,
    RemoteStore,
)
from offload_engine.remote.mooncake_store import mooncake_missing
from offload_engine.testing.servers import MooncakeMaster, RedisServer

#: why each server cannot run here (the skip reason, naming what to install), or None
REDIS_MISSING = (
    None
    if shutil.which("redis-server")
    else "redis-server is not installed (apt-get install redis-server)"
)
MOONCAKE_MISSING = mooncake_missing()  # the package, or a system library it links against

BLOCK_BYTES = 64 << 10  # 64 KiB host blocks: 2 slots of 32 KiB


@dataclass
class Backend:
    """One running server and how to connect a store to it."""

    name: str
    server: RedisServer | MooncakeMaster

    def config(self, **overrides: object) -> RedisStoreConfig | MooncakeStoreConfig:
        if isinstance(self.server, RedisServer):
            return RedisStoreConfig(self.server.url, **overrides)  # type: ignore[arg-type]
        fields: dict[str, object] = {"segment_bytes": 64 << 20, "local_buffer_bytes": 16 << 20}
        fields.update(overrides)
        return MooncakeStoreConfig(self.server.address, **fields)  # type: ignore[arg-type]

    def connect(self, **overrides: object) -> Callable[[], RemoteStore]:
        config = self.config(**overrides)

        def open_store() -> RemoteStore:
            if isinstance(config, RedisStoreConfig):
                return RedisStore(config)
            return MooncakeStore(config)

        return open_store


def skip_unless_installed(name: str) -> None:
    """Skip the test where backend ``name`` (redis, mooncake) cannot run, saying why."""
    missing = REDIS_MISSING if name == "redis" else MOONCAKE_MISSING
    if missing is not None:
        pytest.skip(missing)


def start_backend(name: str, **server_args: object) -> Backend:
    skip_unless_installed(name)
    if name == "redis":
        server: RedisServer | MooncakeMaster = RedisServer(**server_args)  # type: ignore[arg-type]
    else:
        server = MooncakeMaster(**server_args)  # type: ignore[arg-type]
    server.start()
    return Backend(name, server)


@pytest.fixture(params=["redis", "mooncake"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    b = start_backend(str(request.param))
    try:
        yield b
    finally:
        b.server.stop()


@pytest.fixture
def redis_backend() -> Iterator[Backend]:
    b = start_backend("redis")
    try:
        yield b
    finally:
        b.server.stop()


def digest(model: str = "tiny-llama", **overrides: object) -> LayoutDigest:
    fields: dict[str, object] = {
        "model": model,
        "dtype": "float32",
        "block_size": 16,
        "chunk_blocks": 2,
        "page_bytes": BLOCK_BYTES,
    }
    fields.update(overrides)
    return LayoutDigest(**fields)  # type: ignore[arg-type]


def random_tier(num_blocks: int, seed: int) -> HostTier:
    """A host tier of 64 KiB blocks (2 slots each) filled with seeded random bytes."""
    tier = HostTier(num_blocks, BLOCK_BYTES // 2, factor=2)
    g = torch.Generator().manual_seed(seed)
    tier.memory.copy_(torch.randint(0, 256, tier.memory.shape, dtype=torch.uint8, generator=g))
    return tier


def keys(n: int, salt: bytes = b"k") -> list[bytes]:
    return [salt + i.to_bytes(8, "little") for i in range(n)]
