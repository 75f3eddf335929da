"""What submitting one long prefix hit costs the thread that submits it, through the
vLLM adapter's bridge: a load of ``--blocks`` blocks of Llama-3-8B's cache shape (32
layers, K and V per layer, 8 KV heads of 128, bf16, 16-token blocks), layer-wise in
parts of ``--layers-per-part`` layers (``load_mode: layerwise``, each part launched on
the submitting thread), and whole (``load_mode: async``, launched by the engine).

    python benchmarks/device/big_submit.py [--blocks 2048] [--reps 6] [--profile]

with the package installed (``pip install -e .``; on the GPU machines the copy that
``vllm_gpu.sh`` installs: ``PYTHONPATH=/tmp/oe-site``).

On a CUDA host it runs on the GPU with the handlers' defaults (the native launch where
it builds); elsewhere on the fake runtime with 1 KiB regions (the same count of
regions, whose checks in Python cost more than a driver would). Printed per mode: the
submit's wall time on the calling thread (median and range over the repeats, the first
left out), and the time until the load is done; ``--profile`` adds the last repeat's
``cProfile`` of the project's own functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import numpy as np
import torch

from offload_engine import Medium, SyncOffloadingEngine
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.connectors.vllm.layerwise import LayerPlan, LayerwiseLoads, TransferJob
from offload_engine.device import make_device_handlers, pinned_host_tier
from offload_engine.testing import FakeRuntime, build_layout

LAYERS = 32


def setup(blocks: int) -> tuple[Any, EngineBridge, str]:
    """A runtime, a bridge over its device handlers with a cache of ``blocks`` + 64 blocks
    and a tier of ``blocks`` slots, and the runtime's name."""
    if torch.cuda.is_available():
        from offload_engine.device.runtimes.cuda import CudaRuntime

        runtime: Any = CudaRuntime()

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="cuda")

        heads, dim, name = 8, 128, torch.cuda.get_device_name()
    else:
        runtime = FakeRuntime()
        empty, heads, dim, name = runtime.empty, 1, 32, "the fake runtime"
    layout = build_layout(
        "flash-attention",
        empty,
        num_blocks=blocks + 64,
        num_layers=LAYERS,
        kv_heads=heads,
        head_dim=dim,
    )
    tier = pinned_host_tier(runtime, layout, blocks)
    engine = SyncOffloadingEngine(list(make_device_handlers(runtime, layout, tier)))
    return runtime, EngineBridge(engine, Medium.GPU, tier=tier, layout=layout), name


def measure(
    bridge: EngineBridge, mode: str, blocks: int, per_part: int, reps: int, profile: bool
) -> tuple[list[float], list[float], str]:
    """Per repeat: ms the submit held the calling thread, ms until the load was done;
    and the last repeat's profile (empty without ``profile``)."""
    layout = bridge.layout
    assert layout is not None
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    addresses = {n: layout.tensors[i].data_ptr() for i, n in enumerate(names)}
    loads = LayerwiseLoads(bridge, LayerPlan.build(layout, addresses, per_part), timeout=60)
    cache, tier = np.arange(64, 64 + blocks), np.arange(blocks)
    submits, dones, report = [], [], ""
    for rep in range(reps):
        job = rep + 1 + (1000 if mode == "whole" else 0)
        prof = cProfile.Profile() if profile and rep == reps - 1 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        if mode == "layerwise":
            loads.start([TransferJob(job, cache, (blocks,), (0,), tier_ids=tier)])
        elif not bridge.submit_load(job, tier, cache, (blocks,), (0,)):
            raise RuntimeError("the engine refused the load")
        t1 = time.perf_counter()
        if prof is not None:
            prof.disable()
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
            stats.print_stats(r"offload_engine|connectors", 25)
            report = out.getvalue()
        if mode == "layerwise":
            loads.finish_step()
        bridge.wait([job])
        results = bridge.get_finished()
        if not all(r.success for r in results):
            raise RuntimeError(f"a load failed: {[r.error for r in results]}")
        if mode == "layerwise":
            loads.finished(job, True, None)
        submits.append(1e3 * (t1 - t0))
        dones.append(1e3 * (time.perf_counter() - t0))
    return submits, dones, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=2048)
    p.add_argument("--layers-per-part", type=int, default=4)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    runtime, bridge, name = setup(args.blocks)
    print(f"{name}: a load of {args.blocks} blocks, {LAYERS} layers, ms")
    try:
        for mode in ("layerwise", "whole"):
            submits, dones, report = measure(
                bridge, mode, args.blocks, args.layers_per_part, args.reps, args.profile
            )
            kept, done = submits[1:] or submits, statistics.median(dones[1:] or dones)
            print(
                f"  {mode:9} submit {statistics.median(kept):8.2f} "
                f"({min(kept):.2f}-{max(kept):.2f})  done {done:8.2f}"
            )
            if report:
                print(report)
    finally:
        bridge.shutdown()
        if isinstance(runtime, FakeRuntime):
            runtime.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
