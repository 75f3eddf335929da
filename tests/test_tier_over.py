"""A host tier inside memory someone else owns (``HostTier.over``), with a page size
and a stride between blocks: vLLM's shared offload region, where each worker owns
one page of every chunk row. Real bytes through the host handler and the device
handler (fake runtime, every strategy); the bytes outside the tier's pages, which
belong to other workers, must stay untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from offload_engine import (
    ConfigError,
    CopyStrategy,
    DeviceHandlerConfig,
    HostCopyHandler,
    HostTier,
    KVLayout,
    LayoutError,
    Medium,
    SyncOffloadingEngine,
    TransferHandler,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.host.layout import byte_view
from offload_engine.testing import LAYOUT_KINDS, FakeRuntime, build_layout, cache_block_bytes

POISON = 0xA5
OTHER = 0x3C  # the other workers' bytes


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


def region_for(
    layout: KVLayout, rows: int, factor: int, *, ranks: int = 2, pad: int = 64
) -> tuple[torch.Tensor, int, int]:
    """A ``(rows, row_bytes)`` int8 buffer shaped like vLLM's shared region: each row
    holds one page per rank (``factor`` slots plus ``pad`` bytes), then padding."""
    page = factor * layout.slot_bytes + pad
    row_bytes = ranks * page + 128
    buffer = torch.full((rows, row_bytes), OTHER, dtype=torch.int8)
    return buffer, page, row_bytes


def outside_pages(buffer: torch.Tensor, offset: int, page: int) -> torch.Tensor:
    """A mask of the buffer's bytes outside every tier page (column range) of one rank."""
    mask = torch.ones(buffer.shape, dtype=torch.bool)
    mask[:, offset : offset + page] = False
    return mask


def round_trip(
    layout: KVLayout,
    handlers: list[TransferHandler[object]],
    tier: HostTier,
    cache_blocks: Callable[..., object],
    factor: int,
) -> None:
    """Store random blocks mid tier block in every group, load them into other
    blocks, compare bit for bit."""
    groups = len(layout.groups)
    rng = np.random.default_rng(factor + len(layout.groups))
    n, first = 5, 2
    sizes, indices = (n,) * groups, (first,) * groups
    src = [int(x) for x in rng.choice(12, size=n * groups, replace=False)]
    dst = [12 + int(x) for x in rng.choice(12, size=n * groups, replace=False)]
    per_group = -(-(n + first % factor) // factor)
    tier_ids = [int(x) for x in rng.choice(tier.num_blocks, size=per_group * groups, replace=False)]
    want = [cache_block_bytes(layout, b, i // n) for i, b in enumerate(src)]
    with SyncOffloadingEngine(handlers) as engine:  # type: ignore[arg-type]
        [rs] = engine.wait(
            [
                engine.submit(
                    TransferSpec(
                        cache_blocks(src, group_sizes=sizes, block_indices=indices),  # type: ignore[arg-type]
                        cpu_blocks(tier_ids),
                    )
                )
            ]
        )
        assert rs.success, rs.error
        assert rs.bytes_moved == n * sum(layout.group_bytes)
        [rl] = engine.wait(
            [
                engine.submit(
                    TransferSpec(
                        cpu_blocks(tier_ids),
                        cache_blocks(dst, group_sizes=sizes, block_indices=indices),  # type: ignore[arg-type]
                    )
                )
            ]
        )
        assert rl.success, rl.error
    got = [cache_block_bytes(layout, d, i // n) for i, d in enumerate(dst)]
    assert got == want
    if factor > 1:  # the slots before the job's start were not written
        assert bool((tier.block(tier_ids[0])[: first % factor] == POISON).all())


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("rank", [0, 1])
def test_host_handler_round_trip_inside_a_shared_region(kind: str, factor: int, rank: int) -> None:
    layout = build_layout(kind, host_empty, num_blocks=24, seed=factor + rank)
    buffer, page, row_bytes = region_for(layout, 10, factor)
    offset = rank * page
    tier = HostTier.over(
        buffer,
        num_blocks=10,
        slot_bytes=layout.slot_bytes,
        factor=factor,
        offset=offset,
        page_bytes=page,
        block_stride=row_bytes,
    )
    assert tier.memory.data_ptr() == buffer.data_ptr() + offset  # wrapped, not copied
    assert tier.slot_pitch == (row_bytes if factor == 1 else None)
    tier.memory.fill_(POISON)
    outside = outside_pages(buffer, offset, page)
    round_trip(layout, [HostCopyHandler(layout, tier)], tier, host_cache_blocks, factor)
    # the other ranks' pages and the row padding were never written
    assert bool((buffer[outside] == OTHER).all())
    # and what the tier holds is in the buffer itself: a reader of the region sees it
    assert not bool((buffer[:, offset : offset + page] == POISON).all())


@pytest.mark.parametrize("strategy", list(CopyStrategy))
@pytest.mark.parametrize("kind", ["flash-attention", "separate-kv", "groups"])
@pytest.mark.parametrize("factor", [1, 3])
def test_device_handlers_round_trip_inside_a_registered_region(
    fake: FakeRuntime, strategy: CopyStrategy, kind: str, factor: int
) -> None:
    layout = build_layout(kind, fake.empty, num_blocks=24, seed=factor)
    buffer, page, row_bytes = region_for(layout, 10, factor)
    offset = page  # rank 1
    tier = pinned_host_tier(
        fake,
        layout,
        10,
        factor=factor,
        buffer=buffer,
        offset=offset,
        page_bytes=page,
        block_stride=row_bytes,
    )
    try:
        assert fake.pin_calls[-1][0] == buffer.data_ptr()  # the region itself is registered
        tier.memory.fill_(POISON)
        outside = outside_pages(buffer, offset, page)
        cfg = DeviceHandlerConfig(strategy=strategy, staging_bytes=4 * layout.slot_bytes)
        if strategy is CopyStrategy.KERNEL and factor > 1:
            with pytest.raises(ConfigError, match="evenly spaced tier slots"):
                make_device_handlers(fake, layout, tier, cfg)
            return
        handlers = list(make_device_handlers(fake, layout, tier, cfg))
        round_trip(layout, handlers, tier, gpu_blocks, factor)  # type: ignore[arg-type]
        assert bool((buffer[outside] == OTHER).all())
    finally:
        tier.release()
    assert fake.unpin_calls and fake.unpin_calls[-1] == buffer.data_ptr()
    assert tier.released
    # release unregisters; the memory stays the owner's, intact
    assert buffer.shape == (10, row_bytes)


def test_a_page_too_small_for_a_tier_block_names_both_sides() -> None:
    buffer = torch.zeros(4096, dtype=torch.int8)
    with pytest.raises(LayoutError, match=r"page of 1000 bytes.*needs 1200 bytes \(2 slots x 600"):
        HostTier.over(
            buffer, num_blocks=2, slot_bytes=600, factor=2, page_bytes=1000, block_stride=2000
        )


def test_blocks_past_the_buffer_and_overlapping_blocks_are_refused() -> None:
    buffer = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=r"holds 4096 bytes.*end at byte 4196"):
        HostTier.over(buffer, num_blocks=4, slot_bytes=100, offset=1096, block_stride=1000)
    with pytest.raises(LayoutError, match="blocks would overlap"):
        HostTier.over(buffer, num_blocks=2, slot_bytes=100, page_bytes=200, block_stride=150)
    with pytest.raises(LayoutError, match="contiguous CPU tensor of bytes"):
        HostTier.over(torch.zeros(100, dtype=torch.float32), num_blocks=1, slot_bytes=4)
    with pytest.raises(ConfigError, match="offset"):
        HostTier.over(buffer, num_blocks=1, slot_bytes=4, offset=-1)


def test_a_refused_region_is_never_registered(fake: FakeRuntime) -> None:
    layout = build_layout("mla", fake.empty, num_blocks=4)
    buffer = torch.zeros((2, layout.slot_bytes), dtype=torch.int8)
    with pytest.raises(LayoutError, match="vLLM's region"):
        pinned_host_tier(fake, layout, 4, buffer=buffer, owner="vLLM's region")
    assert fake.pin_calls == []


def test_slot_offsets_match_the_grid() -> None:
    buffer = torch.zeros(10_000, dtype=torch.uint8)
    tier = HostTier.over(
        buffer, num_blocks=5, slot_bytes=100, factor=3, offset=40, page_bytes=320, block_stride=1000
    )
    slots = np.arange(15)
    grid = tier.slot_grid()
    base = byte_view(tier.span).data_ptr()
    got = tier.slot_offsets(slots).tolist()
    assert got == [grid[s // 3, s % 3].data_ptr() - base for s in range(15)]
    assert "stride=1000" in repr(tier)
    contiguous = HostTier(5, 100, factor=3)
    assert contiguous.slot_offsets(slots).tolist() == [s * 100 for s in range(15)]
    assert contiguous.slot_pitch == 100 and contiguous.contiguous
    assert Medium.CPU.value  # the tier is host memory whatever wraps it
