"""Integrity: the bytes that arrive are the bytes that left, and the overlapping-blocks rules.

Every test runs on the host handler (KV cache in host memory) and on the device handler over
the fake runtime (streams are threads, copies are ``memmove``), through the same rig.

What the engine guarantees for overlapping blocks (docs/reliability.md):

1. Within one job, destinations are distinct: a job that names one destination twice (a
   store's tier slot, a load's cache block, counting KV groups that share a tensor as one) is
   refused at submit with ``InvalidBlockIdsError``. Sources may repeat.
2. A job writes only its own destination blocks (every other byte is left alone).
3. Once a job's successful result is collected, all its writes are done and visible; a job
   submitted after that sees them.
4. Between jobs in flight at the same time, the engine imposes no order. Handlers add one: the
   device handler applies the jobs of one direction in submission order, the host handler with
   one worker runs its jobs (both directions) in submission order. Otherwise a block written
   by two in-flight jobs, or read while another writes it, may hold bytes of either (torn),
   never bytes from anywhere else.
5. A job that failed, timed out or was abandoned at close leaves its destinations undefined; a
   timed-out or abandoned job may still be writing them until its handler finishes with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from offload_engine import (
    CacheBlocks,
    HostCopyHandler,
    HostTier,
    InvalidBlockIdsError,
    KVLayout,
    Medium,
    SyncOffloadingEngine,
    TransferHandler,
    TransferSpec,
    cpu_blocks,
)
from offload_engine.handlers.device import (
    DeviceHandlerConfig,
    Strategy,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.runtimes.fake import FakeRuntime
from offload_engine.testing import build_layout, cache_block_bytes

POISON = 0xA5
BOUND = 20.0


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@dataclass
class Rig:
    """A layout, a tier and the handlers that move blocks between them."""

    kind: str
    layout: KVLayout
    tier: HostTier
    handlers: list[TransferHandler]  # type: ignore[type-arg]
    medium: Medium
    runtime: FakeRuntime | None = None
    notes: dict[str, object] = field(default_factory=dict)

    def cache(self, ids: list[int], **kw: object) -> CacheBlocks:
        return CacheBlocks(self.medium, ids, **kw)  # type: ignore[arg-type]

    def store(self, cache_ids: list[int], tier_ids: list[int], **kw: object) -> TransferSpec:
        return TransferSpec(self.cache(cache_ids, **kw), cpu_blocks(tier_ids))

    def load(self, tier_ids: list[int], cache_ids: list[int], **kw: object) -> TransferSpec:
        return TransferSpec(cpu_blocks(tier_ids), self.cache(cache_ids, **kw))

    def engine(self, **kw: object) -> SyncOffloadingEngine:
        return SyncOffloadingEngine(self.handlers, **kw)  # type: ignore[arg-type]

    def tier_bytes(self, block: int) -> bytes:
        return bytes(self.tier.block(block).numpy().tobytes())

    def close(self) -> None:
        self.tier.release()
        if self.runtime is not None:
            self.runtime.close()


def make_rig(
    handler: str,
    layout_kind: str = "flashinfer",
    *,
    num_blocks: int = 32,
    tier_blocks: int = 32,
    factor: int = 1,
    workers: int = 2,
    strategy: Strategy = Strategy.AUTO,
    seed: int = 0,
) -> Rig:
    if handler == "host":
        layout = build_layout(layout_kind, host_empty, num_blocks=num_blocks, seed=seed)
        tier = HostTier.for_layout(layout, tier_blocks, factor=factor)
        tier.memory.fill_(POISON)
        return Rig(
            handler, layout, tier, [HostCopyHandler(layout, tier, workers=workers)], Medium.CPU
        )
    runtime = FakeRuntime()
    layout = build_layout(layout_kind, runtime.empty, num_blocks=num_blocks, seed=seed)
    tier = pinned_host_tier(runtime, layout, tier_blocks, factor=factor)
    tier.memory.fill_(POISON)
    # two staging rows per buffer: multi-block jobs span several pieces
    cfg = DeviceHandlerConfig(strategy=strategy, staging_bytes=6 * layout.slot_bytes, streams=3)
    store, load = make_device_handlers(runtime, layout, tier, cfg)
    return Rig(handler, layout, tier, [store, load], Medium.GPU, runtime)


HANDLERS = ["host", "device"]


@pytest.fixture(params=HANDLERS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = make_rig(request.param)
    yield r
    r.close()


# --------------------------------------------------------------------------- rule 1


def test_a_job_that_writes_one_destination_twice_is_refused_at_submit(rig: Rig) -> None:
    with rig.engine() as engine:
        with pytest.raises(InvalidBlockIdsError, match="tier block 3 twice"):
            engine.submit_nowait(rig.store([1, 2], [3, 3]))
        with pytest.raises(InvalidBlockIdsError, match="cache block 5 twice"):
            engine.submit_nowait(rig.load([3, 4], [5, 5]))
        assert sum(h.submitted for h in engine.stats().handlers) == 0
        assert rig.tier_bytes(3) == bytes([POISON]) * rig.tier.slot_bytes
        # the engine keeps serving
        [r] = engine.wait([engine.submit_nowait(rig.store([1, 2], [3, 4]))], timeout=BOUND)
        assert r.success, r.error
    assert rig.tier_bytes(3) == cache_block_bytes(rig.layout, 1)


def test_sources_may_repeat(rig: Rig) -> None:
    with rig.engine() as engine:
        [r] = engine.wait([engine.submit_nowait(rig.store([3, 3], [0, 1]))], timeout=BOUND)
        assert r.success, r.error
        [r] = engine.wait([engine.submit_nowait(rig.load([0, 0], [7, 8]))], timeout=BOUND)
        assert r.success, r.error
    block3 = cache_block_bytes(rig.layout, 3)
    assert rig.tier_bytes(0) == rig.tier_bytes(1) == block3
    assert cache_block_bytes(rig.layout, 7) == cache_block_bytes(rig.layout, 8) == block3


@pytest.mark.parametrize("handler", HANDLERS)
def test_distinct_slots_of_one_tier_block_are_distinct_destinations(handler: str) -> None:
    """With a block factor, two groups may fill two slots of one tier block: allowed. The
    same slot twice is not."""
    rig = make_rig(handler, "groups", factor=2)
    try:
        with rig.engine() as engine:
            ok = rig.store([1, 2], [0, 0], group_sizes=(1, 1), block_indices=(0, 1))
            [r] = engine.wait([engine.submit_nowait(ok)], timeout=BOUND)
            assert r.success, r.error
            clash = rig.store([1, 2], [0, 0], group_sizes=(1, 1), block_indices=(1, 1))
            with pytest.raises(InvalidBlockIdsError, match=r"tier block 0 \(slot 1\) twice"):
                engine.submit_nowait(clash)
    finally:
        rig.close()


@pytest.mark.parametrize("handler", HANDLERS)
def test_groups_that_share_a_tensor_share_their_blocks(handler: str) -> None:
    """A load may write cache block 5 of two groups with separate tensors, but not of two
    groups over one tensor (a hybrid model's shared KV pages)."""
    separate = make_rig(handler, "groups")
    try:
        assert len(set(separate.layout.group_aliases)) == 2
        with separate.engine() as engine:
            spec = separate.load([0, 1], [5, 5], group_sizes=(1, 1))
            [r] = engine.wait([engine.submit_nowait(spec)], timeout=BOUND)
            assert r.success, r.error
    finally:
        separate.close()
    shared = make_rig(handler, "flashinfer")
    try:
        one = shared.layout
        shared.layout = KVLayout.combine([one, one])
        assert shared.layout.group_aliases == (0, 0)
        handler_obj = (
            HostCopyHandler(shared.layout, shared.tier)
            if handler == "host"
            else make_device_handlers(shared.runtime, shared.layout, shared.tier)[1]  # type: ignore[arg-type]
        )
        with pytest.raises(InvalidBlockIdsError, match="cache block 5 twice"):
            handler_obj.prepare(shared.load([0, 1], [5, 5], group_sizes=(1, 1)))
        handler_obj.prepare(shared.load([0, 1], [5, 6], group_sizes=(1, 1)))
    finally:
        shared.close()
