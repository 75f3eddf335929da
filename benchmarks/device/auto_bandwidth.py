"""GB/s of the default configuration's ``auto`` beside each forced strategy, per job size and
region size, against the same-run contiguous ceiling.

    python benchmarks/device/auto_bandwidth.py [--mib 2048] [--json out.json]

One process, engines built one after another with ``DeviceHandlerConfig`` defaults (16 jobs in
flight, the engine's capacity 100,000): ``auto``; ``auto`` with ``dma_backlog_min_region_bytes=0``
(rule 3 of ``device/policy.py`` without its region floor); ``dma``; ``staged``; ``auto`` again,
after four closed engines. 16-token blocks (32 KiB regions) and 64-token blocks (128 KiB); 8, 32
and 512 blocks per job, random tier slots; each figure the median of 3 runs of ``--mib`` MiB,
with the jobs each strategy took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda import Bench, contiguous_ceiling, jobs_for

from offload_engine import SyncOffloadingEngine
from offload_engine.device import CopyStrategy, DeviceHandlerConfig, make_device_handlers
from offload_engine.device.runtimes.cuda import CudaRuntime

CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("auto", {}),
    ("auto-no-region-floor", {"dma_backlog_min_region_bytes": 0}),
    ("dma", {"strategy": CopyStrategy.DMA}),
    ("staged", {"strategy": CopyStrategy.STAGED}),
    ("auto-again", {}),
]


def taken(engine: SyncOffloadingEngine) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in engine.stats().handlers:
        for name, count in h.by_strategy:
            out[name] = out.get(name, 0) + count
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=2048, help="MiB per measured run")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    runtime = CudaRuntime()
    rows: list[dict[str, Any]] = []
    for tokens, num_blocks in ((16, 1536), (64, 1152)):
        bench = Bench(runtime, tokens, num_blocks)
        ceiling = contiguous_ceiling(runtime, 1 << 30)
        print(f"[{tokens}-token blocks] ceiling {ceiling}", flush=True)
        for name, fields in CONFIGS:
            handlers = make_device_handlers(
                runtime, bench.layout, bench.tier, DeviceHandlerConfig(**fields)
            )
            engine = SyncOffloadingEngine(list(handlers), capacity=100_000)
            try:
                for per_job in (8, 32, 512):
                    n = jobs_for(per_job, bench.block_bytes, args.mib << 20)
                    nbytes = n * per_job * bench.block_bytes
                    specs = {d: bench.specs(d, per_job, n) for d in ("store", "load")}
                    bench.run(engine, specs["store"][:2] + specs["load"][:2])
                    before = taken(engine)
                    row: dict[str, Any] = {"tokens": tokens, "config": name, "per_job": per_job}
                    for case, jobs in specs.items():
                        gbps = statistics.median(nbytes / bench.run(engine, jobs) for _ in range(3))
                        row[case] = gbps / 1e9 / ceiling[case]
                    after = taken(engine)
                    row["taken"] = {k: after[k] - before.get(k, 0) for k in after}
                    rows.append(row)
                    print(
                        f"  {name:21} {per_job:4} blocks  store {row['store']:.3f}  "
                        f"load {row['load']:.3f}  {row['taken']}",
                        flush=True,
                    )
            finally:
                engine.close()
        bench.tier.release()
        del bench
        torch.cuda.empty_cache()
    if args.json:
        device = torch.cuda.get_device_name()
        Path(args.json).write_text(
            json.dumps({"device": device, "date": str(date.today()), "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
