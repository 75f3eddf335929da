"""Borrowing peers' host links on real GPUs: staged jobs split over device 0's own link
and one to all of its peers' links round-trip bit-exact, and a peer without free memory
for its staging is left out (skipped without CUDA or without a peer of device 0).

That the peers' copy engines moved the bytes cannot be seen without a profiler; the
tests check that the handlers borrowed them (``handler.borrowed``), and jobs of
``peer_min_blocks`` blocks or more split over every borrowed link."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device import (
    CopyStrategy,
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.host import HostTier, KVLayout
from offload_engine.testing import build_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCKS = 512  # the largest job; the cache holds twice that, the tier as many
BOUND = 60.0


@pytest.fixture(scope="module")
def cuda() -> Iterator[Any]:
    from offload_engine.device.runtimes.cuda import CudaRuntime

    yield CudaRuntime(0)


@pytest.fixture(scope="module")
def peers(cuda: Any) -> tuple[int, ...]:
    found: tuple[int, ...] = cuda.peer_devices()
    if not found:
        pytest.skip("device 0 has no peer it can reach")
    return found


@pytest.fixture(scope="module")
def layout() -> KVLayout:
    """A per-layer (FlashAttention) cache of 4 layers: 32 KiB blocks."""

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cuda:0")

    return build_layout("flash-attention", empty, num_blocks=2 * BLOCKS, num_layers=4, head_dim=64)


@pytest.fixture
def tier(cuda: Any, layout: KVLayout) -> Iterator[HostTier]:
    found = pinned_host_tier(cuda, layout, BLOCKS)
    yield found
    found.release()


def handlers(
    cuda: Any, layout: KVLayout, tier: HostTier, peers: tuple[int, ...], **config: Any
) -> tuple[DeviceCopyHandler, DeviceCopyHandler]:
    config.setdefault("peer_staging_bytes", 16 << 20)
    cfg = DeviceHandlerConfig(
        strategy=CopyStrategy.STAGED,
        staging_bytes=16 << 20,
        native_launch=False,  # split jobs launch from Python
        peers=peers,
        peer_min_blocks=64,
        **config,
    )
    return make_device_handlers(cuda, layout, tier, cfg)


def round_trip(
    engine: SyncOffloadingEngine, layout: KVLayout, count: int, order: str, seed: int
) -> None:
    """Store ``count`` blocks of the cache's first half, load them into blocks of its
    second half, and compare every region of each pair bit for bit."""
    rng = np.random.default_rng(seed)
    src = rng.choice(BLOCKS, size=count, replace=False)
    dst = BLOCKS + rng.choice(BLOCKS, size=count, replace=False)
    if order == "random":
        slots = rng.choice(BLOCKS, size=count, replace=False)
    else:  # an allocator's run of consecutive slots
        slots = np.arange(7, 7 + count) % BLOCKS
    store = TransferSpec(gpu_blocks(src.tolist()), cpu_blocks(slots.tolist()))
    [r] = engine.wait([engine.submit(store)], timeout=BOUND)
    assert r.success, r.error
    assert r.strategy == "staged"
    load = TransferSpec(cpu_blocks(slots.tolist()), gpu_blocks(dst.tolist()))
    [r] = engine.wait([engine.submit(load)], timeout=BOUND)
    assert r.success, r.error
    got_at = torch.from_numpy(dst).to("cuda:0")
    want_at = torch.from_numpy(src).to("cuda:0")
    for view in layout.region_views(0):
        assert torch.equal(view.index_select(0, got_at), view.index_select(0, want_at))


@pytest.mark.parametrize("order", ["random", "consecutive"])
@pytest.mark.parametrize("count", range(1, 8))
def test_split_jobs_round_trip_bit_exact(
    cuda: Any,
    peers: tuple[int, ...],
    layout: KVLayout,
    tier: HostTier,
    count: int,
    order: str,
) -> None:
    if count > len(peers):
        pytest.skip(f"device 0 has {len(peers)} peers")
    borrowed = peers[:count]
    store, load = handlers(cuda, layout, tier, borrowed)
    with SyncOffloadingEngine([store, load]) as engine:
        assert store.borrowed == load.borrowed == borrowed
        for seed, blocks in enumerate((BLOCKS, 64, BLOCKS)):
            round_trip(engine, layout, blocks, order, seed)
    assert store.borrowed == load.borrowed == ()  # closed


def test_a_peer_without_free_memory_for_its_staging_is_dropped(
    cuda: Any,
    peers: tuple[int, ...],
    layout: KVLayout,
    tier: HostTier,
    caplog: pytest.LogCaptureFixture,
) -> None:
    full = peers[-1]
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(full)
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device=f"cuda:{full}")
    try:
        with caplog.at_level("WARNING", logger="offload_engine.device"):
            store, load = handlers(cuda, layout, tier, peers, peer_staging_bytes=1 << 30)
            with SyncOffloadingEngine([store, load]) as engine:
                assert store.borrowed == load.borrowed == peers[:-1]
                round_trip(engine, layout, BLOCKS, "random", seed=9)
    finally:
        del hog
        torch.cuda.empty_cache()
    assert f"does not borrow device {full}'s host link" in caplog.text
