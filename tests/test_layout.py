from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_engine import (
    BlockCountMismatchError,
    InvalidBlockIdsError,
    KVLayout,
    LayoutError,
    Region,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.host.layout import byte_view, tensor_byte_span
from offload_engine.host.mapping import map_blocks
from offload_engine.testing import build_layout, cache_block_bytes
from offload_engine.vocabulary import Direction


def reference_slots(
    group_sizes: list[int], block_indices: list[int], tier_ids: list[int], factor: int
) -> list[list[int]]:
    """vLLM's blocks_per_chunk rule, one block at a time: group g's j-th block goes
    to slot (block_indices[g] % factor + j) of the group's run of tier blocks."""
    out: list[list[int]] = []
    t0 = 0
    for n, index in zip(group_sizes, block_indices, strict=True):
        skip = index % factor
        slots = []
        for j in range(n):
            k = skip + j
            slots.append(tier_ids[t0 + k // factor] * factor + k % factor)
        out.append(slots)
        t0 += -(-(n + skip) // factor) if n else 0
    return out


@st.composite
def group_jobs(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int]]:
    factor = draw(st.integers(1, 5))
    groups = draw(st.integers(1, 3))
    sizes = [draw(st.integers(0, 9)) for _ in range(groups)]
    indices = [draw(st.integers(0, 40)) for _ in range(groups)]
    need = sum(
        -(-(n + i % factor) // factor) if n else 0 for n, i in zip(sizes, indices, strict=True)
    )
    tier_ids = draw(st.lists(st.integers(0, 99), min_size=need, max_size=need, unique=True))
    return factor, sizes, indices, tier_ids


@settings(max_examples=200, deadline=None)
@given(group_jobs())
def test_map_blocks_matches_vllm_blocks_per_chunk_rule(
    job: tuple[int, list[int], list[int], list[int]],
) -> None:
    factor, sizes, indices, tier_ids = job
    cache_ids = list(range(100, 100 + sum(sizes)))
    mapping = map_blocks(
        gpu_blocks(cache_ids, group_sizes=sizes, block_indices=indices),
        cpu_blocks(tier_ids),
        factor=factor,
        num_cache_blocks=1000,
        num_tier_blocks=100,
        num_groups=len(sizes),
    )
    expected = reference_slots(sizes, indices, tier_ids, factor)
    got = {m.group: m.slots.tolist() for m in mapping}
    for g, slots in enumerate(expected):
        assert got.get(g, []) == slots
    for m in mapping:
        c0 = sum(sizes[: m.group])
        assert m.cache_ids.tolist() == cache_ids[c0 : c0 + sizes[m.group]]


def test_load_starting_mid_block_skips_the_first_sub_blocks() -> None:
    # a request's blocks 6..9 with 4 blocks per tier block: start 2 slots into tier block 7
    [m] = map_blocks(
        gpu_blocks([10, 11, 12, 13], block_indices=[6]),
        cpu_blocks([7, 3]),
        factor=4,
        num_cache_blocks=20,
        num_tier_blocks=8,
        num_groups=1,
    )
    assert m.slots.tolist() == [30, 31, 12, 13]


def test_count_mismatch_names_the_numbers() -> None:
    with pytest.raises(BlockCountMismatchError, match="need 2 tier blocks at factor 4, got 3"):
        map_blocks(
            gpu_blocks(range(8)),  # type: ignore[arg-type]
            cpu_blocks([1, 2, 3]),
            factor=4,
            num_cache_blocks=10,
            num_tier_blocks=10,
            num_groups=1,
        )
    with pytest.raises(BlockCountMismatchError, match="got 1"):
        map_blocks(
            gpu_blocks([1, 2]),
            cpu_blocks([1]),
            factor=1,
            num_cache_blocks=10,
            num_tier_blocks=10,
            num_groups=1,
        )
    with pytest.raises(BlockCountMismatchError, match="2 KV groups, the layout 1"):
        map_blocks(
            gpu_blocks([1, 2], group_sizes=[1, 1]),
            cpu_blocks([1, 2]),
            factor=1,
            num_cache_blocks=10,
            num_tier_blocks=10,
            num_groups=1,
        )


def test_out_of_range_ids_are_refused() -> None:
    kwargs = {"factor": 1, "num_cache_blocks": 4, "num_tier_blocks": 4, "num_groups": 1}
    with pytest.raises(InvalidBlockIdsError, match="cache block id 4 is out of range"):
        map_blocks(gpu_blocks([4]), cpu_blocks([0]), **kwargs)
    with pytest.raises(InvalidBlockIdsError, match="tier block id 9 is out of range"):
        map_blocks(gpu_blocks([0]), cpu_blocks([9]), **kwargs)


def test_from_block_tensors_one_region_per_tensor() -> None:
    tensors = [torch.zeros(8, 2, 16, 4, dtype=torch.bfloat16) for _ in range(3)]
    layout = KVLayout.from_block_tensors(tensors)
    assert layout.num_blocks == 8
    assert layout.slot_bytes == 3 * 2 * 16 * 4 * 2
    assert [r.tensor for r in layout.groups[0]] == [0, 1, 2]
    assert layout.slot_offsets[0] == (0, 256, 512)
    assert "blocks=8" in repr(layout)


def test_adjacent_regions_are_coalesced() -> None:
    t = torch.zeros(4, 64, dtype=torch.uint8)
    layout = KVLayout([t], [[Region(0, 0, 64, 32), Region(0, 32, 64, 32)]], 4)
    assert layout.groups[0] == (Region(0, 0, 64, 64),)


def test_layout_refuses_regions_past_the_tensor_with_its_shape() -> None:
    t = torch.zeros(2, 4, 16, dtype=torch.float16)  # K/V before blocks: 4 blocks of 32 bytes
    KVLayout([t], [[Region(0, 0, 32, 32), Region(0, 128, 32, 32)]], 4)
    with pytest.raises(LayoutError, match=r"shape \(2, 4, 16\)"):
        KVLayout([t], [[Region(0, 0, 32, 32), Region(0, 128, 32, 32)]], 5)
    with pytest.raises(LayoutError, match="stride >= size"):
        KVLayout([t], [[Region(0, 0, 16, 32)]], 2)
    with pytest.raises(LayoutError, match="tensor 3"):
        KVLayout([t], [[Region(3, 0, 32, 32)]], 2)
    with pytest.raises(LayoutError, match="at least one group"):
        KVLayout([t], [], 2)


def test_layout_refuses_mixed_devices_and_bad_block_tensors() -> None:
    a = torch.zeros(4, 8)
    with pytest.raises(LayoutError, match="lead with num_blocks=4"):
        KVLayout.from_block_tensors([a, torch.zeros(5, 8)])
    with pytest.raises(LayoutError, match="contiguous"):
        KVLayout.from_block_tensors([torch.zeros(8, 4).t()])
    meta = torch.zeros(4, 8, device="meta")
    with pytest.raises(LayoutError, match="one device"):
        KVLayout.from_block_tensors([a, meta])


def test_byte_span_uses_shape_and_strides_not_storage_size() -> None:
    # an over-allocated storage, as an NPU runner makes for alignment
    storage = torch.zeros(1000, dtype=torch.uint8)
    view = storage[:640].view(4, 160)[:, :128]  # 4 blocks of 128 bytes, row stride 160
    assert tensor_byte_span(view) == 3 * 160 + 128
    raw = byte_view(view)
    assert raw.numel() == 3 * 160 + 128
    assert raw.data_ptr() == view.data_ptr()
    layout = KVLayout([view], [[Region(0, 0, 160, 128)]], 4)
    with pytest.raises(LayoutError):
        KVLayout([view], [[Region(0, 0, 160, 128)]], 5)
    assert layout.slot_bytes == 128


def test_region_views_of_tensors_carved_from_one_buffer() -> None:
    # vLLM allocates one buffer and carves every layer out of it
    buf = torch.arange(3 * 2 * 4 * 8, dtype=torch.float16).view(torch.uint8)
    layers = [buf.view(torch.float16)[i * 64 : (i + 1) * 64].view(2, 4, 8) for i in range(3)]
    layout = KVLayout.flash_attention(layers)
    for g in range(len(layout.groups)):
        views = layout.region_views(g)
        for block in range(4):
            got = b"".join(v[block].numpy().tobytes() for v in views)
            assert got == cache_block_bytes(layout, block)


def test_torch_block_copy_gathers_and_scatters_like_the_kernel() -> None:
    from offload_engine.device.runtimes.base import BlockCopy, torch_block_copy

    layout = build_layout("flash-attention", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    staging = torch.zeros(3, layout.slot_bytes, dtype=torch.uint8)
    ids = torch.tensor([5, 0, 9])
    copy = BlockCopy(
        region_base=torch.empty(0),
        region_stride=torch.empty(0),
        region_size=torch.empty(0),
        slot_offset=torch.empty(0),
        max_region_size=0,
        cache_ids=ids,
        slot_ids=None,
        count=3,
        slot_base=staging.data_ptr(),
        slot_bytes=layout.slot_bytes,
        direction=Direction.STORE,
        cache_views=layout.region_views(0),
        slot_view=staging,
        slot_offsets=layout.slot_offsets[0],
    )
    torch_block_copy(copy)
    for row, block in enumerate([5, 0, 9]):
        assert staging[row].numpy().tobytes() == cache_block_bytes(layout, block)
    before = cache_block_bytes(layout, 5)
    back = BlockCopy(
        **{**copy.__dict__, "cache_ids": torch.tensor([1, 2, 3]), "direction": Direction.LOAD}
    )
    torch_block_copy(back)
    assert cache_block_bytes(layout, 1) == before


def test_small_single_group_jobs_map_like_the_general_path() -> None:
    from offload_engine.errors import InvalidBlockIdsError
    from offload_engine.vocabulary import cpu_blocks, gpu_blocks

    cache, tier = gpu_blocks([5, 1, 9]), cpu_blocks([2, 7, 0])
    for factor in (1, 2):  # factor 2 takes the general path
        sizes = {1: 3, 2: 2}[factor]
        tier_ids = cpu_blocks([2, 7, 0][:sizes])
        [m] = map_blocks(
            cache,
            tier_ids if factor == 2 else tier,
            factor=factor,
            num_cache_blocks=10,
            num_tier_blocks=8,
            num_groups=1,
        )
        assert m.cache_ids.tolist() == [5, 1, 9]
        want = [2, 7, 0] if factor == 1 else [4, 5, 14]
        assert m.slots.tolist() == want
    for bad_cache, bad_tier in ((10, 7), (9, 8)):  # one past the end of either pool
        with pytest.raises(InvalidBlockIdsError):
            map_blocks(
                gpu_blocks([1, bad_cache]),
                cpu_blocks([0, bad_tier]),
                factor=1,
                num_cache_blocks=10,
                num_tier_blocks=8,
                num_groups=1,
            )
