"""One GPU's loads and stores over its own host link and borrowed peers' links: the engine
against the raw multi-path copy of the same run.

    python benchmarks/device/multipath_bandwidth.py [--gib 4] [--per-job 32,512] [--json out.json]

Needs CUDA device 0 and at least one peer it reaches (``torch.cuda.can_device_access_peer``).
For k = 0 .. every peer: **raw**, the bytes in 32 MiB chunks dealt out in turn to the own
link and k peers' (a peer's chunk goes host -> peer over the peer's link into one of two
staging buffers in its memory, then peer -> device 0 over NVLink; stores the reverse), and
**engine**, ``DeviceHandlerConfig(strategy=staged, peers=the first k peers,
native_launch=False)`` moving jobs of each ``--per-job`` size (16-token blocks of a
Llama-3-8B-shaped per-layer cache, 2 MiB a block, random tier slots), GB/s from the first
submit to the last result. Each figure the median of ``--reps``; the ratio is engine over
raw of the same k.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda import Bench, jobs_for

from offload_engine import SyncOffloadingEngine
from offload_engine.device import CopyStrategy, DeviceHandlerConfig, make_device_handlers
from offload_engine.device.runtimes.cuda import CudaRuntime

CHUNK = 32 << 20


def raw_seconds(peers: list[int], direction: str, host: torch.Tensor, dev: torch.Tensor) -> float:
    """One pass of ``host``'s bytes to ``dev`` (``load``) or back (``store``), chunks dealt
    out in turn to the own link and each of ``peers``' links; seconds until all is done."""
    own = torch.cuda.Stream(device=0)
    links = {p: torch.cuda.Stream(device=p) for p in peers}
    nvlinks = {p: torch.cuda.Stream(device=p) for p in peers}
    staging = {
        p: [torch.empty(CHUNK, dtype=torch.uint8, device=f"cuda:{p}") for _ in range(2)]
        for p in peers
    }
    free: dict[int, list[torch.cuda.Event | None]] = {p: [None, None] for p in peers}
    turns = {p: 0 for p in peers}
    paths: list[int | None] = [None, *peers]
    load = direction == "load"
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, host.numel(), CHUNK)):
        size = min(CHUNK, host.numel() - start)
        h, g = host[start : start + size], dev[start : start + size]
        path = paths[i % len(paths)]
        if path is None:
            with torch.cuda.stream(own):
                (g if load else h).copy_(h if load else g, non_blocking=True)
            continue
        b = turns[path] % 2
        turns[path] += 1
        buf = staging[path][b][:size]
        first, second = (links[path], nvlinks[path]) if load else (nvlinks[path], links[path])
        landed = torch.cuda.Event()
        with torch.cuda.stream(first):
            previous = free[path][b]
            if previous is not None:
                first.wait_event(previous)
            buf.copy_(h if load else g, non_blocking=True)
            landed.record(first)
        done = torch.cuda.Event()
        with torch.cuda.stream(second):
            second.wait_event(landed)
            (g if load else h).copy_(buf, non_blocking=True)
            done.record(second)
        free[path][b] = done
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="GiB per measured pass")
    p.add_argument("--per-job", default="32,512", help="blocks per engine job")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("multipath_bandwidth: needs CUDA", file=sys.stderr)
        return 2
    runtime = CudaRuntime()
    peers = list(runtime.peer_devices())
    if not peers:
        print("multipath_bandwidth: device 0 reaches no peer", file=sys.stderr)
        return 2
    nbytes = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    bench = Bench(runtime, 16, 1536)
    per_jobs = [int(x) for x in args.per_job.split(",")]
    rows: list[dict[str, Any]] = []
    for k in range(len(peers) + 1):
        used = peers[:k]
        raw = {
            d: nbytes / statistics.median(raw_seconds(used, d, host, dev) for _ in range(args.reps))
            for d in ("store", "load")
        }
        config = DeviceHandlerConfig(
            strategy=CopyStrategy.STAGED,
            peers=tuple(used) or None,
            native_launch=False,
            peer_min_blocks=min(per_jobs),
        )
        handlers = make_device_handlers(runtime, bench.layout, bench.tier, config)
        engine = SyncOffloadingEngine(list(handlers), capacity=100_000)
        try:
            borrowed = [h.borrowed for h in handlers]
            for per_job in per_jobs:
                n = jobs_for(per_job, bench.block_bytes, nbytes)
                moved = n * per_job * bench.block_bytes
                for d in ("store", "load"):
                    jobs = bench.specs(d, per_job, n)
                    bench.run(engine, jobs[:2])
                    gbps = moved / statistics.median(
                        bench.run(engine, jobs) for _ in range(args.reps)
                    )
                    row = {
                        "peers": used,
                        "borrowed": [list(b) for b in borrowed],
                        "per_job": per_job,
                        "direction": d,
                        "engine_gbps": gbps / 1e9,
                        "raw_gbps": raw[d] / 1e9,
                        "ratio": gbps / raw[d],
                    }
                    rows.append(row)
                    print(
                        f"paths {k + 1}  {per_job:4} blocks  {d:5}  engine {gbps / 1e9:6.1f}  "
                        f"raw {raw[d] / 1e9:6.1f} GB/s  ratio {gbps / raw[d]:.3f}",
                        flush=True,
                    )
        finally:
            engine.close()
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "devices": torch.cuda.device_count(),
                    "date": str(date.today()),
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
