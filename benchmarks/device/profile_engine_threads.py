"""CPU time per job in each of the engine's threads, small device jobs one step at a time.

    python benchmarks/device/profile_engine_threads.py [--jobs 2000] [--blocks 8]
        [--launch loop,submitter,launcher] [--strategy staged]

Each "step" submits one load and one store of ``--blocks`` blocks (16-token
Llama-3-8B-shaped blocks in a FlashAttention layout), waits for both, and polls
nothing else, so every thread's CPU time is this work's. For each launch mode
(``offload_engine.bench.step.LAUNCH_MODES``: where small jobs are enqueued) it
prints the CPU time per job of the caller, the engine's loop thread, each
handler's launcher and watcher, and the whole process
(``time.pthread_getcpuclockid``), and the wall time per step. Run it under a
sampling profiler (``py-spy record -r 1000 -f raw -- python ...``) to see where
each thread's time goes. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from offload_engine import (
    KVLayout,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.bench.step import LAUNCH_MODES
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes.cuda import CudaRuntime


def thread_clocks() -> dict[str, int]:
    """Each live thread's CPU time, in ns, by name (the caller as ``caller``)."""
    import threading

    out = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        name = "caller" if t is threading.main_thread() else t.name
        try:
            out[name] = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except (OSError, ProcessLookupError):
            continue
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000, help="steps (a load and a store each)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--launch", default="loop,submitter,launcher", help="launch modes")
    parser.add_argument("--strategy", default="staged")
    args = parser.parse_args()
    runtime = CudaRuntime()
    layers = [
        torch.randn(2, 1024, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(32)
    ]
    layout = KVLayout.flash_attention(layers)
    tier = pinned_host_tier(runtime, layout, 1024)
    rng = np.random.default_rng(0)
    n = args.blocks

    def step_specs() -> tuple[TransferSpec, TransferSpec]:
        a = rng.choice(512, size=2 * n, replace=False)
        b = rng.choice(512, size=2 * n, replace=False)
        load = TransferSpec(cpu_blocks(a[:n] + 512), gpu_blocks(b[:n] + 512))
        store = TransferSpec(gpu_blocks(a[n:]), cpu_blocks(b[n:]))
        return load, store

    specs = [step_specs() for _ in range(args.jobs)]
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for launch in args.launch.split(","):
        cfg = DeviceHandlerConfig(strategy=CopyStrategy(args.strategy), **LAUNCH_MODES[launch])
        store, load = make_device_handlers(runtime, layout, tier, cfg)
        with SyncOffloadingEngine([store, load]) as engine:
            for ld, st in specs[:50]:  # warm-up
                engine.wait([engine.submit(ld), engine.submit(st)])
            before = thread_clocks()
            p0, w0 = time.process_time_ns(), time.perf_counter_ns()
            for ld, st in specs:
                engine.wait([engine.submit(ld), engine.submit(st)])
            wall = time.perf_counter_ns() - w0
            process = time.process_time_ns() - p0
            after = thread_clocks()
        jobs = 2 * args.jobs
        print(
            f"{args.strategy} {n} blocks, launched on the {launch}: "
            f"{wall / 1e3 / args.jobs:.0f} us wall per step, "
            f"{process / 1e3 / jobs:.0f} us process CPU per job",
            flush=True,
        )
        for name in sorted(after):
            if name in before:
                us = (after[name] - before[name]) / 1e3 / jobs
                print(f"  {name:40} {us:7.1f} us CPU per job", flush=True)
    tier.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
