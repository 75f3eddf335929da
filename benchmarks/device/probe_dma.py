"""Probe: DMA efficiency of scattered 2 MiB copies, and where launch CPU goes.

python benchmarks/device/probe_dma.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

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

rt = CudaRuntime()
MB2 = 2 << 20
N = 512
dev = torch.empty(N * MB2, dtype=torch.uint8, device="cuda")
host = torch.empty(2 * N * MB2, dtype=torch.uint8)
release = rt.pin_host(host.view(2 * N, MB2))
rng = np.random.default_rng(0)
slots = rng.choice(2 * N, size=N, replace=False).astype(np.uint64)
dptr = np.uint64(dev.data_ptr()) + np.arange(N, dtype=np.uint64) * np.uint64(MB2)
hptr = np.uint64(host.data_ptr()) + slots * np.uint64(MB2)
hcont = np.uint64(host.data_ptr()) + np.arange(N, dtype=np.uint64) * np.uint64(MB2)
sizes = np.full(N, MB2, dtype=np.uint64)
streams = [rt.new_stream() for _ in range(4)]


def run(kind: Direction, host_ptrs: np.ndarray, nstreams: int, chunk: int = 1) -> float:
    dst, src = (host_ptrs, dptr) if kind is Direction.STORE else (dptr, host_ptrs)
    z = sizes
    if chunk > 1:  # merge consecutive descriptors (only valid for contiguous host)
        dst, src, z = dst[::chunk], src[::chunk], np.full(N // chunk, MB2 * chunk, dtype=np.uint64)
    best = 1e9
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(nstreams):
            rt.memcpy_batch(streams[i], dst[i::nstreams], src[i::nstreams], z[i::nstreams], kind)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return N * MB2 / best / 1e9


for kind in (Direction.STORE, Direction.LOAD):
    r1, r2, r4 = run(kind, hptr, 1), run(kind, hptr, 2), run(kind, hptr, 4)
    print(
        kind.value, f"random 2MiB slots: 1 stream {r1:.1f}, 2 streams {r2:.1f}, 4 streams {r4:.1f}"
    )
    c1, c32, cn = run(kind, hcont, 1), run(kind, hcont, 1, 32), run(kind, hcont, 1, N)
    print(kind.value, f"contiguous: 2MiB descs {c1:.1f}, 64MiB descs {c32:.1f}, 1 desc {cn:.1f}")
    print(kind.value, f"contiguous 64MiB descs on 2 streams {run(kind, hcont, 2, 32):.1f} GB/s")


# both directions at once, contiguous 64 MiB pieces vs random 2 MiB
def both(host_ptrs: np.ndarray, chunk: int) -> float:
    dev2 = torch.empty_like(dev)
    d2 = np.uint64(dev2.data_ptr()) + np.arange(N, dtype=np.uint64) * np.uint64(MB2)
    h2 = (
        host_ptrs + np.uint64(N * MB2)
        if chunk > 1
        else np.uint64(host.data_ptr())
        + rng.permutation(2 * N)[:N].astype(np.uint64) * np.uint64(MB2)
    )
    z = sizes if chunk == 1 else np.full(N // chunk, MB2 * chunk, dtype=np.uint64)
    a = (host_ptrs[::chunk], dptr[::chunk], z)
    b = (d2[::chunk], h2[::chunk], z)
    best = 1e9
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.memcpy_batch(streams[0], *a, Direction.STORE)
        rt.memcpy_batch(streams[1], *b, Direction.LOAD)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * N * MB2 / best / 1e9


print(
    f"both: contiguous 64MiB descs {both(hcont, 32):.1f} GB/s, random 2MiB {both(hptr, 1):.1f} GB/s"
)
release()

# where does launch CPU go? profile the store and load launcher work for staged jobs
layers = [torch.randn(2, 1200, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
layout = KVLayout.flash_attention(layers)
tier = pinned_host_tier(rt, layout, 1200)
store, load = make_device_handlers(
    rt, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.STAGED)
)
with SyncOffloadingEngine([store, load]) as engine:
    for label, per_job, jobs in (("8-block", 8, 200), ("512-block", 512, 6)):
        specs = []
        for _j in range(jobs):
            c = rng.choice(600, size=per_job, replace=False)
            t = rng.choice(600, size=per_job, replace=False)
            specs.append(TransferSpec(cpu_blocks(t + 600), gpu_blocks(c + 600)))
        engine.wait([engine.submit(s) for s in specs[:4]])
        prof = cProfile.Profile()
        real = load._enqueue

        def profiled(plan, real=real, prof=prof):  # type: ignore[no-untyped-def]
            prof.enable()
            try:
                real(plan)
            finally:
                prof.disable()

        load._enqueue = profiled  # type: ignore[method-assign]
        t0 = time.perf_counter()
        engine.wait([engine.submit(s) for s in specs])
        el = time.perf_counter() - t0
        load._enqueue = real  # type: ignore[method-assign]
        print(f"\n{label} staged loads: {jobs * per_job * layout.slot_bytes / el / 1e9:.1f} GB/s")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
tier.release()
