"""Where a small job's CPU time goes (run on a CUDA machine).

    python benchmarks/device/profile_launch.py [--blocks 8] [--jobs 200]

Prints the thread CPU time of each primitive the device handler's launcher and
the caller's submit use (event record and wait, id upload, the Triton block
copy launch, a batched copy, descriptor arithmetic), then a cProfile of the
handler's own ``prepare`` and launcher work (``_enqueue``) for staged, dma and
kernel jobs, called directly on this thread (no engine threads compete).
Same workload as ``bench_cuda.py``: 32 layers, K and V, 8 x 128 bf16, 16 tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from offload_engine import KVLayout, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes.cuda import CudaRuntime
from offload_engine.vocabulary import Direction


def cpu_us(fn: Callable[[], object], reps: int, *, sync_each: bool = False) -> float:
    """Median thread CPU time of ``fn`` in microseconds; ``sync_each`` waits for the
    device after every call (for calls that queue a lot of device work)."""
    fn()
    if sync_each:
        torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        fn()
        samples.append((time.thread_time_ns() - t0) / 1e3)
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--num-blocks", type=int, default=512)
    args = parser.parse_args()
    rt = CudaRuntime()
    layers = [
        torch.randn(2, args.num_blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        for _ in range(32)
    ]
    layout = KVLayout.flash_attention(layers)
    tier = pinned_host_tier(rt, layout, args.num_blocks)
    rng = np.random.default_rng(0)
    n = args.blocks
    ids = rng.choice(args.num_blocks, size=n, replace=False).astype(np.int64)
    s = rt.new_stream()
    ev = rt.new_event()
    rt.record(ev, s)
    staging = rt.alloc_device(n * layout.slot_bytes)
    rows: list[tuple[str, float]] = []
    rows.append(("event.record", cpu_us(lambda: rt.record(ev, s), 500)))
    rows.append(("stream.wait_event", cpu_us(lambda: rt.wait_event(s, ev), 500)))
    rows.append(("current_stream()", cpu_us(rt.current_stream, 500)))
    rows.append(("new_event()", cpu_us(rt.new_event, 200)))
    rows.append(("upload 8 ids", cpu_us(lambda: rt.upload(s, ids), 300)))
    buffer = rt.new_id_buffer(64)
    buffer.host[:n] = ids
    reused = cpu_us(lambda: rt.upload_ids(s, buffer, n), 300)
    rows.append(("upload_ids 8 ids (reused buffer)", reused))
    rows.append(("record_current", cpu_us(lambda: rt.record_current(ev), 500)))
    rows_addr = np.uint64(staging.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(
        layout.slot_bytes
    )
    src = rows_addr
    dst = np.uint64(tier.memory.data_ptr()) + ids.astype(np.uint64) * np.uint64(tier.slot_bytes)
    sizes = np.full(n, layout.slot_bytes, dtype=np.uint64)
    rows.append(
        (
            f"memcpy_batch {n} x 2MiB d2h",
            cpu_us(lambda: rt.memcpy_batch(s, dst, src, sizes, Direction.STORE), 100),
        )
    )
    rows.append(("stream context", cpu_us(lambda: rt.stream_context(s).__enter__(), 300)))
    for label, fn in rows:
        print(f"  {label:32} {fn:8.1f} us", flush=True)

    for strategy in (CopyStrategy.STAGED, CopyStrategy.KERNEL, CopyStrategy.DMA):
        cfg = DeviceHandlerConfig(strategy=strategy, max_inflight=8)
        store, load = make_device_handlers(rt, layout, tier, cfg)
        with SyncOffloadingEngine([store, load]) as engine:
            for handler, direction in ((store, "store"), (load, "load")):
                specs = []
                for _ in range(args.jobs):
                    c = rng.choice(args.num_blocks, size=n, replace=False)
                    t = rng.choice(args.num_blocks, size=n, replace=False)
                    specs.append(
                        TransferSpec(gpu_blocks(c), cpu_blocks(t))
                        if direction == "store"
                        else TransferSpec(cpu_blocks(t), gpu_blocks(c))
                    )
                # warm up through the engine (compiles Triton), then call directly
                engine.wait([engine.submit(x) for x in specs[:4]])
                plans: list[Any] = []
                t0 = time.thread_time_ns()
                for x in specs:
                    plans.append(handler.prepare(x))
                prep = (time.thread_time_ns() - t0) / 1e3 / len(specs)
                prof = cProfile.Profile()
                t0 = time.thread_time_ns()
                prof.enable()
                for i, p in enumerate(plans):
                    handler._enqueue(p)
                    if i % 8 == 7:
                        torch.cuda.synchronize()
                prof.disable()
                enq = (time.thread_time_ns() - t0) / 1e3 / len(specs)
                torch.cuda.synchronize()
                for p in plans:
                    handler._recycle(p)
                # one at a time, no profiler
                samples = []
                for p in plans[:50]:
                    p.checks.clear()
                    t0 = time.thread_time_ns()
                    handler._enqueue(p)
                    samples.append((time.thread_time_ns() - t0) / 1e3)
                    torch.cuda.synchronize()
                print(
                    f"\n{strategy.value} {direction} {n} blocks: prepare {prep:.1f} us, "
                    f"enqueue {enq:.1f} us (profiled), {statistics.median(samples):.1f} us "
                    "(plain, median)",
                    flush=True,
                )
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    tier.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
