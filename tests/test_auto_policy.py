"""The ``auto`` copy strategy: one pure rule per job (layout, job size, backlog), the
strategy each job took in its result and the handler's stats, bit-exact either way."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from offload_engine import (
    ConfigError,
    KVLayout,
    Medium,
    SyncOffloadingEngine,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    npu_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.policy import AutoPolicy, choose_strategy
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.testing import (
    Allocator,
    FakeNpuRuntime,
    FakeRuntime,
    build_layout,
    cache_block_bytes,
)

DMA, STAGED = CopyStrategy.DMA, CopyStrategy.STAGED
KIB, MIB = 1 << 10, 1 << 20
#: the thresholds of the cases below (the defaults are checked in test_the_rule_in_words)
POLICY = AutoPolicy(
    dma_min_chunk_bytes=512 * KIB,
    dma_max_descriptors=2048,
    dma_backlog_bytes=128 * MIB,
    dma_backlog_descriptors=8192,
)


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("min_region", "descriptors", "backlog", "can_stage", "want"),
    [
        # cross-layer: one 2 MiB region a block moves at the link's rate as it is
        (2 * MIB, 512 * 1, 0, True, DMA),
        (2 * MIB, 10**6, 10 * MIB, True, DMA),
        (512 * KIB, 10**6, 0, True, DMA),  # the threshold itself is large enough
        # per-layer (64 regions of 32 KiB a block): a step's few blocks take dma
        (32 * KIB, 0, 0, True, DMA),  # an empty job
        (32 * KIB, 8 * 64, 0, True, DMA),
        (32 * KIB, 32 * 64, 0, True, DMA),  # exactly dma_max_descriptors
        (32 * KIB, 32 * 64 + 1, 0, True, STAGED),
        (32 * KIB, 64 * 64, 0, True, STAGED),
        (32 * KIB, 512 * 64, 0, True, STAGED),  # 32,768 descriptors
        # a saturated link: medium jobs of regions dma moves at the link's rate take
        # dma, large ones still stage
        (128 * KIB, 64 * 64, 128 * MIB - 1, True, STAGED),
        (128 * KIB, 64 * 64, 128 * MIB, True, DMA),
        (128 * KIB, 128 * 64, 1 << 30, True, DMA),  # exactly dma_backlog_descriptors
        (128 * KIB, 128 * 64 + 1, 1 << 30, True, STAGED),
        (128 * KIB, 512 * 64, 1 << 30, True, STAGED),
        # ... but smaller regions stage: dma would move them below the link's rate
        (128 * KIB - 1, 64 * 64, 1 << 30, True, STAGED),
        (32 * KIB, 64 * 64, 1 << 30, True, STAGED),
        # no staging memory or no planner: dma whatever the job
        (32 * KIB, 512 * 64, 0, False, DMA),
        (1, 10**9, 0, False, DMA),
    ],
)
def test_the_rule(
    min_region: int, descriptors: int, backlog: int, can_stage: bool, want: CopyStrategy
) -> None:
    got = choose_strategy(
        POLICY,
        min_region_bytes=min_region,
        descriptors=descriptors,
        backlog_bytes=backlog,
        can_stage=can_stage,
    )
    assert got is want


def test_a_backlog_allowance_below_the_idle_one_changes_nothing() -> None:
    policy = AutoPolicy(512 * KIB, 2048, 0, 16, 0)
    for descriptors, want in ((2048, DMA), (2049, STAGED)):
        got = choose_strategy(
            policy, min_region_bytes=KIB, descriptors=descriptors, backlog_bytes=1 << 40
        )
        assert got is want
    assert "<= 2048 while >= 0 B are in flight and every region is >= 0 B" in policy.describe()


def test_the_rule_in_words() -> None:
    assert AutoPolicy.of(DeviceHandlerConfig()).describe() == (
        "dma when every region is >= 512 KiB or a job needs <= 256 descriptors "
        "(<= 512 while >= 128 MiB are in flight and every region is >= 128 KiB), else staged"
    )
    assert POLICY.describe() == (
        "dma when every region is >= 512 KiB or a job needs <= 2048 descriptors "
        "(<= 8192 while >= 128 MiB are in flight and every region is >= 128 KiB), else staged"
    )
    assert "1000 B" in AutoPolicy(1000, 1, 3 * (1 << 30), 1).describe()
    assert "3 GiB" in AutoPolicy(1000, 1, 3 * (1 << 30), 1).describe()


@pytest.mark.parametrize(
    "key",
    [
        "dma_max_descriptors",
        "dma_backlog_bytes",
        "dma_backlog_descriptors",
        "dma_backlog_min_region_bytes",
    ],
)
@pytest.mark.parametrize("bad", [-1, 1.5, "8", None, True])
def test_the_thresholds_are_validated(key: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=key):
        DeviceHandlerConfig(**{key: bad})  # type: ignore[arg-type]


def test_zero_thresholds_are_valid() -> None:
    cfg = DeviceHandlerConfig(
        dma_max_descriptors=0,
        dma_backlog_bytes=0,
        dma_backlog_descriptors=0,
        dma_backlog_min_region_bytes=0,
    )
    assert AutoPolicy.of(cfg) == AutoPolicy(512 * KIB, 0, 0, 0, 0)


# ---------------------------------------------------------------- the handler


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


def regions_per_block(layout: KVLayout) -> int:
    return sum(len(g) for g in layout.groups)


def auto(layout: KVLayout, **kw: object) -> DeviceHandlerConfig:
    """``AUTO`` where a job of at most 2 blocks takes dma (two rows per staging
    buffer, so a staged job of a few blocks spans several pieces)."""
    fields: dict[str, object] = {
        "staging_bytes": 4 * layout.slot_bytes,
        "dma_max_descriptors": 2 * regions_per_block(layout),
        "dma_backlog_descriptors": 0,
    }
    fields.update(kw)
    return DeviceHandlerConfig(**fields)  # type: ignore[arg-type]


def cache_side(runtime: DeviceRuntime) -> Callable[..., Any]:
    return npu_blocks if runtime.medium is Medium.NPU else gpu_blocks


def round_trips(
    runtime: DeviceRuntime,
    cfg: DeviceHandlerConfig,
    jobs: list[list[int]],
    kind: str,
    empty: Allocator | None = None,
) -> tuple[list[TransferResult], list[TransferResult], tuple[tuple[str, int], ...]]:
    """Store each job's cache blocks into fresh tier slots, load them into other
    cache blocks, and compare bit for bit; the store and load results and the store
    handler's counts by strategy. ``empty`` allocates the KV cache (the fake
    runtime's memory unless given)."""
    cache = cache_side(runtime)
    layout = build_layout(kind, empty or runtime.empty, num_blocks=48, seed=7)  # type: ignore[attr-defined]
    tier = pinned_host_tier(runtime, layout, 24)
    store, load = make_device_handlers(runtime, layout, tier, cfg)
    groups = len(layout.groups)
    stores, loads, slot = [], [], 0
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            for src in jobs:  # the same block ids in every KV group
                n = len(src) * groups
                slots = list(range(slot, slot + n))
                slot += n
                sizes = (len(src),) * groups
                from_cache = cache(src * groups, group_sizes=sizes)
                to_cache = cache([24 + b for b in src] * groups, group_sizes=sizes)
                [s] = engine.wait([engine.submit(TransferSpec(from_cache, cpu_blocks(slots)))])
                [ld] = engine.wait([engine.submit(TransferSpec(cpu_blocks(slots), to_cache))])
                assert s.success and ld.success, (s.error, ld.error)
                stores.append(s)
                loads.append(ld)
                for g in range(groups):
                    for b in src:
                        got = cache_block_bytes(layout, 24 + b, g)
                        assert got == cache_block_bytes(layout, b, g)
            by_strategy = engine.stats().for_pair(runtime.medium, Medium.CPU).by_strategy
    finally:
        tier.release()
    return stores, loads, by_strategy


@pytest.mark.parametrize("kind", ["flash-attention", "groups", "separate-kv"])
def test_auto_takes_dma_for_a_small_job_and_staged_for_a_large_one(
    fake: FakeRuntime, kind: str
) -> None:
    layout = build_layout(kind, fake.empty, num_blocks=48)
    small, large = [3], [0, 5, 6, 7, 9, 11, 2]
    stores, loads, by_strategy = round_trips(fake, auto(layout), [small, large, [1, 4]], kind)
    assert [r.strategy for r in stores] == ["dma", "staged", "dma"]
    assert [r.strategy for r in loads] == ["dma", "staged", "dma"]
    assert by_strategy == (("dma", 2), ("staged", 1))


def test_auto_on_the_npu_runtime() -> None:
    rt = FakeNpuRuntime()
    try:
        layout = build_layout("separate-kv", rt.empty, num_blocks=48)
        stores, loads, _ = round_trips(rt, auto(layout), [[3], [0, 5, 6, 7, 9]], "separate-kv")
    finally:
        rt.close()
    assert [r.strategy for r in stores] == [r.strategy for r in loads] == ["dma", "staged"]


def test_auto_with_large_regions_never_stages(fake: FakeRuntime) -> None:
    layout = build_layout("cross-layer", fake.empty, num_blocks=48)
    cfg = auto(layout, dma_min_chunk_bytes=layout.slot_bytes, dma_max_descriptors=0)
    stores, _, by_strategy = round_trips(fake, cfg, [[3], list(range(10))], "cross-layer")
    assert [r.strategy for r in stores] == ["dma", "dma"]
    assert by_strategy == (("dma", 2),)
    assert fake.block_copies == 0


def test_auto_without_staging_memory_never_stages(fake: FakeRuntime) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=48)
    cfg = auto(layout, staging_bytes=0, dma_max_descriptors=0)
    stores, _, _ = round_trips(fake, cfg, [list(range(10))], "flash-attention")
    assert stores[0].strategy == "dma"
    assert fake.block_copies == 0


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL])
def test_an_explicit_strategy_takes_every_job(fake: FakeRuntime, strategy: CopyStrategy) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=48)
    # the auto thresholds would split these jobs; an explicit strategy ignores them
    cfg = auto(layout, strategy=strategy)
    stores, loads, by_strategy = round_trips(fake, cfg, [[3], list(range(10))], "flash-attention")
    assert {r.strategy for r in [*stores, *loads]} == {strategy.value}
    assert by_strategy == ((strategy.value, 2),)


def test_a_layer_wise_job_under_auto_stages_a_run_of_layers_and_sends_the_rest_by_dma(
    fake: FakeRuntime,
) -> None:
    """A layer-wise job is not the policy's to decide: a run of consecutive layers (here
    one layer's K and V, back to back in each slot) stages as one span per block;
    layers with gaps between them in the slot go region by region."""
    layout = build_layout("flash-attention", fake.empty, num_blocks=48, num_layers=3)
    tier = pinned_host_tier(fake, layout, 24)
    store, _ = make_device_handlers(fake, layout, tier, auto(layout, dma_max_descriptors=10**6))
    with SyncOffloadingEngine([store]) as engine:
        whole, run, gaps = engine.wait(
            [
                engine.submit(TransferSpec(gpu_blocks(range(6)), cpu_blocks(range(6)))),
                engine.submit(
                    TransferSpec(gpu_blocks(range(6)), cpu_blocks(range(6, 12)), tensors=(1,))
                ),
                engine.submit(
                    TransferSpec(gpu_blocks(range(6)), cpu_blocks(range(12, 18)), tensors=(0, 2))
                ),
            ]
        )
        assert engine.stats().for_pair(Medium.GPU, Medium.CPU).jobs_by("dma") == 2
    assert (whole.strategy, run.strategy, gaps.strategy) == ("dma", "staged", "dma")
    tier.release()


def test_a_backlog_on_the_link_makes_a_medium_job_take_dma(fake: FakeRuntime) -> None:
    """A store launched behind one still waiting (here: on the model's compute
    stream) takes dma up to ``dma_backlog_descriptors``; the same job on an idle
    handler stages."""
    layout = build_layout("flash-attention", fake.empty, num_blocks=48)
    tier = pinned_host_tier(fake, layout, 24)
    per_block = regions_per_block(layout)
    cfg = auto(
        layout,
        dma_max_descriptors=2 * per_block,
        dma_backlog_bytes=4 * layout.slot_bytes,
        dma_backlog_descriptors=8 * per_block,
        dma_backlog_min_region_bytes=0,  # the test layout's regions are small
    )
    store, _ = make_device_handlers(fake, layout, tier, cfg)
    gate = threading.Event()
    fake.enqueue(fake.compute, gate.wait)  # "a kernel" the first store waits for
    with SyncOffloadingEngine([store]) as engine:
        first = engine.submit(TransferSpec(gpu_blocks(range(4)), cpu_blocks(range(4))))
        medium = engine.submit(TransferSpec(gpu_blocks(range(4, 10)), cpu_blocks(range(4, 10))))
        deadline = time.monotonic() + 10
        while store._launched_bytes < 10 * layout.slot_bytes:  # both launched
            assert time.monotonic() < deadline
            time.sleep(0.001)
        gate.set()
        results = engine.wait([first, medium])
        # a job is handed back just after its result: wait for it
        while store._resources.finished_bytes < store._launched_bytes:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        [idle] = engine.wait(
            [engine.submit(TransferSpec(gpu_blocks(range(10, 16)), cpu_blocks(range(10, 16))))]
        )
    assert [r.strategy for r in [*results, idle]] == ["staged", "dma", "staged"]
    for slot in range(16):
        assert tier.block(slot).numpy().tobytes() == cache_block_bytes(layout, slot)
    tier.release()


@pytest.mark.parametrize("big_first", [True, False], ids=["staged-first", "dma-first"])
def test_jobs_take_effect_in_order_across_strategies(fake: FakeRuntime, big_first: bool) -> None:
    in_order_across_strategies(fake, fake.empty, big_first)


def in_order_across_strategies(runtime: DeviceRuntime, empty: Allocator, big_first: bool) -> None:
    """Jobs of one handler that take different strategies still write in
    submission order: each tier slot holds the block of the last store into it."""
    layout = build_layout("flash-attention", empty, num_blocks=48)
    tier = pinned_host_tier(runtime, layout, 24)
    store, _ = make_device_handlers(runtime, layout, tier, auto(layout, streams=3))
    jobs = []  # staged jobs of 6 blocks and dma jobs of 1, in turn, all from slot 0
    for k in range(8):
        big = (k % 2 == 0) == big_first
        jobs.append(list(range(6 * k, 6 * k + 6)) if big else [6 * k])
    with SyncOffloadingEngine([store]) as engine:
        ids = [engine.submit(TransferSpec(gpu_blocks(b), cpu_blocks(range(len(b))))) for b in jobs]
        results = engine.wait(ids)
    assert [r.strategy for r in results] == ["staged" if len(b) == 6 else "dma" for b in jobs]
    last: dict[int, int] = {}
    for b in jobs:
        last.update(enumerate(b))
    for slot, block in last.items():
        assert tier.block(slot).numpy().tobytes() == cache_block_bytes(layout, block)
    tier.release()
