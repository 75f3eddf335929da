"""The remote tier against real servers: bit-exact round trips, lookups, namespaces, trailers."""

from __future__ import annotations

import pytest
import torch

from offload_engine import (
    ConfigError,
    InvalidTransferError,
    KeyMissError,
    OffloadingQueueManager,
    RedisStore,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    remote_blocks,
)
from offload_engine.remote.tier import RemoteTier, wire_name
from tests.remote.conftest import BLOCK_BYTES, Backend, digest, keys, random_tier


def store_spec(ids: list[int], ks: list[bytes]) -> TransferSpec:
    return TransferSpec(cpu_blocks(ids), remote_blocks(ks))


def load_spec(ks: list[bytes], ids: list[int]) -> TransferSpec:
    return TransferSpec(remote_blocks(ks), cpu_blocks(ids))


@pytest.mark.anyio
async def test_round_trip_bit_exact_through_the_async_engine(backend: Backend) -> None:
    src = random_tier(200, seed=1)
    dst = random_tier(200, seed=2)
    ks = keys(150)
    with (
        RemoteTier(backend.connect(), src, digest()) as a,
        RemoteTier(backend.connect(), dst, digest()) as b,
    ):
        async with OffloadingQueueManager([a.handlers()[0]]) as engine:
            # 150 keys: more than one store call per job (64 keys per batch)
            ids = list(range(10, 160))
            r = await engine.wait([engine.submit_nowait(store_spec(ids, ks))])
            assert r[0].success, r[0].error
            assert r[0].bytes_moved == 150 * BLOCK_BYTES
        assert b.contains(ks) == 150
        assert b.contains([*ks[:5], b"absent", *ks[5:]]) == 5
        async with OffloadingQueueManager([b.handlers()[1]]) as engine:
            order = list(range(150))[::-1]  # other blocks, other order
            jobs = [
                engine.submit_nowait(
                    load_spec([ks[i] for i in order[lo : lo + 30]], list(range(lo, lo + 30)))
                )
                for lo in range(0, 150, 30)
            ]
            results = await engine.wait(jobs)
        assert all(r.success for r in results), [r.error for r in results]
        for j, i in enumerate(order):
            assert torch.equal(dst.block(j), src.block(10 + i)), (j, i)
        assert b.stats().loaded == 150 and b.stats().missed == 0


def test_keys_of_different_lengths_in_one_job(backend: Backend) -> None:
    tier = random_tier(6, seed=11)
    ks = [b"k", b"a-longer-key" * 8, bytes(range(120))]  # 1 to MAX_KEY_BYTES bytes
    with (
        RemoteTier(backend.connect(), tier, digest()) as remote,
        SyncOffloadingEngine(remote.handlers()) as engine,
    ):
        [r] = engine.wait([engine.submit_nowait(store_spec([0, 1, 2], ks))])
        [back] = engine.wait([engine.submit_nowait(load_spec(ks[::-1], [3, 4, 5]))])
        assert r.success and back.success, (r.error, back.error)
        for dst, src in ((3, 2), (4, 1), (5, 0)):
            assert torch.equal(tier.block(dst), tier.block(src))


def test_load_of_absent_keys_is_a_miss_naming_them(backend: Backend) -> None:
    tier = random_tier(8, seed=3)
    before = tier.memory.clone()
    with RemoteTier(backend.connect(), tier, digest()) as remote:
        with SyncOffloadingEngine(remote.handlers()) as engine:
            [ok] = engine.wait([engine.submit_nowait(store_spec([0, 1], keys(2)))])
            assert ok.success, ok.error
            ks = [*keys(2), b"never-stored"]
            [r] = engine.wait([engine.submit_nowait(load_spec(ks, [5, 6, 7]))])
            assert not r.success
            miss = r.error.__cause__ if not isinstance(r.error, KeyMissError) else r.error
            assert isinstance(miss, KeyMissError), r.error
            assert miss.missing == (b"never-stored",)
            assert miss.loaded == tuple(keys(2))
            assert not tier.block(7).any(), "a missed block keeps no stray bytes"
            assert torch.equal(tier.block(5), before[0:2]) and torch.equal(
                tier.block(6), before[2:4]
            )
            # the engine still serves
            [again] = engine.wait([engine.submit_nowait(load_spec(keys(2), [3, 4]))])
            assert again.success, again.error
        assert remote.stats().missed == 1


def test_other_layouts_never_see_each_others_objects(backend: Backend) -> None:
    ks = keys(4)
    a_tier, b_tier = random_tier(4, seed=4), random_tier(4, seed=5)
    with (
        RemoteTier(backend.connect(), a_tier, digest("model-a")) as a,
        RemoteTier(backend.connect(), b_tier, digest("model-b")) as b,
        RemoteTier(
            backend.connect(), random_tier(4, seed=6), digest("model-a", rank=1, world_size=2)
        ) as c,
        SyncOffloadingEngine([*a.handlers()]) as ea,
        SyncOffloadingEngine([*b.handlers()]) as eb,
    ):
        [r] = ea.wait([ea.submit_nowait(store_spec([0, 1, 2, 3], ks))])
        assert r.success, r.error
        assert a.contains(ks) == 4
        assert b.contains(ks) == 0 and c.contains(ks) == 0
        before = b_tier.memory.clone()
        [miss] = eb.wait([eb.submit_nowait(load_spec(ks, [0, 1, 2, 3]))])
        assert not miss.success
        assert b.stats().missed == 4 and not b_tier.memory.any()  # zeroed, never a's bytes
        assert not torch.equal(b_tier.memory, before)


def test_an_object_moved_under_another_layouts_name_fails_verification(
    redis_backend: Backend,
) -> None:
    ks = keys(2)
    d_a, d_b = digest("model-a"), digest("model-b")
    with (
        RemoteTier(redis_backend.connect(), random_tier(2, seed=7), d_a) as a,
        RemoteTier(redis_backend.connect(), random_tier(2, seed=8), d_b) as b,
        SyncOffloadingEngine(
            [
                *a.handlers(),
            ]
        ) as ea,
        SyncOffloadingEngine([*b.handlers()]) as eb,
    ):
        [r] = ea.wait([ea.submit_nowait(store_spec([0, 1], ks))])
        assert r.success, r.error
        raw = RedisStore(redis_backend.config())  # type: ignore[arg-type]
        try:
            client = raw.client
            # same size, same bytes, but under the other layout's name: the trailer names a
            client.copy(wire_name(d_a, ks[0]), wire_name(d_b, ks[0]))
            # a flipped payload byte under a's own name
            client.setrange(wire_name(d_a, ks[1]), 1000, b"\x00\x01")
        finally:
            raw.close()
        assert b.contains(ks[:1]) == 1
        [rb] = eb.wait([eb.submit_nowait(load_spec(ks[:1], [0]))])
        assert not rb.success and b.stats().corrupt == 1
        [ra] = ea.wait([ea.submit_nowait(load_spec(ks, [0, 1]))])
        assert not ra.success
        miss = ra.error.__cause__ if not isinstance(ra.error, KeyMissError) else ra.error
        assert isinstance(miss, KeyMissError) and miss.missing == (ks[1],)
        assert a.stats().corrupt == 1
        # the bad object is gone, and the next store of the key repairs it
        assert a.contains(ks[1:]) == 0 and b.contains(ks[:1]) == 0
        [again] = ea.wait([ea.submit_nowait(store_spec([1], ks[1:]))])
        [back] = ea.wait([ea.submit_nowait(load_spec(ks[1:], [0]))])
        assert again.success and back.success, (again.error, back.error)


def test_truncated_object_is_a_miss(redis_backend: Backend) -> None:
    d = digest()
    with RemoteTier(redis_backend.connect(), random_tier(2, seed=9), d) as remote:
        with SyncOffloadingEngine(remote.handlers()) as engine:
            [r] = engine.wait([engine.submit_nowait(store_spec([0], keys(1)))])
            assert r.success, r.error
            raw = RedisStore(redis_backend.config())  # type: ignore[arg-type]
            name = wire_name(d, keys(1)[0])
            raw.client.set(name, raw.client.getrange(name, 0, BLOCK_BYTES - 1))
            raw.close()
            [bad] = engine.wait([engine.submit_nowait(load_spec(keys(1), [1]))])
            assert not bad.success
        assert remote.stats().missed == 1


def test_bad_jobs_are_refused_at_submit(redis_backend: Backend) -> None:
    with (
        RemoteTier(redis_backend.connect(), random_tier(4, seed=10), digest()) as remote,
        SyncOffloadingEngine(remote.handlers()) as engine,
    ):
        with pytest.raises(InvalidTransferError):
            engine.submit_nowait(store_spec([0, 1], keys(3)))  # counts differ
        with pytest.raises(InvalidTransferError):
            engine.submit_nowait(store_spec([9], keys(1)))  # outside the tier
        with pytest.raises(InvalidTransferError):
            engine.submit_nowait(load_spec(keys(2), [1, 1]))  # one block twice


def test_digest_must_match_the_tier_blocks(redis_backend: Backend) -> None:
    with pytest.raises(ConfigError, match="payload bytes"):
        RemoteTier(redis_backend.connect(), random_tier(2, seed=0), digest(page_bytes=4096))


def test_repr_and_stats_show_state(redis_backend: Backend) -> None:
    remote = RemoteTier(redis_backend.connect(), random_tier(2, seed=0), digest())
    assert "connected" in repr(remote) and remote.stats().connected
    remote.close()
    remote.close()
    assert "closed" in repr(remote) and not remote.stats().connected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"workers": 0}, "workers"),
        ({"workers": 2.0}, "workers"),
        ({"close_timeout": 0}, "close_timeout"),
        ({"close_timeout": True}, "close_timeout"),
    ],
)
def test_bad_workers_or_close_timeout_are_refused_before_connecting(
    args: dict[str, object], match: str
) -> None:
    def connect() -> RedisStore:
        raise AssertionError("a refused tier must not connect")

    with pytest.raises(ConfigError, match=match):
        RemoteTier(connect, random_tier(2, seed=0), digest(), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine_backend", ["asyncio", "trio"])
def test_an_idle_remote_route_launches_from_the_submitting_thread(
    redis_backend: Backend, engine_backend: str
) -> None:
    """A job submitted to an idle route goes straight to the tier's workers: the
    engine's loop gets no call (no wake-up), and the bytes still round-trip."""
    tier = random_tier(4, seed=12)
    expected = tier.memory.clone()
    ks = keys(4, b"idle")
    with (
        RemoteTier(redis_backend.connect(), tier, digest(), workers=2) as remote,
        SyncOffloadingEngine(remote.handlers(), backend=engine_backend) as engine,  # type: ignore[arg-type]
    ):
        bridge = engine.manager._bridge
        assert bridge is not None
        loop_calls: list[object] = []
        real_call = bridge._call

        def counted(fn: object, *args: object) -> object:
            loop_calls.append(fn)
            return real_call(fn, *args)

        bridge._call = counted
        for i in range(4):
            [r] = engine.wait([engine.submit_nowait(store_spec([i], ks[i : i + 1]))])
            assert r.success
        tier.memory.zero_()
        for i in range(4):
            [r] = engine.wait([engine.submit_nowait(load_spec(ks[i : i + 1], [i]))])
            assert r.success
        assert loop_calls == []
        bridge._call = real_call
    assert torch.equal(tier.memory, expected)
