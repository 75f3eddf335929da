"""What it costs to keep the host tier inside a shared region (EngineTieringSpec)
instead of a private allocation (EngineOffloadingSpec), side by side in one run.

    PYTHONPATH=. python benchmarks/tier_placement.py [--device cpu|cuda] [--layers 8] [--reps 20]

Placements: ``private`` (the tier's own contiguous allocation), ``region`` (the
tier is rank 1's page in every row of a 2-worker region laid out like vLLM's
SharedOffloadRegion: rows of two pages plus page-alignment padding), each with
``blocks_per_chunk`` 1 and 4. On ``cpu`` the host handler moves the bytes (the
KV cache in host memory, as on vLLM's CPU platform); on ``cuda`` the device
handlers (``dma`` and ``staged``) over a pinned tier / the registered region.
Per job size: the median wall time of a store and of a load (submit to result),
and its ratio to ``private`` at the same factor.
"""

from __future__ import annotations

import argparse
import json
import mmap
import platform
import statistics
import time
from datetime import date
from typing import Any

import numpy as np
import torch

from offload_engine import (
    CopyStrategy,
    DeviceHandlerConfig,
    HostCopyHandler,
    HostTier,
    KVLayout,
    SyncOffloadingEngine,
    TransferHandler,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
    make_device_handlers,
    pinned_host_tier,
)


def build_cache(device: str, layers: int, num_blocks: int) -> KVLayout:
    """Per-layer FlashAttention tensors: 16 tokens x 8 KV heads x 128, bf16 (32 KiB chunks)."""
    shape = (2, num_blocks, 16, 8, 128)
    tensors = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(layers)]
    return KVLayout.flash_attention(tensors)


def region_geometry(layout: KVLayout, factor: int) -> tuple[int, int]:
    """vLLM's shape for 2 workers: a page per worker, rows rounded up to the host page."""
    page = factor * layout.slot_bytes
    row = -(-2 * page // mmap.PAGESIZE) * mmap.PAGESIZE
    return page, row


def make_tier(
    placement: str, layout: KVLayout, blocks: int, factor: int, runtime: Any | None
) -> HostTier:
    if placement == "private":
        if runtime is None:
            return HostTier.for_layout(layout, blocks, factor=factor)
        return pinned_host_tier(runtime, layout, blocks, factor=factor)
    page, row = region_geometry(layout, factor)
    buffer = torch.zeros((blocks, row), dtype=torch.uint8)
    kw = {"factor": factor, "offset": page, "page_bytes": page, "block_stride": row}
    if runtime is None:
        return HostTier.over(buffer, num_blocks=blocks, slot_bytes=layout.slot_bytes, **kw)
    return pinned_host_tier(runtime, layout, blocks, buffer=buffer, **kw)  # type: ignore[arg-type]


def time_jobs(
    engine: SyncOffloadingEngine,
    cache: Any,
    n: int,
    tier_blocks: int,
    factor: int,
    reps: int,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """Median seconds of a store and of a load of ``n`` cache blocks."""
    stores, loads = [], []
    chunks = -(-n // factor)
    for _ in range(reps + 2):
        ids = [int(x) for x in rng.choice(256, size=n, replace=False)]
        tier = [int(x) for x in rng.choice(tier_blocks, size=chunks, replace=False)]
        t0 = time.perf_counter()
        [r] = engine.wait([engine.submit(TransferSpec(cache(ids), cpu_blocks(tier)))])
        t1 = time.perf_counter()
        [r2] = engine.wait([engine.submit(TransferSpec(cpu_blocks(tier), cache(ids)))])
        t2 = time.perf_counter()
        if not (r.success and r2.success):
            raise RuntimeError(r.error or r2.error)
        stores.append(t1 - t0)
        loads.append(t2 - t1)
    return statistics.median(stores[2:]), statistics.median(loads[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", default="8,64")
    p.add_argument("--json")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runtime = None
    if args.device == "cuda":
        from offload_engine import CudaRuntime

        runtime = CudaRuntime()
    layout = build_cache(args.device, args.layers, 256)
    tier_blocks = 128
    modes = ["host"] if runtime is None else ["dma", "staged"]
    rows: list[dict[str, Any]] = []
    for mode in modes:
        for factor in (1, 4):
            base: dict[int, tuple[float, float]] = {}
            for placement in ("private", "region"):
                tier = make_tier(placement, layout, tier_blocks, factor, runtime)
                try:
                    if runtime is None:
                        handlers: list[TransferHandler[Any]] = [HostCopyHandler(layout, tier)]
                        cache = host_cache_blocks
                    else:
                        cfg = DeviceHandlerConfig(strategy=CopyStrategy(mode))
                        handlers = list(make_device_handlers(runtime, layout, tier, cfg))
                        cache = gpu_blocks
                    with SyncOffloadingEngine(handlers) as engine:
                        for n in sizes:
                            rng = np.random.default_rng(n)
                            s, ld = time_jobs(engine, cache, n, tier_blocks, factor, args.reps, rng)
                            if placement == "private":
                                base[n] = (s, ld)
                            nbytes = n * layout.slot_bytes
                            rows.append(
                                {
                                    "mode": mode,
                                    "factor": factor,
                                    "placement": placement,
                                    "blocks": n,
                                    "store_ms": s * 1e3,
                                    "load_ms": ld * 1e3,
                                    "store_gbs": nbytes / s / 1e9,
                                    "load_gbs": nbytes / ld / 1e9,
                                    "store_ratio": s / base[n][0],
                                    "load_ratio": ld / base[n][1],
                                }
                            )
                finally:
                    tier.release()
    print(
        f"tier placement, {args.device}, {args.layers} layers x 32 KiB K/V chunks "
        f"({layout.slot_bytes // 1024} KiB per block), median of {args.reps}, {date.today()}"
    )
    print(
        f"{'mode':<7}{'f':>2} {'placement':<9}{'blocks':>7}{'store ms':>10}{'load ms':>9}"
        f"{'store GB/s':>11}{'load GB/s':>10}{'store/priv':>11}{'load/priv':>10}"
    )
    for r in rows:
        print(
            f"{r['mode']:<7}{r['factor']:>2} {r['placement']:<9}{r['blocks']:>7}"
            f"{r['store_ms']:>10.3f}{r['load_ms']:>9.3f}{r['store_gbs']:>11.2f}"
            f"{r['load_gbs']:>10.2f}{r['store_ratio']:>11.2f}{r['load_ratio']:>10.2f}"
        )
    if args.json:
        meta = {"date": date.today().isoformat(), "machine": platform.node(), "device": args.device}
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
