"""When the jobs of a back-to-back burst of submits get launched, on the fake device runtime.

    PYTHONPATH=. python benchmarks/launch_burst.py [--jobs 128] [--blocks 8]

A thread submits ``--jobs`` staged store jobs of ``--blocks`` random blocks to a
``SyncOffloadingEngine`` back to back, as the GPU bandwidth pass does, then waits for
them. Printed for the default launch (small jobs launched by the engine's loop) and for
``submitter_launch``: how long the burst of submits took, how many jobs were launched
(their copies put on a stream) before it ended, and when the first was. The engine's
threads need the GIL that the submitting thread holds while it runs Python, so what
launches during the burst is what a device's link can move meanwhile.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from offload_engine import KVLayout, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.testing import FakeRuntime


def burst(submitter_launch: bool, jobs: int, blocks: int) -> tuple[float, int, float]:
    """(ms the submits took, jobs launched before they ended, ms to the first launch)."""
    runtime = FakeRuntime()
    launched: list[float] = []
    batch = runtime.memcpy_batch

    def recorded(*args: object, **kwargs: object) -> int:
        launched.append(time.perf_counter())
        return batch(*args, **kwargs)  # type: ignore[arg-type]

    runtime.memcpy_batch = recorded  # type: ignore[method-assign]
    tensors = [runtime.empty((256, 2, 16, 2, 32), torch.bfloat16) for _ in range(4)]
    layout = KVLayout.from_block_tensors(tensors)
    tier = pinned_host_tier(runtime, layout, 1024)
    try:
        config = DeviceHandlerConfig(
            strategy=CopyStrategy.STAGED, submitter_launch=submitter_launch, native_launch=False
        )
        handlers = make_device_handlers(runtime, layout, tier, config)
        rng = random.Random(0)
        specs = [
            TransferSpec(
                gpu_blocks(rng.sample(range(256), blocks)),
                cpu_blocks(rng.sample(range(1024), blocks)),
            )
            for _ in range(jobs)
        ]
        with SyncOffloadingEngine(list(handlers), capacity=100_000) as engine:
            t0 = time.perf_counter()
            ids = [engine.submit(s) for s in specs]
            ended = time.perf_counter()
            engine.wait(ids)
        during = sum(1 for t in launched if t <= ended)
        return 1e3 * (ended - t0), during, 1e3 * (launched[0] - t0)
    finally:
        tier.release()
        runtime.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=128)
    p.add_argument("--blocks", type=int, default=8)
    args = p.parse_args(argv)
    print(f"a burst of {args.jobs} staged jobs of {args.blocks} blocks (fake runtime)")
    for label, submitter in (("loop launch (default)", False), ("submitter_launch", True)):
        took, during, first = burst(submitter, args.jobs, args.blocks)
        print(
            f"  {label:22} submits {took:6.2f} ms, launched during them {during:4}, "
            f"first launch at {first:6.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
