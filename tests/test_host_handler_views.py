"""HostCopyHandler on KV tensors that are views into one shared allocation."""

from __future__ import annotations

import torch

from offload_engine import (
    HostCopyHandler,
    KVLayout,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    host_cache_blocks,
)
from offload_engine.testing import cache_block_bytes, poisoned_tier


def test_round_trip_through_views_at_nonzero_storage_offsets() -> None:
    # Like vLLM: every layer's (num_blocks, page) tensor is carved out of one buffer,
    # so all but the first start at a nonzero storage offset.
    num_layers, num_blocks, page = 3, 6, 64
    gen = torch.Generator().manual_seed(7)
    buffer = torch.randint(-128, 128, (num_layers * num_blocks * page,), generator=gen).to(
        torch.int8
    )
    tensors = [
        buffer[i * num_blocks * page : (i + 1) * num_blocks * page].view(num_blocks, page)
        for i in range(num_layers)
    ]
    assert [t.storage_offset() for t in tensors] == [0, 384, 768]
    layout = KVLayout.from_block_tensors(tensors)
    tier = poisoned_tier(layout, 4)
    before = {b: cache_block_bytes(layout, b) for b in range(num_blocks)}
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)]) as engine:
        job = engine.submit_nowait(TransferSpec(host_cache_blocks([1, 4]), cpu_blocks([0, 3])))
        [stored] = engine.wait([job])
        assert stored.success
        assert tier.memory[0].numpy().tobytes() == before[1]
        assert tier.memory[3].numpy().tobytes() == before[4]
        job = engine.submit_nowait(TransferSpec(cpu_blocks([3, 0]), host_cache_blocks([0, 5])))
        [loaded] = engine.wait([job])
        assert loaded.success
    assert cache_block_bytes(layout, 0) == before[4]
    assert cache_block_bytes(layout, 5) == before[1]
    for b in (1, 2, 3, 4):
        assert cache_block_bytes(layout, b) == before[b]
