"""Faults with real server processes: down at start, killed mid-transfer and restarted,
hung, keys evicted, wrong credentials. Each gives failed results or misses, never
corrupt blocks, and the engine keeps serving."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from offload_engine import (
    KeyMissError,
    RedisStore,
    RedisStoreConfig,
    RemoteStore,
    RemoteTier,
    SyncOffloadingEngine,
    TierUnavailableError,
    TransferError,
    TransferResult,
)
from offload_engine.errors import StoreAuthError, StoreUnavailableError
from offload_engine.remote.store import Parts
from offload_engine.testing.servers import (
    RedisClusterServers,
    RedisServer,
    TlsFiles,
    free_port,
)
from tests.remote.conftest import Backend, digest, keys, random_tier, start_backend
from tests.remote.test_remote_tier import load_spec, store_spec


def cause(result: TransferResult) -> BaseException | None:
    """The handler's own error inside a failed result."""
    err = result.error
    return err if isinstance(err, KeyMissError) or err is None else err.__cause__


@pytest.mark.parametrize("name", ["redis", "mooncake"])
def test_server_down_at_start_is_a_clear_error(name: str) -> None:
    b = start_backend(name)
    b.server.stop()  # its port is free now: nothing listens
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError) as info:
        RemoteTier(b.connect(), random_tier(2, seed=0), digest())
    assert isinstance(info.value, StoreUnavailableError)
    assert str(b.server.port) in str(info.value)
    assert time.monotonic() - t0 < 10  # the port probe, not the client's 90 s of retries


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_degraded_start_serves_misses_then_connects() -> None:
    server = RedisServer(port=free_port())  # not started yet
    connect = Backend("redis", server).connect()
    tier = random_tier(4, seed=1)
    with (
        RemoteTier(connect, tier, digest(), degraded_start=True, reconnect_interval=0) as remote,
        SyncOffloadingEngine(remote.handlers()) as engine,
    ):
        assert not remote.connected and "disconnected" in repr(remote)
        assert remote.contains(keys(2)) == 0
        [r] = engine.wait([engine.submit_nowait(store_spec([0, 1], keys(2)))])
        assert not r.success and isinstance(cause(r), StoreUnavailableError)
        server.start()
        try:
            [ok] = engine.wait([engine.submit_nowait(store_spec([0, 1], keys(2)))])
            assert ok.success, ok.error
            assert remote.connected and remote.contains(keys(2)) == 2
            [back] = engine.wait([engine.submit_nowait(load_spec(keys(2), [2, 3]))])
            assert back.success and torch.equal(tier.memory[4:8], tier.memory[0:4])
        finally:
            server.stop()
    assert remote.stats().unavailable >= 2


class KillAfterFirstBatch(RemoteStore):
    """A real store whose server is SIGKILLed after the first batch of a call."""

    backend = "killing"

    def __init__(self, inner: RemoteStore, backend: Backend) -> None:
        super().__init__()
        self.inner, self.b = inner, backend
        self.armed = False

    def register(self, memory: torch.Tensor) -> None:
        self.inner.register(memory)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], objects: Sequence[Parts]) -> None:
        self.inner.put(keys, objects)
        if self.armed:
            self.armed = False
            self.b.server.kill()

    def get_into(self, keys: Sequence[str], objects: Sequence[Parts]) -> list[bool]:
        hits = self.inner.get_into(keys, objects)
        if self.armed:
            self.armed = False
            self.b.server.kill()
        return hits

    def remove(self, keys: Sequence[str]) -> None:
        self.inner.remove(keys)

    @property
    def client(self) -> object:
        return self.inner.client

    def _close(self) -> None:
        self.inner.close()


def until_success(engine: SyncOffloadingEngine, spec_fn: object, deadline: float = 60) -> int:
    """Submit until a job succeeds (the client reconnecting); return the failures seen."""
    failures = 0
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        [r] = engine.wait([engine.submit_nowait(spec_fn())])  # type: ignore[operator]
        if r.success:
            return failures
        failures += 1
        assert isinstance(r.error, TransferError)
    raise AssertionError(f"no job succeeded within {deadline}s after the restart")


def test_server_killed_mid_transfer_then_restarted(backend: Backend) -> None:
    inner_connect = backend.connect(**({"socket_timeout": 2.0} if backend.name == "redis" else {}))
    stores: list[KillAfterFirstBatch] = []

    def connect() -> RemoteStore:
        stores.append(KillAfterFirstBatch(inner_connect(), backend))
        return stores[-1]

    n = 150  # three store calls of up to 64 keys
    tier = random_tier(2 * n, seed=2)
    with (
        RemoteTier(connect, tier, digest()) as remote,
        SyncOffloadingEngine(remote.handlers(), default_timeout=30) as engine,
    ):
        stores[0].armed = True
        t0 = time.monotonic()
        [r] = engine.wait([engine.submit_nowait(store_spec(list(range(n)), keys(n)))])
        assert not r.success and isinstance(cause(r), StoreUnavailableError)
        assert time.monotonic() - t0 < 30
        # down: lookups answer 0 without raising, jobs fail, nothing hangs
        assert remote.contains(keys(1)) == 0
        backend.server.start()
        until_success(engine, lambda: store_spec(list(range(n)), keys(n)))
        # the restarted server kept nothing; everything stored after it is exact
        [back] = engine.wait([engine.submit_nowait(load_spec(keys(n), list(range(n, 2 * n))))])
        assert back.success, back.error
        assert torch.equal(tier.memory[2 * n :], tier.memory[: 2 * n])
        # killed during a load: a failed result, never a block passed as good
        stores[0].armed = True
        [r2] = engine.wait([engine.submit_nowait(load_spec(keys(n), list(range(n, 2 * n))))])
        assert not r2.success
        backend.server.start()
        until_success(engine, lambda: store_spec([0], keys(1)))


def test_hung_server_fails_jobs_within_the_socket_timeout(redis_backend: Backend) -> None:
    tier = random_tier(4, seed=3)
    with (
        RemoteTier(redis_backend.connect(socket_timeout=0.5), tier, digest()) as remote,
        SyncOffloadingEngine(remote.handlers()) as engine,
    ):
        redis_backend.server.pause()
        try:
            t0 = time.monotonic()
            [r] = engine.wait([engine.submit_nowait(store_spec([0], keys(1)))])
            assert not r.success and isinstance(cause(r), StoreUnavailableError)
            assert time.monotonic() - t0 < 5
        finally:
            redis_backend.server.resume()
        until_success(engine, lambda: store_spec([0], keys(1)))


def test_evicted_keys_are_misses_and_the_rest_load_exactly() -> None:
    b = start_backend("redis", maxmemory=3 << 20)
    n = 96  # 6 MiB of 64 KiB objects into a 3 MiB server
    tier = random_tier(2 * n, seed=4)
    try:
        with (
            RemoteTier(b.connect(), tier, digest()) as remote,
            SyncOffloadingEngine(remote.handlers()) as engine,
        ):
            for lo in range(0, n, 16):
                ids = list(range(lo, lo + 16))
                [r] = engine.wait([engine.submit_nowait(store_spec(ids, keys(n)[lo : lo + 16]))])
                assert r.success, r.error
            assert remote.contains(keys(n)) < n
            [r] = engine.wait([engine.submit_nowait(load_spec(keys(n), list(range(n, 2 * n))))])
            miss = cause(r)
            assert isinstance(miss, KeyMissError) and miss.missing
            assert len(miss.missing) + len(miss.loaded) == n
            for i, k in enumerate(keys(n)):
                if k in miss.loaded:
                    assert torch.equal(tier.block(n + i), tier.block(i)), i
            assert remote.stats().missed == len(miss.missing)
            # still serving: what fits round-trips
            [ok] = engine.wait([engine.submit_nowait(store_spec([0], [b"again"]))])
            [back] = engine.wait([engine.submit_nowait(load_spec([b"again"], [n]))])
            assert ok.success and back.success and torch.equal(tier.block(n), tier.block(0))
    finally:
        b.server.stop()


@pytest.mark.skipif(
    shutil.which("openssl") is None or shutil.which("redis-server") is None,
    reason="needs openssl and redis-server",
)
def test_tls_with_a_ca_bundle_and_refused_without_it(tmp_path: Path) -> None:
    certs = TlsFiles.create(tmp_path)
    with RedisServer(tls=certs) as server:
        assert server.url.startswith("rediss://")
        tier = random_tier(2, seed=5)
        trusted = Backend("redis", server).connect(ssl_ca_certs=str(certs.ca_cert))
        with (
            RemoteTier(trusted, tier, digest()) as remote,
            SyncOffloadingEngine(remote.handlers()) as engine,
        ):
            [r] = engine.wait([engine.submit_nowait(store_spec([0], keys(1)))])
            [back] = engine.wait([engine.submit_nowait(load_spec(keys(1), [1]))])
            assert r.success and back.success and torch.equal(tier.block(1), tier.block(0))
        # the server's certificate is not signed by a CA the client trusts
        with pytest.raises(StoreUnavailableError, match="certificate"):
            RedisStore(RedisStoreConfig(server.url))
        # plain RESP on the TLS port gets no answer it can parse
        with pytest.raises(StoreUnavailableError):
            RedisStore(RedisStoreConfig(server.url.replace("rediss://", "redis://")))


@pytest.mark.skipif(
    shutil.which("redis-cli") is None or shutil.which("redis-server") is None,
    reason="needs redis-server and redis-cli",
)
def test_redis_cluster_round_trip() -> None:
    with RedisClusterServers(nodes=3) as cluster:
        connect = Backend("redis", cluster.servers[0]).connect(cluster=True)
        n = 40  # keys spread over the three nodes' slots
        tier = random_tier(2 * n, seed=6)
        with (
            RemoteTier(connect, tier, digest()) as remote,
            SyncOffloadingEngine(remote.handlers()) as engine,
        ):
            [r] = engine.wait([engine.submit_nowait(store_spec(list(range(n)), keys(n)))])
            assert r.success, r.error
            assert remote.contains(keys(n)) == n
            [back] = engine.wait([engine.submit_nowait(load_spec(keys(n), list(range(n, 2 * n))))])
            assert back.success, back.error
            assert torch.equal(tier.memory[2 * n :], tier.memory[: 2 * n])
        counts = []
        for node in cluster.servers:
            with RedisStore(RedisStoreConfig(node.url)) as s:
                counts.append(s.client.dbsize())
        assert sum(counts) == n and all(c > 0 for c in counts), counts


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_wrong_password_is_a_clear_error() -> None:
    with RedisServer(acl_user=("tier", "tier-secret")) as server:
        bad = RedisStoreConfig(server.url, password="wrong")
        with pytest.raises(StoreAuthError, match="credentials refused"):
            RedisStore(bad)
        with pytest.raises(StoreAuthError):
            RedisStore(RedisStoreConfig(server.url, username="tier", password="nope"))
        with pytest.raises(StoreAuthError):  # no password at all
            RedisStore(RedisStoreConfig(f"redis://127.0.0.1:{server.port}/0"))
        with RedisStore(RedisStoreConfig(server.url, username="tier", password="tier-secret")) as s:
            assert s.exists(["nothing"]) == [False]
        assert "wrong" not in repr(bad) and "secret" not in repr(bad)
