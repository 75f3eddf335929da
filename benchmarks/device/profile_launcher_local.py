"""The launcher's Python per job, without a GPU.

    PYTHONPATH=$PWD python benchmarks/device/profile_launcher_local.py [--jobs 300] [--profile]

:class:`CudaRuntime`'s launch code and the native launch program run over a
driver whose every entry point is one C function that returns 0 (compiled here
with ``cc``), so what is timed is the handler's own Python (planning, recording
the program, the ctypes call) and nothing of a driver. The layout is
``bench_cuda.py``'s shape at a smaller scale (32 layers, K and V, flash-attention,
one group, one staging row per block; 64 staging rows per buffer as 16-token
Llama-3-8B blocks get from the default 256 MiB), so 8 blocks are one piece and
512 blocks eight, as on the H100. Prints the median thread CPU of ``prepare``
and ``_enqueue`` called directly, per strategy, direction, job size and slot
kind (random or allocator); ``--profile`` adds a cProfile of ``_enqueue``.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from offload_engine import KVLayout, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.bench.slots import allocator_slots
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.launch import STOP
from offload_engine.device.runtimes.cuda import CudaRuntime

ROWS = 64  # staging rows per buffer (256 MiB / 2 buffers / 2 MiB blocks)
NB = 1536


def noop_function() -> int:
    """The address of a C function that returns 0, whatever its arguments."""
    cc = shutil.which("cc")
    if cc is None:
        raise SystemExit("needs a C compiler (cc)")
    folder = Path(tempfile.mkdtemp(prefix="oe-noop-"))
    (folder / "noop.c").write_text("int oe_noop(void) { return 0; }\n")
    lib = folder / "noop.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, folder / "noop.c"], check=True)
    fn = ctypes.CDLL(str(lib)).oe_noop
    noop_function.keep = fn  # type: ignore[attr-defined]
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def noop_runtime() -> CudaRuntime:
    """``tests/test_native_launch.py``'s driverless CUDA runtime over entry points
    that do nothing (its own driver records every call, from Python)."""
    from tests.test_native_launch import DriverlessCuda

    at = noop_function()
    p, u, z, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int

    def fn(*argtypes: Any) -> Any:
        return ctypes.CFUNCTYPE(i, *argtypes)(at)

    batch = fn(p, p, p, z, p, p, z, p)
    driver = SimpleNamespace(
        notes=[],
        batch=batch,
        batch_hold=batch,
        batch_address=at,
        batch_has_fail_idx=False,
        event_record=fn(p, p),
        stream_wait_event=fn(p, p, u),
        memcpy=fn(ctypes.c_uint64, ctypes.c_uint64, z, p),
        memcpy_htod=fn(ctypes.c_uint64, p, z, p),
        memcpy2d=fn(p, p),
        launch=fn(p, u, u, u, u, u, u, u, p, p, p),
        error_name=str,
    )
    return DriverlessCuda(driver)  # type: ignore[arg-type]


def staged_handlers(*, native: bool = True) -> tuple[Any, Any, Any]:
    """The tier and the staged store and load handlers (not started) of the shape
    above, over :func:`noop_runtime`."""
    rt = noop_runtime()
    layers = [torch.empty(2, NB, 1, 1, 64, dtype=torch.float32) for _ in range(32)]
    layout = KVLayout.flash_attention(layers)
    tier = pinned_host_tier(rt, layout, NB)
    cfg = DeviceHandlerConfig(
        strategy=CopyStrategy.STAGED,
        staging_bytes=2 * ROWS * layout.slot_bytes,
        native_launch=native,
        max_inflight=8,
    )
    store, load = make_device_handlers(rt, layout, tier, cfg)
    return tier, store, load


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sizes", default="8,512")
    parser.add_argument("--native", choices=("on", "off"), default="on")
    args = parser.parse_args()
    tier, store, load = staged_handlers(native=args.native == "on")
    rng = np.random.default_rng(0)
    ctx = SimpleNamespace(call_soon=lambda *a: None)
    for h in (store, load):
        h.start(ctx)  # type: ignore[arg-type]
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, native {args.native}")
    for per_job in (int(s) for s in args.sizes.split(",")):
        for slots in ("random", "allocator"):
            tiers = allocator_slots(NB, per_job, args.jobs) if slots == "allocator" else None
            for handler, direction in ((store, "store"), (load, "load")):
                specs = []
                for j in range(args.jobs):
                    c = rng.choice(NB, size=per_job, replace=False)
                    t = tiers[j] if tiers else rng.choice(NB, size=per_job, replace=False)
                    specs.append(
                        TransferSpec(gpu_blocks(c), cpu_blocks(t))
                        if direction == "store"
                        else TransferSpec(cpu_blocks(t), gpu_blocks(c))
                    )
                prep, enq = [], []
                prof = cProfile.Profile() if args.profile else None
                for x in specs:
                    t0 = time.thread_time_ns()
                    p = handler.prepare(x)
                    t1 = time.thread_time_ns()
                    if prof is not None:
                        prof.enable()
                    handler._enqueue(p)
                    if prof is not None:
                        prof.disable()
                    t2 = time.thread_time_ns()
                    prep.append((t1 - t0) / 1e3)
                    enq.append((t2 - t1) / 1e3)
                    handler._recycle(p)
                print(
                    f"  staged {direction:5} {per_job:3} {slots:9}: prepare "
                    f"{statistics.median(prep):6.1f} us, enqueue {statistics.median(enq):6.1f} us",
                    flush=True,
                )
                if prof is not None:
                    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    for h in (store, load):
        h._launcher._launch_q.put(STOP)
        for t in h._launcher.threads:
            t.join()
    tier.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
