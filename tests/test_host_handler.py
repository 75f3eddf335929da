"""The host handler moves real bytes: bit-exact round trips of random data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_engine import (
    BlockCountMismatchError,
    HostCopyHandler,
    HostTier,
    InvalidBlockIdsError,
    InvalidTransferError,
    KVLayout,
    LayoutError,
    OffloadingQueueManager,
    Region,
    TransferSpec,
    cpu_blocks,
    host_cache_blocks,
)
from offload_engine.host.layout import byte_view
from offload_engine.testing import cache_block_bytes, poisoned_tier, random_host_cache

pytestmark = pytest.mark.anyio


def poison_cache(layout: KVLayout, fill: int = 0x5A) -> None:
    for t in layout.tensors:
        byte_view(t).fill_(fill)


async def store_then_load(
    layout: KVLayout,
    tier: HostTier,
    cache_ids: list[int],
    tier_ids: list[int],
    load_ids: list[int],
    *,
    group_sizes: tuple[int, ...] = (),
    block_indices: tuple[int, ...] = (),
    workers: int = 1,
) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """Store cache_ids into the tier, snapshot them, poison the cache, load into load_ids."""
    handler = HostCopyHandler(layout, tier, workers=workers)
    groups = len(layout.groups)
    sizes = group_sizes or (len(cache_ids),)
    originals: dict[int, bytes] = {}
    c = 0
    for g, n in enumerate(sizes):
        for b in cache_ids[c : c + n]:
            originals[b] = cache_block_bytes(layout, b, g % groups)
        c += n
    async with OffloadingQueueManager([handler]) as mgr:
        store = TransferSpec(
            host_cache_blocks(cache_ids, group_sizes=sizes, block_indices=block_indices),
            cpu_blocks(tier_ids),
        )
        [r] = await mgr.wait([mgr.submit_nowait(store)])
        assert r.success, r.error
        poison_cache(layout)
        load = TransferSpec(
            cpu_blocks(tier_ids),
            host_cache_blocks(load_ids, group_sizes=sizes, block_indices=block_indices),
        )
        [r2] = await mgr.wait([mgr.submit_nowait(load)])
        assert r2.success, r2.error
        assert r2.bytes_moved == r.bytes_moved
    loaded: dict[int, bytes] = {}
    c = 0
    for g, n in enumerate(sizes):
        for src, dst in zip(cache_ids[c : c + n], load_ids[c : c + n], strict=True):
            loaded[src] = cache_block_bytes(layout, dst, g % groups)
        c += n
    return originals, loaded


async def test_round_trip_is_bit_exact_on_random_data() -> None:
    _, layout = random_host_cache(num_blocks=32, seed=1)
    tier = poisoned_tier(layout, 16)
    cache_ids = [3, 17, 4, 30, 9]
    originals, loaded = await store_then_load(
        layout, tier, cache_ids, [5, 2, 11, 0, 7], [20, 21, 1, 2, 13]
    )
    assert loaded == originals
    # the tier holds each block contiguously across layers: slot 5 == block 3's bytes
    assert tier.memory[5].numpy().tobytes() == originals[3]


@pytest.mark.parametrize("workers", [1, 3])
async def test_block_factor_round_trip_with_skip(workers: int) -> None:
    _, layout = random_host_cache(num_blocks=40, seed=2)
    tier = poisoned_tier(layout, 10, factor=4)
    # request blocks 6..12 (7 blocks) start 2 slots into their first tier block
    cache_ids = [30, 31, 2, 8, 9, 15, 16]
    originals, loaded = await store_then_load(
        layout, tier, cache_ids, [3, 5, 7], list(range(20, 27)), block_indices=(6,), workers=workers
    )
    assert loaded == originals
    # tier block 3 = slots 12..15: the first two stay poisoned, slot 14 = first cache block
    assert bool((tier.memory[12:14] == 0xA5).all())
    assert tier.memory[14].numpy().tobytes() == originals[30]


async def test_several_kv_groups_and_k_v_before_blocks() -> None:
    # FlashAttention-style per-layer tensors (2, num_blocks, tokens, heads, dim) for group 0
    # and an MLA-style (num_blocks, tokens, dim) tensor for group 1.
    gen = torch.Generator().manual_seed(3)
    nb = 12
    fa = [torch.randn(2, nb, 16, 2, 32, generator=gen).half() for _ in range(2)]
    mla = torch.randn(nb, 16, 64, generator=gen).half()
    chunk = 16 * 2 * 32 * 2
    g0 = [
        r
        for i in range(2)
        for r in (Region(i, 0, chunk, chunk), Region(i, nb * chunk, chunk, chunk))
    ]
    g1 = [Region(2, 0, 16 * 64 * 2, 16 * 64 * 2)]
    layout = KVLayout([*fa, mla], [g0, g1], nb, name="fa+mla")
    assert layout.slot_bytes == max(4 * chunk, 16 * 64 * 2)
    tier = poisoned_tier(layout, 8, factor=2)
    originals, loaded = await store_then_load(
        layout,
        tier,
        [1, 2, 3, 7, 8],
        [0, 1, 5],
        [4, 5, 6, 9, 10],
        group_sizes=(3, 2),
        block_indices=(1, 0),
    )
    assert loaded == originals


async def test_bad_input_is_refused_at_submit_and_nothing_is_written() -> None:
    _, layout = random_host_cache(num_blocks=8)
    tier = poisoned_tier(layout, 4, factor=2)
    before = tier.memory.clone()
    async with OffloadingQueueManager([HostCopyHandler(layout, tier)]) as mgr:
        bad = [
            (TransferSpec(host_cache_blocks([8]), cpu_blocks([0])), InvalidBlockIdsError),
            (TransferSpec(host_cache_blocks([1]), cpu_blocks([4])), InvalidBlockIdsError),
            (TransferSpec(host_cache_blocks([1, 2, 3]), cpu_blocks([0])), BlockCountMismatchError),
            (TransferSpec(cpu_blocks([1]), cpu_blocks([2])), InvalidTransferError),
        ]
        for spec, error in bad:
            with pytest.raises(error):
                mgr.submit_nowait(spec)
        assert mgr.stats().submitted == 0
        # and the engine keeps serving
        [r] = await mgr.wait(
            [mgr.submit_nowait(TransferSpec(host_cache_blocks([0, 1]), cpu_blocks([3])))]
        )
        assert r.success
    assert torch.equal(tier.memory[:6], before[:6])


def test_host_handler_refuses_device_layouts_and_small_tiers() -> None:
    _, layout = random_host_cache(num_blocks=4)
    with pytest.raises(LayoutError, match="needs"):
        HostCopyHandler(layout, HostTier(4, layout.slot_bytes - 1))
    meta = KVLayout.from_block_tensors([torch.zeros(4, 8, device="meta")])
    with pytest.raises(LayoutError, match="host memory"):
        HostCopyHandler(meta, HostTier(4, 64))


async def test_many_concurrent_stores_and_loads_stay_exact() -> None:
    rng = np.random.default_rng(7)
    _, layout = random_host_cache(num_blocks=64, seed=4)
    tier = poisoned_tier(layout, 64)
    snapshot = {b: cache_block_bytes(layout, b) for b in range(32)}
    async with OffloadingQueueManager([HostCopyHandler(layout, tier, workers=2)]) as mgr:
        ids = [
            mgr.submit_nowait(TransferSpec(host_cache_blocks([b]), cpu_blocks([b])))
            for b in range(32)
        ]
        assert all(r.success for r in await mgr.wait(ids))
        targets = rng.permutation(np.arange(32, 64))
        ids = [
            mgr.submit_nowait(TransferSpec(cpu_blocks([b]), host_cache_blocks([int(targets[b])])))
            for b in range(32)
        ]
        assert all(r.success for r in await mgr.wait(ids))
    corrupt = [b for b in range(32) if cache_block_bytes(layout, int(targets[b])) != snapshot[b]]
    assert corrupt == []


def test_host_handler_refuses_tier_to_tier_copies() -> None:
    _, layout = random_host_cache(num_blocks=4)
    handler = HostCopyHandler(layout, HostTier.for_layout(layout, 2))
    with pytest.raises(InvalidTransferError, match="between a KV cache and a tier"):
        handler.prepare(TransferSpec(cpu_blocks([1]), cpu_blocks([1])))
