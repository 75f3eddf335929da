"""vLLM's CanonicalKVCaches -> KVLayout, checked byte for byte through the host handler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_engine import (
    HostCopyHandler,
    HostTier,
    LayoutError,
    Region,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    host_cache_blocks,
)
from offload_engine.connectors.vllm.layout import layout_from_canonical
from offload_engine.connectors.vllm.testing import (
    FakeCanonicalKVCacheRef,
    FakeCanonicalKVCaches,
    FakeCanonicalKVCacheTensor,
    fake_canonical_kv_caches,
    page_bytes,
)


def test_regions_per_group_with_padded_pages() -> None:
    kv = fake_canonical_kv_caches(
        num_blocks=8,
        padded_pages=(256, 256, 192),
        groups=(((0, 240), (1, 240)), ((2, 160),), ((0, 240),)),
    )
    layout = layout_from_canonical(kv)
    assert layout.num_blocks == 8
    assert layout.groups == (
        (Region(0, 0, 256, 240), Region(1, 0, 256, 240)),
        (Region(2, 0, 192, 160),),
        (Region(0, 0, 256, 240),),
    )
    assert layout.group_bytes == (480, 160, 240)
    assert layout.slot_bytes == 480


def test_strided_rows_of_a_packed_tensor() -> None:
    # vLLM's packed layouts give (num_blocks, page) views whose row stride exceeds the page
    base = torch.arange(8 * 100, dtype=torch.int16).to(torch.int8).view(8, 100)
    kv = FakeCanonicalKVCaches(
        [FakeCanonicalKVCacheTensor(base[:, 10:74], 64)],
        [[FakeCanonicalKVCacheRef(0, 48)]],
    )
    layout = layout_from_canonical(kv)
    assert layout.groups == ((Region(0, 0, 100, 48),),)


def test_round_trip_is_bit_exact_per_group() -> None:
    kv = fake_canonical_kv_caches(num_blocks=12, groups=(((0, 240), (1, 240)), ((2, 160),)))
    layout = layout_from_canonical(kv)
    tier = HostTier.for_layout(layout, 6, factor=2)
    before = {(g, b): page_bytes(kv, g, b) for g in (0, 1) for b in range(12)}
    padding_before = kv.tensors[0].tensor[:, 240:].clone()
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)]) as engine:
        # group 0: blocks 3,4,5 at logical indices 1..3 (skip 1 slot of the first chunk);
        # group 1: blocks 7,8 at logical indices 0..1
        store = TransferSpec(
            host_cache_blocks([3, 4, 5, 7, 8], group_sizes=[3, 2], block_indices=[1, 0]),
            cpu_blocks([0, 1, 2]),
        )
        [result] = engine.wait([engine.submit_nowait(store)])
        assert result.success
        assert result.bytes_moved == 3 * 480 + 2 * 160
        load = TransferSpec(
            cpu_blocks([0, 1, 2]),
            host_cache_blocks([9, 10, 11, 0, 1], group_sizes=[3, 2], block_indices=[1, 0]),
        )
        [result] = engine.wait([engine.submit_nowait(load)])
        assert result.success
    for src, dst in zip((3, 4, 5), (9, 10, 11), strict=True):
        assert page_bytes(kv, 0, dst) == before[(0, src)]
    for src, dst in zip((7, 8), (0, 1), strict=True):
        assert page_bytes(kv, 1, dst) == before[(1, src)]
    untouched = set(range(12)) - {9, 10, 11, 0, 1}
    for b in untouched:
        assert page_bytes(kv, 0, b) == before[(0, b)]
    # the padding past a layer's page is never written
    assert torch.equal(kv.tensors[0].tensor[:, 240:], padding_before)


def test_random_round_trips_into_other_blocks() -> None:
    rng = np.random.default_rng(3)
    kv = fake_canonical_kv_caches(num_blocks=32, groups=(((0, 256), (1, 200), (2, 192)),))
    layout = layout_from_canonical(kv)
    tier = HostTier.for_layout(layout, 16)
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)]) as engine:
        for _ in range(5):
            src = rng.choice(32, size=8, replace=False)
            dst = rng.choice(np.setdiff1d(np.arange(32), src), size=8, replace=False)
            slots = rng.choice(16, size=8, replace=False)
            want = [page_bytes(kv, 0, int(b)) for b in src]
            engine.wait(
                [engine.submit_nowait(TransferSpec(host_cache_blocks(src), cpu_blocks(slots)))]
            )
            engine.wait(
                [engine.submit_nowait(TransferSpec(cpu_blocks(slots), host_cache_blocks(dst)))]
            )
            assert [page_bytes(kv, 0, int(b)) for b in dst] == want


def test_num_blocks_mismatch_names_the_shape() -> None:
    kv = fake_canonical_kv_caches(num_blocks=8, padded_pages=(64, 64), groups=(((0, 64), (1, 64)),))
    kv.tensors[1] = FakeCanonicalKVCacheTensor(torch.zeros(6, 64, dtype=torch.int8), 64)
    with pytest.raises(
        LayoutError, match=r"KV tensor 1 \(shape \(6, 64\).*6 blocks, tensor 0 has 8"
    ):
        layout_from_canonical(kv)


def test_page_larger_than_its_row_names_the_shape() -> None:
    kv = fake_canonical_kv_caches(num_blocks=4, padded_pages=(64,), groups=(((0, 96),),))
    with pytest.raises(
        LayoutError, match=r"page of 96 bytes does not fit tensor 0 \(shape \(4, 64\)"
    ):
        layout_from_canonical(kv)


def test_padded_page_larger_than_row() -> None:
    kv = FakeCanonicalKVCaches(
        [FakeCanonicalKVCacheTensor(torch.zeros(4, 64, dtype=torch.int8), 80)],
        [[FakeCanonicalKVCacheRef(0, 64)]],
    )
    with pytest.raises(LayoutError, match=r"shape \(4, 64\).*page_size_bytes=80"):
        layout_from_canonical(kv)


def test_non_contiguous_block_refused() -> None:
    t = torch.zeros(4, 16, 8, dtype=torch.int8).transpose(1, 2)
    kv = FakeCanonicalKVCaches(
        [FakeCanonicalKVCacheTensor(t, 128)], [[FakeCanonicalKVCacheRef(0, 128)]]
    )
    with pytest.raises(LayoutError, match=r"shape \(4, 8, 16\).*contiguous"):
        layout_from_canonical(kv)


def test_bad_refs_and_empty_inputs() -> None:
    kv = fake_canonical_kv_caches(num_blocks=4, padded_pages=(64,), groups=(((3, 64),),))
    with pytest.raises(LayoutError, match="refers to tensor 3, but there are 1"):
        layout_from_canonical(kv)
    kv = fake_canonical_kv_caches(num_blocks=4, padded_pages=(64,), groups=(((0, 64),), ()))
    with pytest.raises(LayoutError, match="KV group 1 has no layers"):
        layout_from_canonical(kv)
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        layout_from_canonical(FakeCanonicalKVCaches([], [[]]))
