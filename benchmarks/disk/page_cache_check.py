"""Whether a disk-bench system's I/O went through the page cache: the growth of
``Cached - Shmem`` in /proc/meminfo across each system's write and read (the
bench's own shared buffers are shmem, so they are left out).

    python benchmarks/disk/page_cache_check.py --dir /tmp/pcc --chunk-mib 1
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import offload_engine.bench.disk as bench


def page_cache_mib() -> int:
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) // 1024
    return fields["Cached"] - fields["Shmem"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--volume-mib", type=int, default=512)
    args = ap.parse_args()
    plan = bench.DiskBenchPlan.of_volume(int(args.chunk_mib * 2**20), args.volume_mib)
    data = plan.random_chunks()
    systems: list[tuple[str, Callable[[Path], list[bench.DiskFigure]]]] = [
        ("vllm-fs", lambda p: bench.bench_vllm_fs(p, plan, data)),
        ("engine", lambda p: bench.bench_engine(p, plan, data, layout="segments")),
        ("fio", lambda p: bench.bench_fio(p, plan)),
    ]
    for name, run in systems:
        where = args.dir / name
        where.mkdir(parents=True)
        before = page_cache_mib()
        figures = run(where)
        grew = page_cache_mib() - before
        rates = ", ".join(f"{f.system} {f.direction} {f.gbps:.2f} GB/s" for f in figures)
        print(f"{name}: {rates}; page cache grew {grew} MiB")


if __name__ == "__main__":
    main()
