"""The one device handler on the NPU runtime (fake torch.npu with torch_npu's task queue, fake
libascendcl): real bytes, stream order, and the rules the CUDA handler keeps."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import pytest

from offload_engine import (
    ConfigError,
    EngineBrokenError,
    HostTier,
    JobTimeoutError,
    KVLayout,
    Medium,
    SyncOffloadingEngine,
    TransferError,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    npu_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.testing import (
    LAYOUT_KINDS,
    FakeAscend,
    FakeNpuError,
    FakeNpuRuntime,
    assert_exactly_once,
    build_layout,
    cache_block_bytes,
)
from offload_engine.vocabulary import Direction
from tests.test_device_handler import round_trip

COPYING = [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.AUTO]


@pytest.fixture
def rt() -> Iterator[FakeNpuRuntime]:
    runtime = FakeNpuRuntime()
    yield runtime
    runtime.close()


def staged(layout_slot_bytes: int, strategy: CopyStrategy, **kw: object) -> DeviceHandlerConfig:
    # two rows per staging buffer, so a job of a few blocks spans several pieces
    return DeviceHandlerConfig(strategy=strategy, staging_bytes=4 * layout_slot_bytes, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("strategy", COPYING)
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_round_trip_every_layout(
    rt: FakeNpuRuntime, kind: str, strategy: CopyStrategy, factor: int
) -> None:
    round_trip(rt, rt.empty, kind, strategy, factor)


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED])
def test_round_trip_one_acl_memcpy_per_copy(strategy: CopyStrategy, factor: int) -> None:
    rt = FakeNpuRuntime(FakeAscend(batch=False))
    try:
        round_trip(rt, rt.empty, "separate-kv", strategy, factor)
        assert rt.ascend.acl.batch_calls == [] and rt.ascend.acl.copy_calls
    finally:
        rt.ascend.close()


def test_descriptors_are_merged_then_sent_in_calls_of_at_most_max_batch() -> None:
    rt = FakeNpuRuntime(max_batch=5)
    try:
        layout = build_layout("cross-layer", rt.empty, num_blocks=32)
        tier = pinned_host_tier(rt, layout, 32)
        store, _ = make_device_handlers(
            rt, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.DMA)
        )
        calls = rt.ascend.acl.batch_calls
        with SyncOffloadingEngine([store]) as engine:
            # consecutive cache blocks into consecutive tier blocks: one merged copy
            spec = TransferSpec(npu_blocks(list(range(8))), cpu_blocks(list(range(8))))
            engine.wait([engine.submit(spec)])
            assert [c.count for c in calls] == [1]
            assert calls[0].sizes == calls[0].dest_maxs == (8 * layout.slot_bytes,)
            # every other block: 12 copies that continue nothing, in calls of at most 5
            spec = TransferSpec(npu_blocks(list(range(0, 24, 2))), cpu_blocks(list(range(12, 24))))
            engine.wait([engine.submit(spec)])
            assert [c.count for c in calls[1:]] == [5, 5, 2]
        assert all(
            tier.block(12 + i).numpy().tobytes() == cache_block_bytes(layout, 2 * i)
            for i in range(12)
        )
        tier.release()
    finally:
        rt.close()


def test_the_ascend_layout_moves_padded_rows_without_touching_the_padding(
    rt: FakeNpuRuntime,
) -> None:
    """Separate K and V tensors whose rows are over-allocated: only the block bytes move."""
    layout = build_layout("separate-kv", rt.empty, num_blocks=8)
    storages = [t.untyped_storage() for t in layout.tensors]
    before = [bytes(s) for s in storages]
    tier = pinned_host_tier(rt, layout, 4)
    store, load = make_device_handlers(
        rt, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.DMA)
    )
    want = cache_block_bytes(layout, 2)
    with SyncOffloadingEngine([store, load]) as engine:
        engine.wait([engine.submit(TransferSpec(npu_blocks([2]), cpu_blocks([1])))])
        engine.wait([engine.submit(TransferSpec(cpu_blocks([1]), npu_blocks([6])))])
    assert cache_block_bytes(layout, 6) == want
    block_bytes = layout.tensors[0][0].numel() * layout.tensors[0].element_size()
    for storage, old, t in zip(storages, before, layout.tensors, strict=True):
        new = bytes(storage)
        row = t.stride(0) * t.element_size()
        start = t.storage_offset() * t.element_size() + 6 * row
        # everything but block 6's bytes is as it was, the padding after it included
        assert (
            new[:start] == old[:start] and new[start + block_bytes :] == old[start + block_bytes :]
        )
    # the layout really has padded rows
    assert all(t.stride(0) * t.element_size() > block_bytes for t in layout.tensors)
    tier.release()


def test_there_is_no_kernel_strategy_on_ascend(rt: FakeNpuRuntime) -> None:
    layout = build_layout("separate-kv", rt.empty, num_blocks=4)
    tier = pinned_host_tier(rt, layout, 2)
    with pytest.raises(ConfigError, match="kernel strategy needs a npu copy kernel"):
        DeviceCopyHandler(
            rt,
            layout,
            tier,
            direction=Direction.STORE,
            config=DeviceHandlerConfig(strategy=CopyStrategy.KERNEL),
        )
    store, load = make_device_handlers(rt, layout, tier)
    assert (store.pair, load.pair) == ((Medium.NPU, Medium.CPU), (Medium.CPU, Medium.NPU))
    tier.release()


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED])
def test_a_store_waits_for_compute_writing_its_blocks(
    rt: FakeNpuRuntime, strategy: CopyStrategy
) -> None:
    layout = build_layout("separate-kv", rt.empty, num_blocks=8)
    tier = pinned_host_tier(rt, layout, 4)
    store, _ = make_device_handlers(rt, layout, tier, staged(layout.slot_bytes, strategy))
    gate = threading.Event()

    def model_writes_block_3() -> None:  # a kernel still running on the compute stream
        gate.wait()
        for t in layout.tensors:
            t[3].fill_(7.0)

    rt.ascend.compute(model_writes_block_3)
    with SyncOffloadingEngine([store]) as engine:
        job = engine.submit(TransferSpec(npu_blocks([3]), cpu_blocks([1])))
        with pytest.raises(TimeoutError):  # held behind the compute stream
            engine.wait([job], timeout=0.2)
        gate.set()
        [r] = engine.wait([job])
        assert r.success, r.error
    assert tier.memory[1].numpy().tobytes() == cache_block_bytes(layout, 3)
    assert all(bool((t[3] == 7.0).all()) for t in layout.tensors)
    tier.release()


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED])
def test_a_load_waits_for_compute_writing_its_destination(
    rt: FakeNpuRuntime, strategy: CopyStrategy
) -> None:
    layout = build_layout("separate-kv", rt.empty, num_blocks=8)
    tier = pinned_host_tier(rt, layout, 4)
    store, load = make_device_handlers(rt, layout, tier, staged(layout.slot_bytes, strategy))
    with SyncOffloadingEngine([store, load]) as engine:
        engine.wait([engine.submit(TransferSpec(npu_blocks([1]), cpu_blocks([0])))])
        want = tier.memory[0].numpy().tobytes()
        gate = threading.Event()

        def model_zeroes_block_5() -> None:  # pending writes to the load's destination
            gate.wait()
            for t in layout.tensors:
                t[5].zero_()

        rt.ascend.compute(model_zeroes_block_5)
        job = engine.submit(TransferSpec(cpu_blocks([0]), npu_blocks([5])))
        with pytest.raises(TimeoutError):
            engine.wait([job], timeout=0.2)
        gate.set()
        [r] = engine.wait([job])
        assert r.success, r.error
    assert cache_block_bytes(layout, 5) == want  # the load landed after the zeroing
    tier.release()


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED])
def test_jobs_of_a_direction_take_effect_and_finish_in_submission_order(
    rt: FakeNpuRuntime, strategy: CopyStrategy
) -> None:
    layout = build_layout("separate-kv", rt.empty, num_blocks=8)
    tier = pinned_host_tier(rt, layout, 4)
    store, _ = make_device_handlers(
        rt, layout, tier, staged(layout.slot_bytes, strategy, streams=3)
    )
    with SyncOffloadingEngine([store]) as engine:
        ids = [engine.submit(TransferSpec(npu_blocks([b]), cpu_blocks([0]))) for b in range(6)]
        results = engine.wait(ids)
    assert [r.job_id for r in results] == ids and all(r.success for r in results)
    # every job wrote tier block 0: the last one submitted wins
    assert tier.memory[0].numpy().tobytes() == cache_block_bytes(layout, 5)
    tier.release()


def gated_engine(
    rt: FakeNpuRuntime, jobs: int, max_inflight: int
) -> tuple[SyncOffloadingEngine, threading.Event, list[int], KVLayout, HostTier]:
    """Stores of blocks 0..jobs-1 to tier blocks 0..jobs-1, all held behind compute work."""
    layout = build_layout("separate-kv", rt.empty, num_blocks=jobs)
    tier = pinned_host_tier(rt, layout, jobs)
    store, _ = make_device_handlers(
        rt, layout, tier, staged(layout.slot_bytes, CopyStrategy.DMA, max_inflight=max_inflight)
    )
    gate = threading.Event()

    def model_runs() -> None:
        gate.wait()

    rt.ascend.compute(model_runs)
    engine = SyncOffloadingEngine([store])
    ids = [engine.submit(TransferSpec(npu_blocks([b]), cpu_blocks([b]))) for b in range(jobs)]
    return engine, gate, ids, layout, tier


def test_close_waits_for_jobs_still_queued_not_only_in_flight(rt: FakeNpuRuntime) -> None:
    engine, gate, ids, layout, tier = gated_engine(rt, 12, max_inflight=2)
    [h] = engine.stats().handlers
    assert h.queued >= 10 and h.in_flight <= 2  # most jobs have not reached the handler
    closed: list[list[TransferResult]] = []
    closer = threading.Thread(target=lambda: closed.append(engine.close()))
    closer.start()
    closer.join(timeout=0.2)
    assert closer.is_alive()  # close is waiting for the device
    gate.set()
    closer.join()
    [results] = closed
    assert sorted(r.job_id for r in results) == ids and all(r.success for r in results)
    assert all(tier.memory[b].numpy().tobytes() == cache_block_bytes(layout, b) for b in range(12))
    tier.release()


def test_wait_on_a_queued_job_waits_for_it_to_run(rt: FakeNpuRuntime) -> None:
    engine, gate, ids, layout, tier = gated_engine(rt, 8, max_inflight=1)
    [h] = engine.stats().handlers
    assert h.queued >= 6
    gate.set()
    [last] = engine.wait([ids[-1]])
    assert last.success
    assert tier.memory[7].numpy().tobytes() == cache_block_bytes(layout, 7)
    rest = engine.close()
    assert_exactly_once(ids, [last, *rest])
    tier.release()


def test_a_refused_batch_fails_its_job_and_later_jobs_run(rt: FakeNpuRuntime) -> None:
    layout = build_layout("separate-kv", rt.empty, num_blocks=8)
    tier = pinned_host_tier(rt, layout, 4)
    store, _ = make_device_handlers(
        rt, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.DMA)
    )
    with SyncOffloadingEngine([store]) as engine:
        rt.ascend.acl.fail_next_batch(rc=507000, fail_index=1)
        bad = engine.submit(TransferSpec(npu_blocks([1]), cpu_blocks([1])))
        good = engine.submit(TransferSpec(npu_blocks([2]), cpu_blocks([2])))
        r_bad, r_good = engine.wait([bad, good])
    assert not r_bad.success and isinstance(r_bad.error, TransferError)
    assert "aclError 507000" in str(r_bad.error) and "failIndex 1" in str(r_bad.error)
    assert r_good.success
    assert tier.memory[2].numpy().tobytes() == cache_block_bytes(layout, 2)
    tier.release()


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED])
def test_a_copy_failing_on_the_device_fails_its_job(
    rt: FakeNpuRuntime, strategy: CopyStrategy
) -> None:
    layout = build_layout("separate-kv", rt.empty, num_blocks=8)
    tier = pinned_host_tier(rt, layout, 4)
    store, _ = make_device_handlers(rt, layout, tier, staged(layout.slot_bytes, strategy))
    with SyncOffloadingEngine([store]) as engine:
        rt.ascend.acl.fail_next_copy()
        bad = engine.submit(TransferSpec(npu_blocks([1]), cpu_blocks([1])))
        good = engine.submit(TransferSpec(npu_blocks([2]), cpu_blocks([2])))
        r_bad, r_good = engine.wait([bad, good])
    assert isinstance(r_bad.error, TransferError) and isinstance(
        r_bad.error.__cause__, FakeNpuError
    )
    assert r_good.success
    tier.release()


def test_a_hung_copy_times_out_and_close_reports_the_device(rt: FakeNpuRuntime) -> None:
    layout = build_layout("separate-kv", rt.empty, num_blocks=8)
    tier = pinned_host_tier(rt, layout, 4)
    store, _ = make_device_handlers(
        rt, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.DMA, close_timeout=0.2)
    )
    engine = SyncOffloadingEngine([store])
    rt.ascend.acl.hang_next_copy()
    job = engine.submit(TransferSpec(npu_blocks([1]), cpu_blocks([1])), timeout=0.2)
    [r] = engine.wait([job], timeout=10)
    assert isinstance(r.error, JobTimeoutError)
    threads = list(store._launcher.threads)  # close empties the list when it gives up
    with pytest.raises(EngineBrokenError, match="hung"):
        engine.close(timeout=1)
    rt.ascend.acl.release_hangs()
    for thread in threads:
        thread.join(timeout=10)
    tier.release()


def test_many_threads_submit_and_collect_each_result_exactly_once(rt: FakeNpuRuntime) -> None:
    """The threading contract: submit from many threads while others collect; the store and
    load handlers' launcher threads call the runtime concurrently."""
    threads_n, per_thread = 6, 12
    blocks = threads_n * per_thread
    layout = build_layout("separate-kv", rt.empty, num_blocks=2 * blocks)
    tier = pinned_host_tier(rt, layout, blocks)
    store, load = make_device_handlers(
        rt, layout, tier, staged(layout.slot_bytes, CopyStrategy.STAGED)
    )
    submitted: list[int] = []
    collected: list[TransferResult] = []
    lock = threading.Lock()
    ids: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    errors: list[BaseException] = []

    with SyncOffloadingEngine([store, load]) as engine:

        def submitter(k: int) -> None:
            try:
                for i in range(per_thread):
                    b = k * per_thread + i
                    s = engine.submit(TransferSpec(npu_blocks([b]), cpu_blocks([b])))
                    # a load of the same tier block follows its store (jobs run in order per
                    # direction, and a load is only submitted once its store is done)
                    [r] = engine.wait([s])
                    job = engine.submit(TransferSpec(cpu_blocks([b]), npu_blocks([blocks + b])))
                    with lock:
                        submitted.extend([s, job])
                        collected.append(r)
                    ids.put(job)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def collector() -> None:
            try:
                while (job := ids.get()) is not None:
                    got = engine.wait([job])
                    with lock:
                        collected.extend(got)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        workers = [threading.Thread(target=submitter, args=(k,)) for k in range(threads_n)]
        collectors = [threading.Thread(target=collector) for _ in range(2)]
        for t in workers + collectors:
            t.start()
        for t in workers:
            t.join()
        for _ in collectors:
            ids.put(None)
        for t in collectors:
            t.join()
        assert engine.get_finished() == []
    assert errors == []
    assert_exactly_once(submitted, collected)
    assert all(r.success for r in collected)
    assert all(
        cache_block_bytes(layout, blocks + b) == cache_block_bytes(layout, b) for b in range(blocks)
    )
    assert len(submitted) == 2 * blocks
    tier.release()


def test_the_task_queue_really_defers_work(rt: FakeNpuRuntime) -> None:
    """The fake's torch_npu task queue holds work until something empties it, so the
    ordering tests above are not passing by luck."""
    ran = threading.Event()
    rt.ascend.compute(ran.set)
    assert rt.ascend.queued == 1 and not ran.is_set()
    rt.ascend.default_stream.synchronize()
    assert ran.is_set() and rt.ascend.queued == 0
