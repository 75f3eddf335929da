"""HandlerStats counts successful stores and loads apart, even on one handler."""

from __future__ import annotations

from offload_engine import (
    HostCopyHandler,
    Medium,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    host_cache_blocks,
)
from offload_engine.testing import poisoned_tier, random_host_cache


def test_host_handler_counts_stores_and_loads_separately() -> None:
    _, layout = random_host_cache(num_layers=2, num_blocks=8)
    tier = poisoned_tier(layout, 4)
    engine = SyncOffloadingEngine([HostCopyHandler(layout, tier)])
    try:
        store = engine.submit_nowait(
            TransferSpec(host_cache_blocks([0, 1, 2]), cpu_blocks([0, 1, 2]))
        )
        engine.wait([store])
        load = engine.submit_nowait(TransferSpec(cpu_blocks([1]), host_cache_blocks([5])))
        engine.wait([load])
        stats = engine.stats().for_pair(Medium.CPU, Medium.CPU)
    finally:
        engine.close()
    block = layout.bytes_per_block
    assert (stats.stores_succeeded, stats.bytes_stored) == (1, 3 * block)
    assert (stats.loads_succeeded, stats.bytes_loaded) == (1, block)
    assert stats.succeeded == 2
    assert stats.bytes_moved == 4 * block
    whole = engine.stats()
    assert (whole.stores_succeeded, whole.loads_succeeded) == (1, 1)
    assert (whole.bytes_stored, whole.bytes_loaded) == (3 * block, block)
