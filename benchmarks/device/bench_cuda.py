"""GPU <-> host transfer benchmark through the engine (run on a CUDA machine).

    python benchmarks/device/bench_cuda.py [--json out.json] [--quick]

Workload: a Llama-3-8B-like KV cache, 32 layers, K and V per layer
(FlashAttention layout), 8 KV heads x 128 dims, bf16; blocks of 16 tokens
(a 32 KiB chunk per layer and K/V, 2 MiB per block) and of 64 tokens (8 MiB
per block). Jobs of 8, 64 and 512 blocks go through a SyncOffloadingEngine
with the store and load handlers, back to back; GB/s counts the job bytes
from the first submit to the last result.

Pass 1: store, load, and store + load at once, per strategy, with the ratio to
a contiguous pinned copy of the same size measured in the same run (one
direction, and both directions at once).
Pass 2: the same 512-block store and load while a bf16 GEMM loop runs on
another stream: transfer ratio to the ceiling and the GEMM's slowdown, beside
the same bytes as one contiguous pinned copy under the same GEMM (the floor;
``--gemm-variants``), with one or two rounds of jobs in flight
(``--gemm-inflight``). The variant ``pieces`` issues a staged job's device work
from a plain loop, no engine: 128 MiB pieces of 64 random tier slots, each one
batched copy on one of two DMA streams in turn and an ``index_copy_`` (a load) or
``index_select`` (a store) between a staging buffer and a (blocks, slot) cache on a
high-priority stream, two staging buffers; it tells the engine's own cost from
that of the work any staged load or store does.
Pass 3: CPU microseconds per job in submit (the caller's thread) and in launch
(the handler's launcher thread: descriptors and driver calls), measured as
thread CPU time.
Pass 4 (``step``): a decode-like model step's slowdown while each step stores
and loads 4, 16 and 32 blocks, with the blocks in a per-layer and in a cross-layer
KV cache (``--step-layouts``), eager and as a CUDA graph, on the default and a side
stream, against the same bytes as one contiguous pinned copy (the floor); a submit
that finds its queue full waits for the oldest job of its direction and is counted
(:mod:`offload_engine.bench.step` documents the step). ``--step-figure`` draws the
slowdown against blocks per step, with the floor.
Pass ``gaps``: the gaps between a Python thread's kernel launches while one store and one
load of 8, 64 and 512 blocks are kept in flight, against the same loop with no engine
(:mod:`offload_engine.bench.gaps` documents it).
Pass 5 (``ttft``): time to first token of a Llama-3-8B-shaped prefill whose prefix
hit of H tokens sits in the pinned tier, N new tokens: load then compute, layer by
layer (one job per ``--ttft-layers-per-load`` layers, the compute stream waiting on
each part's fence), recompute, the load alone and the compute alone, and two floors
without the engine (:mod:`offload_engine.bench.ttft` documents it); the layer-wise
loads are checked bit-exact first, and a mismatch makes the script exit 1.
``--ttft-strategy dma`` moves the parts by DMA straight into the cache's blocks (one
descriptor per layer and block, no SM work) instead of staging them.
Pass ``ttft-stores``: the same prefill (H tokens in the cache, N new) with its new
blocks stored into the pinned tier, after the forward pass (s1) or one job per
``--ttft-layers-per-load`` layers as they finish (s2): the prefill's time with the
stores in flight against the prefill alone, and the time until the last store is done
(:mod:`offload_engine.bench.ttft_stores` documents it); the layer-wise stores are
checked bit-exact first, and a mismatch makes the script exit 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload_engine import KVLayout, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.bench.slots import allocator_slots
from offload_engine.bench.step import LAUNCH_MODES
from offload_engine.device import (
    CopyStrategy,
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes.cuda import CudaRuntime
from offload_engine.vocabulary import Direction

LAYERS, HEADS, DIM = 32, 8, 128


def contiguous_ceiling(runtime: CudaRuntime, nbytes: int, reps: int = 5) -> dict[str, float]:
    """The best GB/s of a contiguous pinned copy, each way and both ways at once.

    Two variants, best taken: one torch copy per direction, and the same bytes as
    64 MiB pieces through the batched driver call on two streams per direction.
    """
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(4)]
    piece = 64 << 20
    offs = np.arange(0, nbytes, piece, dtype=np.uint64)
    sizes = np.full(offs.shape[0], piece, dtype=np.uint64)

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def torch_copy(direction: str) -> None:
        if direction == "store":
            with torch.cuda.stream(streams[0]):
                host[0].copy_(dev[0], non_blocking=True)
        else:
            with torch.cuda.stream(streams[1]):
                dev[1].copy_(host[1], non_blocking=True)

    def batched(direction: str) -> None:
        d = np.uint64(dev[0 if direction == "store" else 1].data_ptr()) + offs
        h = np.uint64(host[0 if direction == "store" else 1].data_ptr()) + offs
        kind = Direction.STORE if direction == "store" else Direction.LOAD
        dst, src = (h, d) if direction == "store" else (d, h)
        base = 0 if direction == "store" else 2
        for k in range(2):
            runtime.memcpy_batch(streams[base + k], dst[k::2], src[k::2], sizes[k::2], kind)

    out: dict[str, float] = {}
    for case in ("store", "load"):
        out[case] = max(
            nbytes / timed(lambda c=case: torch_copy(c)) / 1e9,
            nbytes / timed(lambda c=case: batched(c)) / 1e9,
        )
    out["both"] = max(
        2 * nbytes / timed(lambda: (torch_copy("store"), torch_copy("load"))) / 1e9,
        2 * nbytes / timed(lambda: (batched("store"), batched("load"))) / 1e9,
    )
    return out


class Bench:
    streams: int | None = None
    max_inflight: int = 8  # the value every recorded run used (the config's default is 16)

    def __init__(self, runtime: CudaRuntime, tokens: int, num_blocks: int) -> None:
        self.runtime = runtime
        self.tokens = tokens
        layers = [
            torch.randn(2, num_blocks, tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
        self.layout = KVLayout.flash_attention(layers)
        self.num_blocks = num_blocks
        self.tier = pinned_host_tier(runtime, self.layout, num_blocks)
        self.block_bytes = self.layout.slot_bytes

    def engine(
        self,
        strategy: CopyStrategy,
        buffers: int = 2,
        staging: int = 256 << 20,
        launch: str = "loop",
    ) -> tuple[SyncOffloadingEngine, DeviceCopyHandler, DeviceCopyHandler]:
        cfg = DeviceHandlerConfig(
            strategy=strategy,
            staging_bytes=staging,
            staging_buffers=buffers,
            max_inflight=self.max_inflight,
            streams=self.streams,
            **LAUNCH_MODES[launch],
        )
        store, load = make_device_handlers(self.runtime, self.layout, self.tier, cfg)
        return SyncOffloadingEngine([store, load], capacity=100_000), store, load

    def specs(
        self, direction: str, per_job: int, jobs: int, slots: str = "random"
    ) -> list[TransferSpec]:
        """``slots``: ``random`` tier slots, or ``allocator``: as vLLM's CPU offloading
        manager hands them out (see :func:`allocator_slots`)."""
        half = self.num_blocks // 2
        rng = np.random.default_rng(per_job)
        tiers = allocator_slots(half, per_job, jobs) if slots == "allocator" else None
        out = []
        for j in range(jobs):
            cache = rng.choice(half, size=per_job, replace=False)
            tier = tiers[j] if tiers is not None else rng.choice(half, size=per_job, replace=False)
            if direction == "store":
                out.append(TransferSpec(gpu_blocks(cache), cpu_blocks(tier)))
            else:  # loads read the other half of the tier into the other half of the cache
                out.append(TransferSpec(cpu_blocks(tier + half), gpu_blocks(cache + half)))
        return out

    def run(self, engine: SyncOffloadingEngine, specs: list[TransferSpec]) -> float:
        """Seconds from the first submit to the last result (no device-wide sync: a
        concurrent GEMM stream must not gate it)."""
        t0 = time.perf_counter()
        ids = [engine.submit(s) for s in specs]
        results = engine.wait(ids)
        seconds = time.perf_counter() - t0
        failed = [r for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} jobs failed: {failed[0].error}")
        return seconds


def jobs_for(per_job: int, block_bytes: int, target_bytes: int) -> int:
    return max(2, target_bytes // (per_job * block_bytes))


def pass_bandwidth(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    runtime = CudaRuntime()
    for tokens, num_blocks in ((16, 1536), (64, 1152)):
        if tokens not in args.tokens:
            continue
        bench = Bench(runtime, tokens, num_blocks)
        target = (1 << 30) if args.quick else (4 << 30)
        ceiling = contiguous_ceiling(runtime, 1 << 30)
        print(f"[{tokens}-token blocks] contiguous ceiling: {ceiling}", flush=True)
        for strategy, launch in [(s, m) for s in args.strategies for m in args.bandwidth_launch]:
            engine, _, _ = bench.engine(strategy, launch=launch)
            # where small jobs launch, beside the engine's loop (the default)
            label = strategy.value if launch == "loop" else f"{strategy.value}/{launch}"
            try:
                for per_job, slots in [(b, k) for b in args.per_job for k in args.slots]:
                    n = jobs_for(per_job, bench.block_bytes, target)
                    per = n * per_job * bench.block_bytes
                    stores = bench.specs("store", per_job, n, slots)
                    loads = bench.specs("load", per_job, n, slots)
                    bench.run(engine, stores[:2] + loads[:2])  # warm up (Triton compiles once)
                    samples: dict[str, list[float]] = {"store": [], "load": [], "both": []}
                    for _ in range(args.reps):
                        samples["store"].append(per / bench.run(engine, stores))
                        samples["load"].append(per / bench.run(engine, loads))
                        mixed = [s for pair in zip(stores, loads, strict=True) for s in pair]
                        samples["both"].append(2 * per / bench.run(engine, mixed))
                    for case, values in samples.items():
                        gbps = statistics.median(values) / 1e9
                        rows.append(
                            {
                                "pass": "bandwidth",
                                "tokens": tokens,
                                "blocks_per_job": per_job,
                                "slots": slots,
                                "strategy": label,
                                "case": case,
                                "gbps": gbps,
                                "ceiling_gbps": ceiling[case],
                                "ratio": gbps / ceiling[case],
                            }
                        )
                        print(
                            f"  {label:7} {per_job:4} blocks {slots:9} {case:5} "
                            f"{gbps:6.1f} GB/s "
                            f"ratio {gbps / ceiling[case]:.3f}",
                            flush=True,
                        )
            finally:
                engine.close()
        bench.tier.release()
        del bench
        torch.cuda.empty_cache()


def pass_gemm(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    runtime = CudaRuntime()
    bench = Bench(runtime, 16, 1536)
    ceiling = contiguous_ceiling(runtime, 1 << 30)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_stream = torch.cuda.Stream()

    def gemm_seconds(count: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(gemm_stream):
            start.record()
            for _ in range(count):
                torch.mm(a, b)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    gemm_seconds(20)
    count = 150 if args.quick else 400
    alone = statistics.median(gemm_seconds(count) for _ in range(3))
    tflops = 2 * n**3 * count / alone / 1e12
    print(f"GEMM alone: {alone * 1e3:.1f} ms for {count} ({tflops:.0f} TFLOP/s)", flush=True)
    mib = 1 << 20
    variants = [_gemm_variant(v) for v in args.gemm_variants.split(",")]
    round_bytes = 2 * 512 * bench.block_bytes  # two 512-block jobs per round
    floor: dict[str, float] = {}
    for strategy, buffers, staging in variants:
        if strategy == "contiguous":
            transfer, label, engine = _contiguous_rounds(round_bytes), strategy, None
        elif strategy == "pieces":
            transfer, label, engine = _piece_rounds(runtime, bench, round_bytes), strategy, None
        else:
            engine, _, _ = bench.engine(strategy, buffers, staging)
            transfer = _engine_rounds(bench, engine, args.gemm_inflight)
            label = f"{strategy.value} {staging // mib}MiB/{buffers}"
        try:
            for case in ("store", "load"):
                step = transfer(case)
                step()  # warm up
                stop = threading.Event()
                moved = [0.0, 0.0]  # bytes, seconds

                def transfers() -> None:
                    t0 = time.perf_counter()
                    rounds = 0
                    while not stop.is_set():  # noqa: B023 - the loop's own event
                        rounds += step()  # noqa: B023
                    moved[0], moved[1] = rounds * round_bytes, time.perf_counter() - t0  # noqa: B023

                worker = threading.Thread(target=transfers)
                worker.start()
                with_tx = gemm_seconds(count)
                stop.set()
                worker.join()
                gbps = moved[0] / moved[1] / 1e9
                if strategy == "contiguous":
                    floor[case] = gbps
                row = {
                    "pass": "gemm",
                    "strategy": label,
                    "inflight": 0 if engine is None else args.gemm_inflight,
                    "case": case,
                    "gbps": gbps,
                    "ratio": gbps / ceiling[case],
                    "floor_ratio": gbps / floor[case] if case in floor else None,
                    "gemm_slowdown": with_tx / alone - 1,
                }
                rows.append(row)
                vs_floor = (
                    f", {row['floor_ratio']:.3f} of the copy under the GEMM"
                    if row["floor_ratio"] is not None
                    else ""
                )
                print(
                    f"  {label:17} {case:5} with GEMM: {gbps:6.1f} GB/s ratio "
                    f"{row['ratio']:.3f}{vs_floor}, GEMM slowdown "
                    f"{row['gemm_slowdown'] * 100:+.1f}%",
                    flush=True,
                )
        finally:
            if engine is not None:
                engine.close()
    bench.tier.release()


def _gemm_variant(text: str) -> tuple[Any, int, int]:
    """``contiguous`` (the same bytes as one pinned copy: the floor under the GEMM),
    ``pieces`` (a staged job's device work without the engine), or
    ``strategy:staging_mib:buffers``."""
    if text in ("contiguous", "pieces"):
        return text, 0, 0
    strategy, staging, buffers = text.split(":")
    return CopyStrategy(strategy), int(buffers), int(staging) << 20


def _contiguous_rounds(nbytes: int) -> Any:
    """One contiguous pinned copy of ``nbytes`` per round, on its own stream; waits
    on its own event (no device-wide sync: the GEMM stream must not gate it)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()

    def rounds(case: str) -> Any:
        def step() -> int:
            with torch.cuda.stream(stream):
                if case == "store":
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            done.synchronize()
            return 1

        return step

    return rounds


def _piece_rounds(runtime: CudaRuntime, bench: Bench, nbytes: int) -> Any:
    """A staged job's device work from a plain loop (see the module doc): ``nbytes``
    per round in pieces of 64 random slots of ``bench``'s tier; waits on its own
    events (no device-wide sync: the GEMM stream must not gate it)."""
    slot, rows = bench.block_bytes, 64
    tier = bench.tier.memory
    cache = torch.empty(bench.num_blocks, slot, dtype=torch.uint8, device="cuda")
    staging = [torch.empty(rows, slot, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dmas = [torch.cuda.Stream() for _ in range(2)]
    sm = torch.cuda.Stream(priority=-1)
    rng = np.random.default_rng(0)
    half = bench.num_blocks // 2
    pieces = []
    for p in range(nbytes // (rows * slot)):
        slots = np.sort(rng.choice(half, rows, replace=False)).astype(np.uint64)
        rows_at = np.uint64(staging[p % 2].data_ptr()) + np.arange(
            rows, dtype=np.uint64
        ) * np.uint64(slot)
        ids = torch.from_numpy(rng.choice(bench.num_blocks, rows, replace=False)).cuda()
        pieces.append((np.uint64(tier.data_ptr()) + slots * np.uint64(slot), rows_at, ids))
    sizes = np.full(rows, slot, dtype=np.uint64)

    def rounds(case: str) -> Any:
        store = case == "store"
        kind = Direction.STORE if store else Direction.LOAD

        def step() -> int:
            free: list[Any] = [None, None]  # each staging buffer's last use
            for p, (host, rows_at, ids) in enumerate(pieces):
                b = p % 2
                dma = dmas[b]
                if free[b] is not None:
                    (sm if store else dma).wait_event(free[b])
                if store:
                    with torch.cuda.stream(sm):
                        torch.index_select(cache, 0, ids, out=staging[b])
                    dma.wait_stream(sm)
                    runtime.memcpy_batch(dma, host, rows_at, sizes, kind)
                else:
                    runtime.memcpy_batch(dma, rows_at, host, sizes, kind)
                    sm.wait_stream(dma)
                    with torch.cuda.stream(sm):
                        cache.index_copy_(0, ids, staging[b])
                free[b] = torch.cuda.Event()
                free[b].record(dma if store else sm)  # the buffer's last reader or writer
            done = torch.cuda.Event()
            for stream in (sm, *dmas):
                done.record(stream)
                done.synchronize()
            return 1

        return step

    return rounds


def _engine_rounds(bench: Bench, engine: SyncOffloadingEngine, inflight: int) -> Any:
    """Rounds of two 512-block jobs. ``inflight`` 1: submit a round, wait for it;
    2: the next round is submitted before the previous one is waited for (as a
    server that keeps loading while earlier loads finish)."""

    def rounds(case: str) -> Any:
        specs = bench.specs(case, 512, 2)
        pending: list[list[int]] = []

        def step() -> int:
            pending.append([engine.submit(s) for s in specs])
            finished = 0
            while len(pending) >= inflight:
                results = engine.wait(pending.pop(0))
                failed = [r for r in results if not r.success]
                if failed:
                    raise RuntimeError(f"{len(failed)} jobs failed: {failed[0].error}")
                finished += 1
            return finished

        return step

    return rounds


def pass_submit_cpu(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    runtime = CudaRuntime()
    bench = Bench(runtime, 16, 1536)
    # each strategy with each launch mode side by side (LAUNCH_MODES: small jobs
    # enqueued on the engine's loop, the submitting thread or the launcher thread)
    for strategy, launch in [(s, m) for s in args.strategies for m in args.launch_modes]:
        engine, store, _ = bench.engine(strategy, launch=launch)
        launch_cpu: list[float] = []
        real_enqueue = store._enqueue

        def timed_enqueue(
            plan: Any, real: Any = real_enqueue, out: list[float] = launch_cpu
        ) -> None:
            t0 = time.thread_time_ns()  # CPU time of the handler's launcher thread
            real(plan)
            out.append((time.thread_time_ns() - t0) / 1e3)

        store._enqueue = timed_enqueue  # type: ignore[method-assign]
        prepare_cpu: list[float] = []
        real_prepare = store.prepare

        def timed_prepare(
            spec: Any, real: Any = real_prepare, out: list[float] = prepare_cpu
        ) -> Any:
            t0 = time.thread_time_ns()  # the handler's share of submit, in the caller's thread
            plan = real(spec)
            out.append((time.thread_time_ns() - t0) / 1e3)
            return plan

        store.prepare = timed_prepare  # type: ignore[method-assign]
        try:
            for per_job, slots in [(b, k) for b in (8, 64, 512) for k in args.slots]:
                specs = bench.specs("store", per_job, 40, slots)
                bench.run(engine, specs[:4])
                launch_cpu.clear()
                submit_cpu = []
                ids = []
                for s in specs:  # back to back: the launcher works on earlier jobs meanwhile
                    t0 = time.thread_time_ns()
                    ids.append(engine.submit(s))
                    submit_cpu.append((time.thread_time_ns() - t0) / 1e3)
                engine.wait(ids)
                alone_cpu = []
                latency = []
                prepare_cpu.clear()
                launch_back_to_back = statistics.median(launch_cpu)
                launch_cpu.clear()
                p0 = time.process_time_ns()
                for s in specs[:20]:  # one at a time: nothing else of the engine's is running
                    w0 = time.perf_counter_ns()
                    t0 = time.thread_time_ns()
                    job = engine.submit(s)
                    alone_cpu.append((time.thread_time_ns() - t0) / 1e3)
                    engine.wait([job])
                    latency.append((time.perf_counter_ns() - w0) / 1e3)
                row = {
                    "pass": "cpu",
                    "strategy": strategy.value,
                    "launch": launch,
                    "blocks_per_job": per_job,
                    "slots": slots,
                    # every thread's CPU per job, one job at a time, and submit to result
                    "process_alone_us": (time.process_time_ns() - p0) / 1e3 / 20,
                    "latency_alone_us": statistics.median(latency),
                    "submit_us": statistics.median(submit_cpu),
                    "submit_alone_us": statistics.median(alone_cpu),
                    "launch_us": launch_back_to_back,
                    "launch_alone_us": statistics.median(launch_cpu),
                    "prepare_alone_us": statistics.median(prepare_cpu),
                }
                rows.append(row)
                print(
                    f"  {strategy.value:7} {launch:9} {per_job:4} blocks {slots:9}: submit "
                    f"{row['submit_us']:.0f} us back to back, {row['submit_alone_us']:.0f} us "
                    f"alone (prepare {row['prepare_alone_us']:.0f} us); launch "
                    f"{row['launch_us']:.0f} us back to back, {row['launch_alone_us']:.0f} us "
                    f"alone (median CPU time per job); alone: "
                    f"{row['process_alone_us']:.0f} us CPU of all threads per job, "
                    f"{row['latency_alone_us']:.0f} us submit to result",
                    flush=True,
                )
        finally:
            engine.close()
    bench.tier.release()


def pass_step(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from offload_engine.bench.step import StepPlan, StepShape, format_step_rows, run_step_pass

    runtime = CudaRuntime()
    plan = StepPlan(
        shape=StepShape(layers=args.step_layers),
        blocks=tuple(args.step_blocks),
        strategies=tuple(CopyStrategy(t) for t in args.step_strategies.split(",")),
        modes=tuple(tuple(m.split(":")) for m in args.step_modes.split(",")),  # type: ignore[misc]
        steps=args.step_steps,
        reps=args.reps,
        launch_modes=tuple(m for m in args.launch_modes if m != "loop"),
        layouts=tuple(args.step_layouts.split(",")),
        capacity=args.step_capacity,
    )
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
        print(f"  GIL switch interval {sys.getswitchinterval() * 1e3:.2f} ms", flush=True)
    found = run_step_pass(runtime, plan)
    for r in found:
        rows.append({"pass": "step", **r.as_dict()})
    for line in format_step_rows(found):
        print(line, flush=True)
    if args.step_figure:
        from offload_engine.bench.plots import step_figure

        machine = torch.cuda.get_device_name()
        drawn = step_figure([r.as_dict() for r in found], machine, str(date.today()),
                            Path(args.step_figure), "bench_cuda.py --passes step")  # fmt: skip
        print(f"  figure: {drawn}", flush=True)


def pass_gaps(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from offload_engine.bench.gaps import GapPlan, format_gap_rows, run_gap_pass

    runtime = CudaRuntime()
    plan = GapPlan(
        blocks=tuple(_ints(args.gap_blocks)),
        strategies=tuple(args.gap_strategies.split(",")),
        seconds=args.gap_seconds,
        reps=args.reps,
    )
    found = run_gap_pass(runtime, plan)
    rows += [{"pass": "gaps", **r.as_dict()} for r in found]
    for line in format_gap_rows(found):
        print(line, flush=True)


def pass_ttft(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from offload_engine.bench.cuda import run_cuda_ttft
    from offload_engine.bench.ttft import TtftPlan, format_ttft_rows

    base = TtftPlan.quick() if args.quick else TtftPlan()  # H and N unless given
    plan = TtftPlan(
        hits=tuple(args.ttft_hits) or base.hits,
        new=tuple(args.ttft_new) or base.new,
        layers_per_load=tuple(args.ttft_layers_per_load),
        reps=args.reps,
    )
    shown = [""]

    def tick(what: str) -> None:  # one line per cell and per check
        cell = what.rsplit(" ", 1)[0]
        if cell != shown[0]:
            shown[0] = cell
            print(f"  {cell}", flush=True)

    found = run_cuda_ttft(plan, tick=tick, strategy=args.ttft_strategy)
    rows += [{"pass": "ttft", "strategy": args.ttft_strategy, **r} for r in found]
    for line in format_ttft_rows(found):
        print(f"  {line}", flush=True)
    if args.ttft_figure:
        from offload_engine.bench.plots import ttft_figure

        machine = torch.cuda.get_device_name()
        print(f"  figure: {ttft_figure(found, machine, str(date.today()), Path(args.ttft_figure))}")
    return found


def pass_ttft_stores(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from offload_engine.bench.cuda import run_cuda_ttft
    from offload_engine.bench.ttft import TtftPlan
    from offload_engine.bench.ttft_stores import format_store_rows

    base = TtftPlan.quick() if args.quick else TtftPlan()
    plan = TtftPlan(
        hits=tuple(args.ttft_hits) or base.hits,
        new=tuple(args.ttft_new) or base.new,
        layers_per_load=tuple(args.ttft_layers_per_load),
        reps=args.reps,
    )
    found = run_cuda_ttft(plan, tick=lambda what: None, stores=True)
    rows += [{"pass": "ttft-stores", **r} for r in found]
    for line in format_store_rows(found):
        print(f"  {line}", flush=True)
    return found


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in text.split(",")] if text else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--quick", action="store_true", help="fewer bytes per measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--passes",
        default="bandwidth,gemm,cpu,step",
        help="comma-separated: bandwidth, gemm, cpu, step, gaps, ttft, ttft-stores",
    )
    parser.add_argument("--per-job", default="8,32,512", help="blocks per job (bandwidth pass)")
    parser.add_argument(
        "--bandwidth-launch",
        default="loop",
        help="bandwidth pass: where small jobs launch (LAUNCH_MODES), each beside the others; "
        "rows of modes other than loop are labelled <strategy>/<mode>",
    )
    parser.add_argument(
        "--strategies", default="dma,staged,kernel", help="bandwidth and cpu passes"
    )
    parser.add_argument("--step-layers", type=int, default=16, help="the step's model layers")
    parser.add_argument("--step-steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--step-blocks", default="4,16,32", help="blocks each way per step")
    parser.add_argument(
        "--step-layouts",
        default="per-layer,cross-layer",
        help="the moved blocks' KV cache layouts in the step pass, one after the other",
    )
    parser.add_argument(
        "--step-capacity",
        type=int,
        default=None,
        help="step pass: queued + in-flight jobs per handler before a submit finds the queue "
        "full and the step waits for its oldest job (default: the engine's)",
    )
    parser.add_argument("--step-figure", help="step pass: draw slowdown against blocks here (PNG)")
    parser.add_argument(
        "--step-strategies", default="auto,dma", help="strategies measured in the step pass"
    )
    parser.add_argument(
        "--step-modes",
        default="eager:default,eager:side,graph:default,graph:side",
        help="mode:stream pairs for the step pass",
    )
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval for the step"
    )
    parser.add_argument(
        "--launch-modes",
        default="loop,submitter,launcher",
        help="cpu pass: where small jobs launch (LAUNCH_MODES); the step pass adds the "
        "modes other than loop as variants <strategy>/<mode>",
    )
    parser.add_argument(
        "--gemm-variants",
        default="contiguous,dma:256:2,staged:256:2,staged:256:3,staged:512:2,kernel:256:2",
        help="gemm pass: contiguous (the floor), pieces (a staged job's device work "
        "without the engine) and/or strategy:staging_mib:buffers",
    )
    parser.add_argument(
        "--gemm-inflight", type=int, default=1, help="gemm pass: rounds of two jobs in flight"
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=Bench.max_inflight,
        help="jobs in flight per handler (DeviceHandlerConfig.max_inflight; its default is "
        f"{DeviceHandlerConfig.max_inflight})",
    )
    parser.add_argument("--streams", type=int, default=None, help="stream sets per handler")
    parser.add_argument(
        "--slots",
        default="random,allocator",
        help="tier slots per job (bandwidth and cpu passes): random, and/or allocator "
        "(as vLLM's CPU offloading manager hands them out: runs of consecutive slots)",
    )
    parser.add_argument("--tokens", default="16,64", help="block sizes to run")
    parser.add_argument(
        "--ttft-hits",
        default=None,
        help="ttft and ttft-stores passes: prefix tokens H (default 2048,8192,32768)",
    )
    parser.add_argument(
        "--ttft-new", default=None, help="ttft pass: new tokens N (default 128,512,2048)"
    )
    parser.add_argument(
        "--ttft-layers-per-load",
        default="1,4,8",
        help="ttft and ttft-stores passes: layers per layer-wise job (G), one variant each",
    )
    parser.add_argument("--gap-blocks", default="8,64,512", help="gaps pass: blocks per job")
    parser.add_argument(
        "--gap-strategies",
        default="auto,dma,auto/submitter-polled",
        help="gaps pass: strategy or strategy/launch-mode variants",
    )
    parser.add_argument(
        "--gap-seconds", type=float, default=1.0, help="gaps pass: seconds per variant and round"
    )
    parser.add_argument("--ttft-figure", help="ttft pass: draw the grid into this PNG")
    parser.add_argument(
        "--ttft-strategy",
        choices=["auto", "staged", "dma"],
        default="auto",
        help="ttft pass: the device handlers' strategy (default auto: the parts stage)",
    )
    args = parser.parse_args()
    args.ttft_hits = _ints(args.ttft_hits)
    args.ttft_new = _ints(args.ttft_new)
    args.ttft_layers_per_load = _ints(args.ttft_layers_per_load)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.per_job = [int(t) for t in args.per_job.split(",")]
    args.strategies = [CopyStrategy(t) for t in args.strategies.split(",")]
    args.step_blocks = [int(t) for t in args.step_blocks.split(",")]
    args.launch_modes = args.launch_modes.split(",")
    args.bandwidth_launch = args.bandwidth_launch.split(",")
    args.slots = args.slots.split(",")
    if args.streams is not None:
        Bench.streams = args.streams
    Bench.max_inflight = args.max_inflight
    rows: list[dict[str, Any]] = []
    passes = args.passes.split(",")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {date.today()}", flush=True)
    if "bandwidth" in passes:
        pass_bandwidth(args, rows)
    if "gemm" in passes:
        pass_gemm(args, rows)
    if "cpu" in passes:
        pass_submit_cpu(args, rows)
    if "step" in passes:
        pass_step(args, rows)
    if "gaps" in passes:
        pass_gaps(args, rows)
    ttft: list[dict[str, Any]] = []
    if "ttft" in passes:
        ttft = pass_ttft(args, rows)
    stores: list[dict[str, Any]] = []
    if "ttft-stores" in passes:
        stores = pass_ttft_stores(args, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(0), "date": str(date.today()), "rows": rows},
                f,
                indent=1,
            )
    print("\nsummary (ratio to the same-run contiguous ceiling)")
    for r in rows:
        if r["pass"] == "bandwidth":
            what = (
                f"{r['tokens']:2}tok {r['blocks_per_job']:3}b {r['slots']:9} {r['strategy']:7} "
                f"{r['case']:5}"
            )
            print(f"  bw   {what} {r['gbps']:6.1f} GB/s {r['ratio']:.3f}")
    for r in rows:
        if r["pass"] == "gemm":
            slow = r["gemm_slowdown"] * 100
            what = f"{r['strategy']:17} x{r['inflight']} {r['case']:5}"
            floor = "" if r["floor_ratio"] is None else f" (floor {r['floor_ratio']:.3f})"
            print(f"  gemm {what} {r['ratio']:.3f}{floor} slowdown {slow:+.1f}%")
    for r in rows:
        if r["pass"] == "cpu":
            cpu = (
                f"submit {r['submit_us']:.0f} us (alone {r['submit_alone_us']:.0f} us, prepare "
                f"{r['prepare_alone_us']:.0f} us) "
                f"launch {r['launch_us']:.0f} us (alone {r['launch_alone_us']:.0f} us)"
            )
            cpu += (
                f", all threads {r['process_alone_us']:.0f} us, "
                f"submit to result {r['latency_alone_us']:.0f} us"
            )
            what = f"{r['strategy']:7} {r['launch']:9} {r['blocks_per_job']:3} blocks"
            what += f" {r['slots']:9}"
            print(f"  cpu  {what} {cpu}")
    for r in rows:
        if r["pass"] == "step" and r["variant"] != "none":
            what = f"{r['layout']:11} {r['mode']:5} {r['stream']:7} {r['blocks']:2} blocks"
            waits = f", {r['queue_full']} waits for room" if r["queue_full"] else ""
            print(
                f"  step {what} {r['variant']:10} {r['slowdown'] * 100:+5.1f}% "
                f"({r['step_ms']:.2f} ms a step{waits})"
            )
    if ttft:
        from offload_engine.bench.ttft import format_ttft_rows

        print("\ntime to first token (ttft pass)")
        for line in format_ttft_rows(ttft):
            print(f"  {line}")
    if stores:
        from offload_engine.bench.ttft_stores import format_store_rows

        print("\nstores of a prefill's new blocks (ttft-stores pass)")
        for line in format_store_rows(stores):
            print(f"  {line}")
    return 1 if any(r["errors"] for r in [*ttft, *stores]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
