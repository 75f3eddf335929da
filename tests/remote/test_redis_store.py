"""RedisStore's put path: one SET per object, sent from the parts' memory."""

from __future__ import annotations

import pytest
import torch

from offload_engine import RedisStore, StoreError, StoreUnavailableError
from tests.remote.conftest import Backend


def parts(seed: int, sizes: tuple[int, ...] = (40_000, 77)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


def test_an_object_of_several_parts_is_stored_whole(redis_backend: Backend) -> None:
    with RedisStore(redis_backend.config()) as store:  # type: ignore[arg-type]
        objects = [parts(i) for i in range(3)]
        store.put(["a", "b", "c"], objects)
        for name, obj in zip(["a", "b", "c"], objects, strict=True):
            assert store.client.get(name) == b"".join(p.numpy().tobytes() for p in obj)
        back = [[torch.zeros_like(p) for p in obj] for obj in objects]
        assert store.get_into(["a", "b", "c"], back) == [True, True, True]
        for got, want in zip(back, objects, strict=True):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_refused_writes_raise_and_the_connection_stays_usable(redis_backend: Backend) -> None:
    with RedisStore(redis_backend.config()) as store:  # type: ignore[arg-type]
        raw = store.client
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", str(raw.info("memory")["used_memory"] + (256 << 10)))
        big = [parts(i, (200_000, 64)) for i in range(4)]
        with pytest.raises(StoreError, match=r"writes refused.*maxmemory"):
            store.put([f"big{i}" for i in range(4)], big)
        raw.config_set("maxmemory", "0")
        # every reply of the refused batch was read: the next call's replies are its own
        store.put(["after"], [parts(9)])
        back = [torch.zeros_like(p) for p in parts(9)]
        assert store.get_into(["after"], [back]) == [True]
        assert all(torch.equal(g, w) for g, w in zip(back, parts(9), strict=True))


def test_connections_dropped_by_the_server_are_reopened(redis_backend: Backend) -> None:
    with RedisStore(redis_backend.config()) as store:  # type: ignore[arg-type]
        store.put(["x"], [parts(1)])
        # the server drops every client connection (the store's pooled one included)
        assert store.client.client_kill_filter(_type="normal", skipme=False) >= 1
        store.put(["y"], [parts(2)])
        back = [torch.zeros_like(p) for p in parts(2)]
        assert store.get_into(["y"], [back]) == [True]
        assert all(torch.equal(g, w) for g, w in zip(back, parts(2), strict=True))


@pytest.mark.parametrize("retries", [0, 1])
def test_a_send_that_fails_is_retried_then_reported(
    redis_backend: Backend, retries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket fails under the first send (as when the server dies mid-batch):
    with a retry the batch goes again on a fresh connection; without, the call
    fails as unavailable."""
    from redis.connection import Connection
    from redis.exceptions import ConnectionError as RedisConnectionError

    sent = Connection.send_packed_command
    failures = [1]

    def flaky(self: Connection, command: object, check_health: bool = True) -> None:
        if failures[0]:
            failures[0] -= 1
            self.disconnect()
            raise RedisConnectionError("injected: connection reset by peer")
        sent(self, command, check_health)  # type: ignore[arg-type]

    with RedisStore(redis_backend.config(retries=retries)) as store:  # type: ignore[arg-type]
        monkeypatch.setattr(Connection, "send_packed_command", flaky)
        if retries:
            store.put(["z"], [parts(3)])
            assert store.client.get("z") == b"".join(p.numpy().tobytes() for p in parts(3))
        else:
            with pytest.raises(StoreUnavailableError, match="injected"):
                store.put(["z"], [parts(3)])
            assert store.client.get("z") is None
