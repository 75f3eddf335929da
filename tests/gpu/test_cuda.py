"""GPU tests: bit-exact round trips on a real CUDA device (skipped without one)."""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from offload_engine import ConfigError, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.testing import LAYOUT_KINDS, build_layout, cache_block_bytes
from offload_engine.vocabulary import Direction
from tests.test_auto_policy import auto, in_order_across_strategies, round_trips
from tests.test_device_handler import round_trip
from tests.test_polled_completion import Pair
from tests.test_tier_over import OTHER, POISON, outside_pages, region_for
from tests.test_tier_over import round_trip as region_round_trip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda() -> Iterator[object]:
    from offload_engine.device.runtimes.cuda import CudaRuntime

    yield CudaRuntime()


def gpu_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL])
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("factor", [1, 4])
def test_round_trip_on_the_gpu(
    cuda: object, kind: str, strategy: CopyStrategy, factor: int
) -> None:
    round_trip(cuda, gpu_empty, kind, strategy, factor)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL])
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("native", [True, False])
def test_round_trip_with_the_native_launch_on_and_off(
    cuda: object, kind: str, strategy: CopyStrategy, factor: int, native: bool
) -> None:
    round_trip(cuda, gpu_empty, kind, strategy, factor, native=native)  # type: ignore[arg-type]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kind", ["flash-attention", "groups", "separate-kv"])
def test_auto_takes_dma_and_staged_job_by_job_bit_exact(
    cuda: object, kind: str, native: bool
) -> None:
    layout = build_layout(kind, gpu_empty, num_blocks=48)
    jobs = [[3], [0, 5, 6, 7, 9, 11, 2], [1, 4]]
    stores, loads, by_strategy = round_trips(
        cuda,  # type: ignore[arg-type]
        auto(layout, native_launch=native),
        jobs,
        kind,
        empty=gpu_empty,
    )
    assert [r.strategy for r in stores] == [r.strategy for r in loads] == ["dma", "staged", "dma"]
    assert by_strategy == (("dma", 2), ("staged", 1))


@pytest.mark.parametrize("big_first", [True, False])
def test_auto_jobs_take_effect_in_order_across_strategies(cuda: object, big_first: bool) -> None:
    in_order_across_strategies(cuda, gpu_empty, big_first)  # type: ignore[arg-type]


@pytest.mark.parametrize("launch", ["submitter", "launcher", "submitter-polled"])
def test_native_launch_round_trip_in_every_launching_thread(cuda: object, launch: str) -> None:
    for strategy in (CopyStrategy.STAGED, CopyStrategy.KERNEL, CopyStrategy.DMA):
        round_trip(cuda, gpu_empty, "groups", strategy, 1, launch=launch, native=True)  # type: ignore[arg-type]
    round_trip(
        cuda, gpu_empty, "cross-layer", CopyStrategy.STAGED, 2, staging_blocks=3, native=True
    )  # type: ignore[arg-type]


def test_native_launch_without_the_batched_api() -> None:
    from offload_engine.device.runtimes.cuda import CudaRuntime

    runtime = CudaRuntime(batched=False)
    for strategy in (CopyStrategy.DMA, CopyStrategy.STAGED):
        round_trip(runtime, gpu_empty, "flash-attention", strategy, 1, native=True)


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL])
@pytest.mark.parametrize("launch", ["polled", "submitter-polled"])
def test_round_trip_with_polled_completion(
    cuda: object, strategy: CopyStrategy, launch: str
) -> None:
    round_trip(cuda, gpu_empty, "flashinfer", strategy, 4, launch=launch)  # type: ignore[arg-type]


def test_get_finished_finds_jobs_done_on_the_gpu_without_the_watcher(cuda: object) -> None:
    pair = Pair(cuda, gpu_empty, polled_completion=True, submitter_launch=True)
    try:
        with SyncOffloadingEngine(pair.handlers) as engine:
            for spec in (
                TransferSpec(gpu_blocks([1, 2, 4]), cpu_blocks([5, 3, 0])),
                TransferSpec(cpu_blocks([5, 3, 0]), gpu_blocks([6, 7, 3])),
            ):
                job = engine.submit_nowait(spec)
                results: list[object] = []
                deadline = time.monotonic() + 30
                while not results and time.monotonic() < deadline:
                    results = engine.get_finished()  # event queries, on this thread
                assert [(r.job_id, r.success) for r in results] == [(job, True)]  # type: ignore[attr-defined]
        assert pair.watched == []
        got = [cache_block_bytes(pair.layout, b) for b in (6, 7, 3)]
        assert got == [cache_block_bytes(pair.layout, b) for b in (1, 2, 4)]
    finally:
        pair.release()


def test_round_trip_without_the_batched_api() -> None:
    from offload_engine.device.runtimes.cuda import CudaRuntime

    round_trip(CudaRuntime(batched=False), gpu_empty, "flash-attention", CopyStrategy.DMA, 1)


def test_large_jobs_span_many_staging_pieces(cuda: object) -> None:
    round_trip(cuda, gpu_empty, "flash-attention", CopyStrategy.STAGED, 2, staging_blocks=3)  # type: ignore[arg-type]


def test_a_store_waits_for_the_compute_stream(cuda: object) -> None:
    layout = build_layout("flash-attention", gpu_empty, num_blocks=8)
    tier = pinned_host_tier(cuda, layout, 4)  # type: ignore[arg-type]
    for strategy in (CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL):
        store, _ = make_device_handlers(
            cuda,  # type: ignore[arg-type]
            layout,
            tier,
            DeviceHandlerConfig(strategy=strategy),
        )
        with SyncOffloadingEngine([store]) as engine:
            value = float(list(CopyStrategy).index(strategy) + 3)
            torch.cuda._sleep(200_000_000)  # the model is still busy on the compute stream...
            for t in layout.tensors:
                t[:, 3].fill_(value)  # ...before it writes block 3
            job = engine.submit(TransferSpec(gpu_blocks([3]), cpu_blocks([1])))
            [r] = engine.wait([job])
            assert r.success, r.error
        assert tier.memory[1].numpy().tobytes() == cache_block_bytes(layout, 3), strategy
    tier.release()


def test_legacy_default_stream_falls_back_to_single_copies(cuda: object) -> None:
    src = torch.randint(0, 255, (4, 4096), dtype=torch.uint8, device="cuda")
    host = torch.zeros(4, 4096, dtype=torch.uint8)
    release = cuda.pin_host(host)  # type: ignore[attr-defined]
    try:
        dst = np.array([host[i].data_ptr() for i in range(4)], dtype=np.uint64)
        srcp = np.array([src[3 - i].data_ptr() for i in range(4)], dtype=np.uint64)
        sizes = np.full(4, 4096, dtype=np.uint64)
        stream = torch.cuda.default_stream()
        calls = cuda.memcpy_batch(stream, dst, srcp, sizes, Direction.STORE)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert calls == 4
        assert torch.equal(host, src.flip(0).cpu())
        side = torch.cuda.Stream()
        host.zero_()
        calls = cuda.memcpy_batch(side, dst, srcp, sizes, Direction.STORE)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert calls == 1
        assert torch.equal(host, src.flip(0).cpu())
    finally:
        release()


@pytest.mark.parametrize("native", [False, True])
def test_a_refused_copy_fails_its_job_and_the_next_job_runs(cuda: object, native: bool) -> None:
    from offload_engine import TransferError

    layout = build_layout("flash-attention", gpu_empty, num_blocks=8)
    tier = pinned_host_tier(cuda, layout, 4)  # type: ignore[arg-type]
    for strategy in (CopyStrategy.DMA, CopyStrategy.STAGED):
        store, _ = make_device_handlers(
            cuda,  # type: ignore[arg-type]
            layout,
            tier,
            DeviceHandlerConfig(strategy=strategy, native_launch=native),
        )
        # the calls go to the runtime, or with the native launch to its program (whose
        # descriptors a staged job's planner writes in C: changed before its run)
        issuer: Any = store._native if native else cuda
        name = "run" if native else "memcpy_batch"
        with SyncOffloadingEngine([store]) as engine:
            real = getattr(issuer, name)
            calls = {"n": 0}

            def bogus_once(stream, dst, src, sizes, kind, calls=calls, real=real):  # type: ignore[no-untyped-def]
                calls["n"] += 1
                if calls["n"] == 1:  # a null source: the driver refuses the batch
                    src = np.zeros_like(src)
                return real(stream, dst, src, sizes, kind)

            def bogus_run_once(calls=calls, real=real, program=issuer):  # type: ignore[no-untyped-def]
                calls["n"] += 1
                if calls["n"] == 1:  # the job's one batch: [dst n][src n][sizes n]
                    n = program._ndesc // 3
                    program._desc[n : 2 * n] = 0
                return real()

            setattr(issuer, name, bogus_run_once if native else bogus_once)
            try:
                bad = engine.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([1])))
                good = engine.submit(TransferSpec(gpu_blocks([2]), cpu_blocks([2])))
                r_bad, r_good = engine.wait([bad, good])
            finally:
                delattr(issuer, name)
        assert not r_bad.success and isinstance(r_bad.error, TransferError)
        assert "cuMemcpyBatchAsync failed" in str(r_bad.error), r_bad.error
        assert r_good.success, r_good.error
        assert tier.memory[2].numpy().tobytes() == cache_block_bytes(layout, 2)
        tier.memory.zero_()
    tier.release()


def test_the_native_launch_is_on_by_default_where_it_builds(cuda: object) -> None:
    from offload_engine.device.config import NATIVE_LAUNCH_DEFAULT

    layout = build_layout("mla", gpu_empty, num_blocks=4)
    tier = pinned_host_tier(cuda, layout, 4)  # type: ignore[arg-type]
    store, _ = make_device_handlers(cuda, layout, tier)  # type: ignore[arg-type]
    assert (store._native is not None) is (NATIVE_LAUNCH_DEFAULT is not False), store.native_note
    store, _ = make_device_handlers(cuda, layout, tier, DeviceHandlerConfig(native_launch=True))  # type: ignore[arg-type]
    assert store._native is not None
    tier.release()


def test_pinned_tier_is_registered_and_released(cuda: object) -> None:
    layout = build_layout("mla", gpu_empty, num_blocks=4)
    tier = pinned_host_tier(cuda, layout, 8)  # type: ignore[arg-type]
    memory = tier.memory
    assert memory.is_pinned()
    tier.release()
    assert not memory.is_pinned()


@pytest.mark.parametrize("strategy", [CopyStrategy.STAGED, CopyStrategy.KERNEL])
@pytest.mark.parametrize("factor", [1, 4])
def test_round_trip_with_the_triton_kernel(strategy: CopyStrategy, factor: int) -> None:
    from offload_engine.device.runtimes.cuda import CudaRuntime

    runtime = CudaRuntime(use_nvrtc=False)  # the fallback where NVRTC is missing
    assert runtime._direct is None
    round_trip(runtime, gpu_empty, "flash-attention", strategy, factor)
    round_trip(runtime, gpu_empty, "groups", strategy, factor)


def test_block_copies_launch_the_nvrtc_kernel_directly(cuda: object) -> None:
    assert cuda._direct is not None, cuda.notes  # type: ignore[attr-defined]


def test_batched_copies_are_split_into_short_driver_calls(cuda: object) -> None:
    from offload_engine.device.runtimes.cuda import CALL_DESCRIPTORS

    n = 2 * CALL_DESCRIPTORS + 3
    src = torch.randint(0, 255, (n, 512), dtype=torch.uint8, device="cuda")
    host = torch.zeros(n, 512, dtype=torch.uint8)
    release = cuda.pin_host(host)  # type: ignore[attr-defined]
    try:
        order = np.random.default_rng(0).permutation(n)
        dst = np.array([host[i].data_ptr() for i in range(n)], dtype=np.uint64)
        srcp = np.array([src[int(j)].data_ptr() for j in order], dtype=np.uint64)
        sizes = np.full(n, 512, dtype=np.uint64)
        side = torch.cuda.Stream()
        calls = cuda.memcpy_batch(side, dst, srcp, sizes, Direction.STORE)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert calls == 3
        assert torch.equal(host, src[torch.from_numpy(order).cuda()].cpu())
    finally:
        release()


def test_the_model_step_pass_runs_every_mode_and_variant(cuda: object) -> None:
    from offload_engine.bench.step import StepPlan, StepShape, format_step_rows, run_step_pass

    plan = StepPlan(shape=StepShape(layers=1, context=64), blocks=(2,), steps=2, reps=1)
    ticks: list[str] = []
    rows = run_step_pass(cuda, plan, tick=ticks.append)  # type: ignore[arg-type]
    assert len(ticks) == plan.ticks
    assert len(rows) == len(plan.layouts) * len(plan.modes) * len(plan.variants)
    assert {(r.mode, r.stream) for r in rows} == set(plan.modes)
    assert {r.layout for r in rows} == set(plan.layouts) == {"per-layer", "cross-layer"}
    assert all(r.step_ms > 0 for r in rows)
    assert all(r.slowdown == 0 for r in rows if r.variant == "none")
    assert all(r.queue_full == 0 for r in rows)  # the engine's default capacity: no waits
    assert len(format_step_rows(rows)) == len(plan.layouts) * len(plan.modes)


def test_the_model_step_pass_waits_for_room_at_a_small_capacity(cuda: object) -> None:
    """With room for one job per handler, a step's submits find the queue full and wait
    for the oldest job of their direction; the pass finishes and counts the waits."""
    from offload_engine.bench.step import StepPlan, StepShape, run_step_pass

    plan = StepPlan(
        shape=StepShape(layers=1, context=64),
        blocks=(32,),
        modes=(("eager", "default"),),
        steps=4,
        reps=1,
        layouts=("cross-layer",),
        capacity=1,
    )
    rows = run_step_pass(cuda, plan)  # type: ignore[arg-type]
    waited = {r.variant: r.queue_full for r in rows}
    assert waited["none"] == waited["contiguous"] == 0
    assert waited["auto"] > 0 and waited["dma"] > 0


def test_the_ttft_pass_loads_layer_by_layer_bit_exact(cuda: object) -> None:
    """The time-to-first-token pass on the GPU at small sizes (bf16, 8 KV heads of 128, so
    SDPA's GPU kernels run): every row filled, every layer-wise load bit-exact."""
    from offload_engine.bench.ttft import (
        TtftDevice,
        TtftPlan,
        TtftShape,
        format_ttft_rows,
        run_ttft_pass,
    )

    plan = TtftPlan(
        shape=TtftShape(layers=4, hidden=512, intermediate=1024),
        hits=(64, 512),
        new=(16, 64),
        layers_per_load=(1, 3),
        reps=1,
    )
    rows = run_ttft_pass(TtftDevice.cuda(cuda), plan)  # type: ignore[arg-type]
    assert len(rows) == 4
    for r in rows:
        assert r["bit_exact"] and r["errors"] == [], r["errors"]
        assert r["load_ms"] > 0 and r["compute_ms"] > 0 and r["recompute_ms"] > 0
        assert all(t > 0 for t in r["layerwise_ms"].values())
        assert r["attention"] in ("sdpa-gqa", "sdpa-expanded")
    assert len(format_ttft_rows(rows)) == 6


@pytest.mark.parametrize("strategy", list(CopyStrategy))
@pytest.mark.parametrize("factor", [1, 3])
def test_a_tier_inside_an_mmap_region_is_registered_in_place(
    cuda: object, strategy: CopyStrategy, factor: int
) -> None:
    """What EngineTieringSpec does with vLLM's shared offload region: rank 1's pages of
    an mmap'd buffer become the tier, registered with CUDA as they are (never copied),
    round trips are bit-exact, other ranks' bytes stay untouched, and release
    unregisters the region."""
    layout = build_layout("flash-attention", gpu_empty, num_blocks=24, seed=factor)
    _, page, row_bytes = region_for(layout, 10, factor)
    region = mmap.mmap(-1, 10 * row_bytes)
    buffer = torch.frombuffer(region, dtype=torch.int8).view(10, row_bytes)
    buffer.fill_(OTHER)
    tier = pinned_host_tier(
        cuda,  # type: ignore[arg-type]
        layout,
        10,
        factor=factor,
        buffer=buffer,
        offset=page,
        page_bytes=page,
        block_stride=row_bytes,
    )
    try:
        assert tier.memory.data_ptr() == buffer.data_ptr() + page
        assert buffer.is_pinned()
        tier.memory.fill_(POISON)
        cfg = DeviceHandlerConfig(strategy=strategy, staging_bytes=4 * layout.slot_bytes)
        if strategy is CopyStrategy.KERNEL and factor > 1:
            with pytest.raises(ConfigError, match="evenly spaced tier slots"):
                make_device_handlers(cuda, layout, tier, cfg)  # type: ignore[arg-type]
            return
        handlers = list(make_device_handlers(cuda, layout, tier, cfg))  # type: ignore[arg-type]
        region_round_trip(layout, handlers, tier, gpu_blocks, factor)  # type: ignore[arg-type]
        assert bool((buffer[outside_pages(buffer, page, page)] == OTHER).all())
    finally:
        tier.release()
    assert not buffer.is_pinned()


def test_fewer_hardware_queues_are_noted_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from offload_engine.device.runtimes import cuda as cuda_module
    from offload_engine.runtimes import connections_note

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(cuda_module, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="offload_engine.cuda"):
        runtimes = [cuda_module.CudaRuntime(), cuda_module.CudaRuntime()]
    note = connections_note()
    assert note is not None and all(note in rt.notes for rt in runtimes)
    assert [r.getMessage() for r in caplog.records if r.name == "offload_engine.cuda"] == [note]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_engines_built_and_closed_in_a_row_leave_nothing_that_slows_the_next(
    cuda: object, mode: str
) -> None:
    """An embedder that rebuilds its engine (a reconfiguration, a reload) must not pay for
    the engines it closed: after each close no engine thread and no device memory is
    left, and the last engine of a row costs a GEMM step what the first one did. The step
    runs on a side stream taken from torch's pool before the first engine, and the row is
    longer than that pool (nine engines of four streams each): with pooled streams the
    last engines copied on the step's own stream."""
    import gc
    import threading

    layers = [
        torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(32)
    ]
    from offload_engine import KVLayout

    layout = KVLayout.flash_attention(layers)  # 2 MiB blocks of 64 KiB regions, as a decode step's
    tier = pinned_host_tier(cuda, layout, 64)  # type: ignore[arg-type]
    a = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(2048, 4096, dtype=torch.bfloat16, device="cuda")

    def gemms() -> None:
        for _ in range(8):
            torch.mm(a, b, out=c)

    graph = None
    if mode == "graph":  # captured before any engine thread exists
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            gemms()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
        with torch.cuda.graph(graph):
            gemms()
    rng = np.random.default_rng(0)
    step_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def median_step(engine: SyncOffloadingEngine | None) -> float:
        with torch.cuda.stream(step_stream):
            return steps_on_the_current_stream(engine)

    def steps_on_the_current_stream(engine: SyncOffloadingEngine | None, steps: int = 40) -> float:
        times, pending = [], set()
        for i in range(steps + 3):
            t0 = time.perf_counter()
            if engine is not None:
                pending.add(
                    engine.submit_nowait(
                        TransferSpec(
                            cpu_blocks(rng.choice(32, 8, replace=False) + 32),
                            gpu_blocks(rng.choice(32, 8, replace=False) + 32),
                        )
                    )
                )
            graph.replay() if graph is not None else gemms()
            if engine is not None:
                pending.add(
                    engine.submit_nowait(
                        TransferSpec(
                            gpu_blocks(rng.choice(32, 8, replace=False)),
                            cpu_blocks(rng.choice(32, 8, replace=False)),
                        )
                    )
                )
            torch.cuda.current_stream().synchronize()
            if engine is not None:
                done = engine.get_finished()
                assert all(r.success for r in done)
                pending -= {r.job_id for r in done}
            if i >= 3:
                times.append(time.perf_counter() - t0)
        if engine is not None:
            assert all(r.success for r in engine.wait(pending))
        return float(np.median(times))

    threads = threading.active_count()
    try:
        alone = median_step(None)
        # what earlier tests left to the collector would be freed in the middle of the row
        gc.collect()
        memory = torch.cuda.memory_allocated()  # with cuBLAS's workspace
        costs, left = [], []
        for strategy in ("dma", *["auto"] * 7, "dma"):
            config = DeviceHandlerConfig(strategy=CopyStrategy(strategy))
            engine = SyncOffloadingEngine(list(make_device_handlers(cuda, layout, tier, config)))  # type: ignore[arg-type]
            try:
                costs.append(median_step(engine) / alone - 1)
            finally:
                engine.close()
            assert threading.active_count() == threads
            gc.collect()
            left.append(torch.cuda.memory_allocated() - memory)
        # the runtime's own scratch (a few KiB, made on first use) stays; nothing per engine
        assert left == [left[0]] * len(left) and left[0] <= 64 << 10, left
        assert costs[-1] <= max(2 * costs[0], costs[0] + 0.05), costs
    finally:
        tier.release()


def test_an_engine_copies_on_streams_of_its_own(
    cuda: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch hands out its pooled streams in turn, 32 per priority, to everyone in the
    process: with pooled streams the ninth engine of a process copied on a stream a model
    had taken before, in line with the model's step (a graph step +70 %). The handlers'
    streams are made for them and destroyed at close."""
    from offload_engine import KVLayout
    from offload_engine.device.runtimes.cuda import CudaRuntime

    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(32)}  # type: ignore[no-untyped-call]
    made: list[int] = []
    new_stream = CudaRuntime.new_stream

    def spy(self: CudaRuntime, priority: int = 0) -> Any:
        stream = new_stream(self, priority)
        made.append(stream.cuda_stream)
        return stream

    monkeypatch.setattr(CudaRuntime, "new_stream", spy)
    layers = [torch.zeros(2, 16, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    layout = KVLayout.flash_attention(layers)
    tier = pinned_host_tier(cuda, layout, 16)  # type: ignore[arg-type]
    try:
        for _ in range(10):
            made.clear()
            engine = SyncOffloadingEngine(list(make_device_handlers(cuda, layout, tier)))  # type: ignore[arg-type]
            try:
                spec = TransferSpec(gpu_blocks([1, 2]), cpu_blocks([3, 4]))
                [r] = engine.wait([engine.submit(spec)])
                assert r.success
            finally:
                engine.close()
            # two handlers of one stream set each (an SM stream and two DMA streams), and
            # the runtime's own idle stream the first time
            assert len(set(made)) >= 6 and not set(made) & pooled
    finally:
        tier.release()


#: a process with a SIGTERM handler builds a CUDA runtime and an engine, moves blocks,
#: then waits on a queue for its handler as vLLM's idle engine core does
SIGTERM_AFTER_AN_ENGINE = """
import os, queue, signal, threading
import torch
from offload_engine import KVLayout, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device import make_device_handlers, pinned_host_tier
from offload_engine.device.runtimes.cuda import CudaRuntime

handled = queue.Queue()
signal.signal(signal.SIGTERM, lambda *_: handled.put("handled"))
runtime = CudaRuntime()
layers = [torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
layout = KVLayout.flash_attention(layers)
tier = pinned_host_tier(runtime, layout, 64)
engine = SyncOffloadingEngine(list(make_device_handlers(runtime, layout, tier)))
jobs = [TransferSpec(gpu_blocks(range(n)), cpu_blocks(range(n))) for n in (1, 8, 40)]
assert all(r.success for r in engine.wait([engine.submit(j) for j in jobs]))
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
print(handled.get())
engine.close()
tier.release()
"""


def test_a_process_that_built_an_engine_still_hears_its_sigterm() -> None:
    """Under vLLM on an H200 the engine core ignored its SIGTERM and was killed after the
    shutdown's grace, so the connector's close and its final counters never ran: the
    CUDA runtime's start had left SIGTERM's action with ``SA_RESTART`` (tests/test_signals.py)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-c", SIGTERM_AFTER_AN_ENGINE],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "handled", done.stderr[-3000:]


def test_the_launch_gap_pass_measures_every_variant(cuda: object) -> None:
    from offload_engine.bench.gaps import GapPlan, format_gap_rows, run_gap_pass

    plan = GapPlan(blocks=(2,), strategies=("dma",), seconds=0.1, reps=1)
    rows = run_gap_pass(cuda, plan)  # type: ignore[arg-type]
    assert [(r.variant, r.blocks) for r in rows] == [("none", 2), ("dma", 2)]
    assert rows[0].jobs_per_s == 0 and rows[1].jobs_per_s > 0
    assert all(0 < r.p50_us <= r.p99_us <= r.max_us for r in rows)
    assert len(format_gap_rows(rows)) == 4
