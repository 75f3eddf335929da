"""The device handler on the fake runtime: real bytes, real stream ordering, in CI."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from offload_engine import (
    ConfigError,
    EngineBrokenError,
    InvalidBlockIdsError,
    JobTimeoutError,
    KVLayout,
    LayoutError,
    Medium,
    SyncOffloadingEngine,
    TransferError,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    npu_blocks,
)
from offload_engine.bench.step import LAUNCH_MODES
from offload_engine.device import (
    CopyStrategy,
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.plan import DevicePlan
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.host.layout import byte_view, merge_runs
from offload_engine.testing import (
    LAYOUT_KINDS,
    Allocator,
    FakeDeviceError,
    FakeRuntime,
    build_layout,
    cache_block_bytes,
)
from offload_engine.vocabulary import Direction
from tests.staged_reference import plan_runs

POISON = 0xA5


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


def config(strategy: CopyStrategy, layout: KVLayout, **kw: object) -> DeviceHandlerConfig:
    # two staging rows per buffer, so jobs of a few blocks span several pieces
    return DeviceHandlerConfig(strategy=strategy, staging_bytes=4 * layout.slot_bytes, **kw)  # type: ignore[arg-type]


def poison(layout: KVLayout, blocks: list[int]) -> None:
    for g in layout.groups:
        for r in g:
            base = byte_view(layout.tensors[r.tensor])
            for b in blocks:
                base[r.offset + b * r.stride : r.offset + b * r.stride + r.size].fill_(POISON)


def round_trip(
    runtime: DeviceRuntime,
    empty: Allocator,
    kind: str,
    strategy: CopyStrategy,
    factor: int,
    *,
    staging_blocks: int = 2,
    launch: str = "loop",
    native: bool | None = None,
) -> None:
    """Store random blocks (mid tier block, every group), load them elsewhere, compare
    bit for bit; destination blocks and tier start poisoned, and skipped slots stay so.
    The cache side is on the runtime's medium (GPU or NPU). ``native``: the
    ``native_launch`` setting (None: the default)."""
    cache_blocks = npu_blocks if runtime.medium is Medium.NPU else gpu_blocks
    layout = build_layout(kind, empty, num_blocks=24, seed=len(kind) + factor)
    groups = len(layout.groups)
    tier = pinned_host_tier(runtime, layout, 12, factor=factor)
    tier.memory.fill_(POISON)
    rng = np.random.default_rng(factor)
    n = 5
    sizes = (n,) * groups
    indices = (2,) * groups  # the job starts at logical block 2 of its request
    src = [int(x) for x in rng.choice(12, size=n * groups, replace=False)]
    dst = [12 + int(x) for x in rng.choice(12, size=n * groups, replace=False)]
    per_group = -(-(n + 2 % factor) // factor)
    tier_ids = [int(x) for x in rng.choice(12, size=per_group * groups, replace=False)]
    want = {b: cache_block_bytes(layout, b, i // n) for i, b in enumerate(src)}
    poison(layout, dst)
    cfg = DeviceHandlerConfig(
        strategy=strategy,
        staging_bytes=2 * staging_blocks * layout.slot_bytes,
        **LAUNCH_MODES[launch],
        **({} if native is None else {"native_launch": native}),
    )
    store, load = make_device_handlers(runtime, layout, tier, cfg)
    if native is not None:
        assert (store._native is not None) is native
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            s = engine.submit(
                TransferSpec(
                    cache_blocks(src, group_sizes=sizes, block_indices=indices),
                    cpu_blocks(tier_ids),
                )
            )
            [rs] = engine.wait([s])
            assert rs.success, rs.error
            assert rs.bytes_moved == n * sum(layout.group_bytes)
            ld = engine.submit(
                TransferSpec(
                    cpu_blocks(tier_ids),
                    cache_blocks(dst, group_sizes=sizes, block_indices=indices),
                )
            )
            [rl] = engine.wait([ld])
            assert rl.success, rl.error
        got = {
            s_: cache_block_bytes(layout, d_, i // n)
            for i, (s_, d_) in enumerate(zip(src, dst, strict=True))
        }
        assert got == want
        if factor > 1:  # the slots before the job's start were not written
            assert bool((tier.block(tier_ids[0])[: 2 % factor] == POISON).all())
    finally:
        tier.release()


@pytest.mark.parametrize("strategy", list(CopyStrategy))
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("launch", list(LAUNCH_MODES))
def test_round_trip_every_layout_and_strategy(
    fake: FakeRuntime, kind: str, strategy: CopyStrategy, factor: int, launch: str
) -> None:
    round_trip(fake, fake.empty, kind, strategy, factor, launch=launch)


def test_a_store_waits_for_compute_writing_its_blocks(fake: FakeRuntime) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    store, _ = make_device_handlers(fake, layout, tier, config(CopyStrategy.STAGED, layout))
    gate = threading.Event()
    k0 = layout.tensors[0]

    def model_writes_block_3() -> None:  # "a kernel" still running on the compute stream
        gate.wait()
        for t in layout.tensors:
            t[:, 3].fill_(7.0)

    fake.enqueue(fake.compute, model_writes_block_3)
    with SyncOffloadingEngine([store]) as engine:
        job = engine.submit(TransferSpec(gpu_blocks([3]), cpu_blocks([1])))
        with pytest.raises(TimeoutError):  # the store is held behind the compute stream
            engine.wait([job], timeout=0.2)
        gate.set()
        [r] = engine.wait([job])
        assert r.success
    assert tier.memory[1].numpy().tobytes() == cache_block_bytes(layout, 3)
    assert bool((k0[:, 3] == 7.0).all())
    tier.release()


def test_jobs_take_effect_in_submission_order(fake: FakeRuntime) -> None:
    layout = build_layout("flashinfer", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    store, load = make_device_handlers(
        fake, layout, tier, config(CopyStrategy.DMA, layout, streams=3)
    )
    with SyncOffloadingEngine([store, load]) as engine:
        ids = [engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([0]))) for b in range(6)]
        results = engine.wait(ids)
    assert [r.job_id for r in results] == ids
    # every job wrote tier block 0; the last one submitted wins
    assert tier.memory[0].numpy().tobytes() == cache_block_bytes(layout, 5)
    # and the jobs went round the stream pool
    assert len({c.stream for c in fake.batch_calls}) == 3
    tier.release()


@pytest.mark.parametrize("submitter", [False, True])
def test_small_jobs_launch_inline_only_when_the_launcher_is_idle(
    fake: FakeRuntime, submitter: bool
) -> None:
    layout = build_layout("flashinfer", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    store, _ = make_device_handlers(
        fake,
        layout,
        tier,
        config(CopyStrategy.STAGED, layout, inline_launch_blocks=2, submitter_launch=submitter),
    )
    gate = threading.Event()
    launched_by: list[tuple[int, str]] = []
    real = store._enqueue

    def held(plan: DevicePlan) -> None:
        launched_by.append((plan.units, threading.current_thread().name))
        if plan.units > 2:
            gate.wait()  # the big job is still being launched when the small one comes
        real(plan)

    store._enqueue = held  # type: ignore[method-assign]
    with SyncOffloadingEngine([store], thread_name="loop") as engine:
        big = engine.submit(TransferSpec(gpu_blocks([0, 1, 2]), cpu_blocks([0, 1, 2])))
        small = engine.submit(TransferSpec(gpu_blocks([5]), cpu_blocks([0])))
        with pytest.raises(TimeoutError):  # queued behind the big job, not launched ahead
            engine.wait([small], timeout=0.2)
        gate.set()
        assert all(r.success for r in engine.wait([big, small]))
        # the small job took effect after the big one: tier block 0 holds cache block 5
        assert tier.memory[0].numpy().tobytes() == cache_block_bytes(layout, 5)
        [late] = engine.wait([engine.submit(TransferSpec(gpu_blocks([6]), cpu_blocks([3])))])
        assert late.success
    assert tier.memory[3].numpy().tobytes() == cache_block_bytes(layout, 6)
    here = threading.current_thread().name if submitter else "loop"
    assert [(n, name.endswith("-launch")) for n, name in launched_by[:2]] == [(3, True), (1, True)]
    assert launched_by[2] == (1, here)  # the launcher was idle: launched without it
    tier.release()


def test_inline_launch_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="inline_launch_blocks"):
        DeviceHandlerConfig(inline_launch_blocks=-1)
    with pytest.raises(ConfigError, match="submitter_launch"):
        DeviceHandlerConfig(submitter_launch=1)  # type: ignore[arg-type]


def test_a_failed_copy_fails_its_job_and_later_jobs_run(fake: FakeRuntime) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    store, _ = make_device_handlers(fake, layout, tier, config(CopyStrategy.DMA, layout))
    with SyncOffloadingEngine([store]) as engine:
        fake.fail_next("copy")
        bad = engine.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
        good = engine.submit(TransferSpec(gpu_blocks([2]), cpu_blocks([2])))
        r_bad, r_good = engine.wait([bad, good])
    assert not r_bad.success and isinstance(r_bad.error, TransferError)
    assert isinstance(r_bad.error.__cause__, FakeDeviceError)
    assert r_good.success
    assert tier.memory[2].numpy().tobytes() == cache_block_bytes(layout, 2)
    tier.release()


def test_a_failed_gather_kernel_fails_its_job(fake: FakeRuntime) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    store, _ = make_device_handlers(fake, layout, tier, config(CopyStrategy.STAGED, layout))
    with SyncOffloadingEngine([store]) as engine:
        fake.fail_next("kernel")
        bad = engine.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
        good = engine.submit(TransferSpec(gpu_blocks([2]), cpu_blocks([2])))
        r_bad, r_good = engine.wait([bad, good])
    assert not r_bad.success and r_good.success
    tier.release()


@pytest.mark.parametrize("polled", [False, True], ids=["watcher", "polled"])
def test_a_failed_job_is_reported_once_the_rest_of_its_work_has_ended(
    fake: FakeRuntime, polled: bool
) -> None:
    # a staged store: its gather kernel fails, its DMA (which waits for the
    # gather) hangs; the failure is reported only after the DMA ends, since the
    # job's id buffer and events go back to the pools with the report
    layout = build_layout("flash-attention", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    store, _ = make_device_handlers(
        fake, layout, tier, config(CopyStrategy.STAGED, layout, polled_completion=polled)
    )
    with SyncOffloadingEngine([store]) as engine:
        fake.fail_next("kernel")
        fake.hang_next("copy")
        job = engine.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
        try:
            time.sleep(0.3)
            assert engine.get_finished() == []  # the hung DMA is still running
        finally:
            fake.release_hangs()
        [r] = engine.wait([job], timeout=10)
        assert not r.success and isinstance(r.error, TransferError)
        assert "injected kernel failure" in str(r.error.__cause__)
        [after] = engine.wait([engine.submit(TransferSpec(gpu_blocks([2]), cpu_blocks([2])))])
        assert after.success
    assert tier.memory[2].numpy().tobytes() == cache_block_bytes(layout, 2)
    tier.release()


def test_a_hung_copy_times_out_and_close_does_not_hang(fake: FakeRuntime) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    store, _ = make_device_handlers(
        fake, layout, tier, config(CopyStrategy.DMA, layout, close_timeout=0.2)
    )
    engine = SyncOffloadingEngine([store])
    fake.hang_next("copy")
    job = engine.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([1])), timeout=0.2)
    [r] = engine.wait([job], timeout=10)
    assert isinstance(r.error, JobTimeoutError)
    threads = list(store._launcher.threads)  # close empties the list when it gives up
    with pytest.raises(EngineBrokenError, match="hung"):
        engine.close(timeout=1)
    fake.release_hangs()  # lets the watcher thread go, so the fixture finds no thread
    for thread in threads:
        thread.join(timeout=10)
    tier.release()


def test_close_drains_in_flight_and_queued_device_work(fake: FakeRuntime) -> None:
    layout = build_layout("mla", fake.empty, num_blocks=16)
    tier = pinned_host_tier(fake, layout, 16)
    store, _ = make_device_handlers(
        fake, layout, tier, config(CopyStrategy.STAGED, layout, max_inflight=2)
    )
    engine = SyncOffloadingEngine([store])
    ids = [engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b]))) for b in range(16)]
    results = engine.close()
    assert sorted(r.job_id for r in results) == ids
    assert all(r.success for r in results)
    assert all(tier.memory[b].numpy().tobytes() == cache_block_bytes(layout, b) for b in range(16))
    tier.release()


def test_bad_ids_are_refused_at_submit_and_nothing_is_written(fake: FakeRuntime) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 4)
    tier.memory.fill_(POISON)
    store, load = make_device_handlers(fake, layout, tier)
    with SyncOffloadingEngine([store, load]) as engine:
        with pytest.raises(InvalidBlockIdsError, match="out of range"):
            engine.submit(TransferSpec(gpu_blocks([8]), cpu_blocks([0])))
        with pytest.raises(InvalidBlockIdsError, match="out of range"):
            engine.submit(TransferSpec(cpu_blocks([4]), gpu_blocks([0])))
        assert engine.stats().submitted == 0
    assert bool((tier.memory == POISON).all())
    assert fake.batch_calls == []
    tier.release()


def test_wrong_device_dtype_unpinned_or_disagreeing_shapes_are_refused(fake: FakeRuntime) -> None:
    host_layout = KVLayout.from_block_tensors([torch.zeros(4, 64)])  # not device memory
    dev_layout = build_layout("flash-attention", fake.empty, num_blocks=4)
    pinned = pinned_host_tier(fake, dev_layout, 2)
    with pytest.raises(LayoutError, match="not in fake device memory"):
        DeviceCopyHandler(fake, host_layout, pinned, direction=Direction.STORE)
    from offload_engine import HostTier

    with pytest.raises(LayoutError, match="not pinned"):
        DeviceCopyHandler(
            fake, dev_layout, HostTier.for_layout(dev_layout, 2), direction=Direction.STORE
        )
    with pytest.raises(LayoutError, match="must agree"):
        KVLayout.flash_attention(
            [
                fake.empty((2, 4, 16, 2, 32), torch.bfloat16),
                fake.empty((2, 4, 16, 2, 64), torch.bfloat16),
            ]
        )
    with pytest.raises(LayoutError, match="must agree"):
        KVLayout.flash_attention(
            [
                fake.empty((2, 4, 16, 2, 32), torch.bfloat16),
                fake.empty((2, 4, 16, 2, 32), torch.float16),
            ]
        )
    with pytest.raises(LayoutError, match=r"\(2, num_blocks"):
        KVLayout.flash_attention([fake.empty((3, 4, 16), torch.bfloat16)])
    pinned.release()


def test_strategy_configuration_is_checked(fake: FakeRuntime) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=4)
    tier = pinned_host_tier(fake, layout, 2)
    with pytest.raises(ConfigError, match="staging_bytes"):
        DeviceCopyHandler(
            fake,
            layout,
            tier,
            direction=Direction.STORE,
            config=DeviceHandlerConfig(
                strategy=CopyStrategy.STAGED, staging_bytes=layout.slot_bytes
            ),
        )
    no_kernel = FakeRuntime(kernel_copies=False)
    try:
        layout2 = build_layout("mla", no_kernel.empty, num_blocks=4)
        tier2 = pinned_host_tier(no_kernel, layout2, 2)
        with pytest.raises(ConfigError, match="kernel strategy"):
            DeviceCopyHandler(
                no_kernel,
                layout2,
                tier2,
                direction=Direction.LOAD,
                config=DeviceHandlerConfig(strategy=CopyStrategy.KERNEL),
            )
        tier2.release()
    finally:
        no_kernel.close()
    for bad in ({"streams": 0}, {"max_inflight": 0}, {"staging_bytes": -1}, {"close_timeout": 0}):
        with pytest.raises(ConfigError):
            DeviceHandlerConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DeviceHandlerConfig(strategy="dma")  # type: ignore[arg-type]
    tier.release()


def test_auto_picks_dma_for_large_chunks_and_staged_for_small(fake: FakeRuntime) -> None:
    """By the layout alone (a job needing any descriptor is "large" here): the
    strategy a job took is in its result (tests/test_auto_policy.py has the rest
    of the rule)."""
    small = build_layout("flash-attention", fake.empty, num_blocks=4)
    big = build_layout("cross-layer", fake.empty, num_blocks=4, num_layers=8, head_dim=128)
    for layout, want in ((small, CopyStrategy.STAGED), (big, CopyStrategy.DMA)):
        tier = pinned_host_tier(fake, layout, 4)
        cfg = DeviceHandlerConfig(dma_min_chunk_bytes=64 << 10, dma_max_descriptors=0)
        store, _ = make_device_handlers(fake, layout, tier, cfg)
        # a handler that may stage decides per job, at launch
        plan = store.prepare(TransferSpec(gpu_blocks([0]), cpu_blocks([0])))
        assert plan.strategy is (CopyStrategy.AUTO if want is CopyStrategy.STAGED else want)
        with SyncOffloadingEngine([store]) as engine:
            [r] = engine.wait([engine.submit(TransferSpec(gpu_blocks([0]), cpu_blocks([0])))])
        assert r.success and r.strategy == want.value
        tier.release()


def test_descriptors_are_merged_and_chunked_to_the_batch_cap() -> None:
    fake = FakeRuntime(max_batch=5)
    try:
        layout = build_layout("cross-layer", fake.empty, num_blocks=32)
        tier = pinned_host_tier(fake, layout, 32)
        store, _ = make_device_handlers(
            fake, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.DMA)
        )
        with SyncOffloadingEngine([store]) as engine:
            # consecutive cache blocks into consecutive tier blocks: one merged copy
            engine.wait([engine.submit(TransferSpec(gpu_blocks(range(8)), cpu_blocks(range(8))))])  # type: ignore[arg-type]
            assert fake.batch_calls[-1].count == 1
            assert fake.batch_calls[-1].sizes == (8 * layout.slot_bytes,)
            # scattered blocks: 12 descriptors in calls of at most 5
            before = len(fake.batch_calls)
            engine.wait(
                [
                    engine.submit(
                        TransferSpec(gpu_blocks(range(0, 24, 2)), cpu_blocks(range(12, 24)))
                    )
                ]  # type: ignore[arg-type]
            )
            counts = [c.count for c in fake.batch_calls[before:]]
            assert counts == [5, 5, 2]
        assert all(
            tier.block(12 + i).numpy().tobytes() == cache_block_bytes(layout, 2 * i)
            for i in range(12)
        )
        tier.release()
    finally:
        fake.close()


def test_without_a_batched_api_each_descriptor_is_its_own_call() -> None:
    fake = FakeRuntime(batched=False)
    try:
        layout = build_layout("flash-attention", fake.empty, num_blocks=8)
        tier = pinned_host_tier(fake, layout, 8)
        store, _ = make_device_handlers(
            fake, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.DMA)
        )
        with SyncOffloadingEngine([store]) as engine:
            engine.wait([engine.submit(TransferSpec(gpu_blocks([1, 5]), cpu_blocks([0, 3])))])
        # 2 blocks x 2 layers x (K, V), nothing adjacent on both sides
        assert [c.count for c in fake.batch_calls] == [1] * 8
        assert tier.memory[3].numpy().tobytes() == cache_block_bytes(layout, 5)
        tier.release()
    finally:
        fake.close()


def test_merge_runs_merges_only_what_continues_on_both_sides() -> None:
    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    dst, src, sizes = merge_runs(u(100, 110, 200, 210), u(0, 10, 20, 30), u(10, 10, 10, 10))
    assert dst.tolist() == [100, 200] and src.tolist() == [0, 20] and sizes.tolist() == [20, 20]
    dst, src, sizes = merge_runs(u(0, 10), u(0, 50), u(10, 10))
    assert sizes.tolist() == [10, 10]


def test_pinning_is_chunked_and_released() -> None:
    fake = FakeRuntime(pin_chunk_bytes=3 * 1024)
    try:
        layout = build_layout(
            "mla", fake.empty, num_blocks=4, num_layers=1, kv_heads=1, head_dim=32
        )
        tier = pinned_host_tier(fake, layout, 6)  # 6 rows of 1 KiB: two chunks of 3 rows
        assert len(fake.pin_calls) == 2
        assert all(size % layout.slot_bytes == 0 for _, size in fake.pin_calls)
        assert fake.is_pinned(tier.memory)
        tier.release()
        assert len(fake.unpin_calls) == 2
        tier.release()  # idempotent
        assert len(fake.unpin_calls) == 2
    finally:
        fake.close()


def test_handler_media_follow_the_runtime(fake: FakeRuntime) -> None:
    npu = FakeRuntime(Medium.NPU)
    try:
        layout = build_layout("separate-kv", npu.empty, num_blocks=4)
        tier = pinned_host_tier(npu, layout, 2)
        store, load = make_device_handlers(npu, layout, tier)
        assert store.pair == (Medium.NPU, Medium.CPU)
        assert load.pair == (Medium.CPU, Medium.NPU)
        tier.release()
    finally:
        npu.close()


@pytest.mark.parametrize(("batched", "sets"), [(True, 1), (False, 4)])
def test_one_stream_set_with_batched_copies_a_pool_without(batched: bool, sets: int) -> None:
    fake = FakeRuntime(batched=batched)
    try:
        layout = build_layout("flash-attention", fake.empty, num_blocks=16)
        tier = pinned_host_tier(fake, layout, 16)
        store, _ = make_device_handlers(
            fake, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.DMA)
        )
        with SyncOffloadingEngine([store]) as engine:
            engine.wait(
                [engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b]))) for b in range(8)]
            )
        assert len({c.stream for c in fake.batch_calls}) == sets
        tier.release()
    finally:
        fake.close()


def test_a_tier_is_unpinned_before_its_memory_is_dropped() -> None:
    from offload_engine import HostTier

    seen: list[bool] = []
    memory = torch.zeros(4, 64, dtype=torch.uint8)
    tier = HostTier(
        4, 64, memory=memory, pinned=True, release=lambda: seen.append(not tier.released)
    )
    del memory
    tier.release()
    assert seen == [True]  # the unpin ran while the tier still held its memory
    assert tier.released


@pytest.mark.parametrize("strategy", [CopyStrategy.STAGED, CopyStrategy.KERNEL])
def test_id_buffers_are_reused_once_their_job_is_done(
    fake: FakeRuntime, strategy: CopyStrategy
) -> None:
    layout = build_layout("flash-attention", fake.empty, num_blocks=160)
    tier = pinned_host_tier(fake, layout, 160)
    made: list[int] = []
    real = fake.new_id_buffer

    def counting(capacity: int) -> object:
        made.append(capacity)
        return real(capacity)

    fake.new_id_buffer = counting  # type: ignore[method-assign]
    store, load = make_device_handlers(fake, layout, tier, config(strategy, layout))
    want = {b: cache_block_bytes(layout, b) for b in range(8)}
    with SyncOffloadingEngine([store, load]) as engine:
        for b in range(8):  # one at a time: each job finds the last one's buffer free
            [r] = engine.wait([engine.submit(TransferSpec(gpu_blocks([b]), cpu_blocks([b])))])
            assert r.success, r.error
        assert made == [64]  # one small buffer served all eight
        # a job with more ids than any free buffer holds gets a larger one
        big = list(range(100))
        spec = TransferSpec(cpu_blocks(big), gpu_blocks([b + 50 for b in big]))
        [r] = engine.wait([engine.submit(spec)])
        assert r.success, r.error
        ids_per_block = 2 if strategy is CopyStrategy.KERNEL else 1  # cache ids, and slots
        assert len(made) == 2 and made[1] >= 100 * ids_per_block
    assert {b: cache_block_bytes(layout, b) for b in range(8)} == want
    for b in range(8):
        assert tier.memory[b].numpy().tobytes() == want[b]
    tier.release()


def test_merge_runs_returns_scattered_copies_as_they_are() -> None:
    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    dst, src, sizes = u(300, 100, 200), u(0, 50, 20), u(10, 10, 10)
    out = merge_runs(dst, src, sizes)
    assert [a.tolist() for a in out] == [[300, 100, 200], [0, 50, 20], [10, 10, 10]]


@pytest.mark.parametrize(
    ("slots", "descriptors"),
    [
        ([7, 6, 5, 4, 3, 2, 1, 0], [1]),  # a run handed out last-in first-out: descending
        ([0, 1, 2, 3, 11, 10, 9, 8], [2]),  # fresh slots ascending, then reused ones
        ([3, 9, 0, 6, 12, 15], [6]),  # scattered: one descriptor per slot
        (list(range(11, -1, -1)), [1, 1]),  # a run longer than a piece (8 staging rows)
        ([0, 1, 2, 5, 6, 7, 8, 9, 10, 14, 15], [2, 2]),  # run 5-10 is cut by the piece boundary
    ],
)
def test_staged_jobs_move_runs_of_consecutive_tier_slots_as_one_descriptor(
    fake: FakeRuntime, slots: list[int], descriptors: list[int]
) -> None:
    layout = build_layout("cross-layer", fake.empty, num_blocks=24)
    tier = pinned_host_tier(fake, layout, 16)
    cfg = DeviceHandlerConfig(strategy=CopyStrategy.STAGED, staging_bytes=16 * layout.slot_bytes)
    store, load = make_device_handlers(fake, layout, tier, cfg)
    cache = [int(b) for b in np.random.default_rng(1).permutation(12)[: len(slots)]]
    assert len(cache) == len(slots)
    back = [12 + b for b in range(len(slots))]
    poison(layout, back)
    with SyncOffloadingEngine([store, load]) as engine:
        [r] = engine.wait([engine.submit(TransferSpec(gpu_blocks(cache), cpu_blocks(slots)))])
        assert r.success
        stores = list(fake.batch_calls)
        [r] = engine.wait([engine.submit(TransferSpec(cpu_blocks(slots), gpu_blocks(back)))])
        assert r.success
        loads = fake.batch_calls[len(stores) :]
    assert [c.count for c in stores] == descriptors
    assert [c.count for c in loads] == descriptors
    for slot, block in zip(slots, cache, strict=True):
        assert tier.memory[slot].numpy().tobytes() == cache_block_bytes(layout, block)
    assert [cache_block_bytes(layout, b) for b in back] == [
        cache_block_bytes(layout, b) for b in cache
    ]
    tier.release()


@pytest.mark.parametrize("kind", ["cross-layer", "groups"])
def test_staged_runs_planned_per_job_are_merge_runs_per_piece(fake: FakeRuntime, kind: str) -> None:
    """The runs the reference staged planner plans once per job (``plan_runs``) are,
    piece by piece, exactly the descriptors ``merge_runs`` makes from that piece's
    tier and staging rows."""
    layout = build_layout(kind, fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 64)
    rng = np.random.default_rng(7)
    base = np.uint64(1 << 40)
    pitch = layout.slot_bytes
    merged = 0
    for trial in range(300):
        n = int(rng.integers(1, 40))
        rows_per = int(rng.integers(1, 12))
        group = trial % len(layout.groups)
        size = layout.group_bytes[group]
        # runs of consecutive slots, ascending or descending, between scattered ones
        slots: list[int] = []
        while len(slots) < n:
            start, length = int(rng.integers(0, 1000)), int(rng.integers(1, 9))
            run = list(range(start, start + length))
            slots += run[::-1] if rng.random() < 0.5 else run
        tier_rows = np.sort(np.array(slots[:n], dtype=np.uint64) * np.uint64(pitch))
        staging = SimpleNamespace(rows=rows_per, addresses=[int(base), int(base) + 5 * pitch])
        runs = plan_runs(layout, group, tier_rows, staging)  # type: ignore[arg-type]
        for k, lo in enumerate(range(0, n, rows_per)):
            hi = min(lo + rows_per, n)
            b = k % 2  # pieces take the staging buffers in turn
            at = np.uint64(staging.addresses[b])
            rows = at + np.arange(hi - lo, dtype=np.uint64) * np.uint64(pitch)
            sizes = np.full(hi - lo, size, dtype=np.uint64)
            want = merge_runs(tier_rows[lo:hi], rows, sizes)
            if runs is None:
                got = (tier_rows[lo:hi], rows, sizes)
            else:
                run_tier, run_rows, run_bytes, cuts = runs
                c0, c1 = cuts[k], cuts[k + 1]
                got = (run_tier[c0:c1], run_rows[b][c0:c1], run_bytes[c0:c1])
            merged += hi - lo - int(want[2].shape[0])
            for a, b in zip(got, want, strict=True):
                assert a.dtype == np.uint64
                assert a.tolist() == b.tolist()
    assert merged > 0  # the trials had runs to merge
    tier.release()
