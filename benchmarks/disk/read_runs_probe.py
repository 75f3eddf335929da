"""Segment reads: one request per run of a record's slots up to ``pack_bytes`` (the
store's rule) against one request per whole run (as disk4 first read them), beside
the file-and-pack layout, through ``offload_engine.bench.disk.bench_engine``.

    python benchmarks/disk/read_runs_probe.py --dir /tmp/rrp --chunk-mib 1 --rounds 3

Prints each variant's read GB/s per round (first pass: new segments; ``-reuse``: the
second pass into recycled ones) and the median. Cold: O_DIRECT throughout.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import offload_engine.bench.disk as bench
from offload_engine.disk.store import DiskStore


class WholeRuns(DiskStore):
    """A store that reads each run of a record's consecutive slots in one request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_slots = self._run_slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--volume-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    plan = bench.DiskBenchPlan.of_volume(int(args.chunk_mib * 2**20), args.volume_mib)
    data = plan.random_chunks()
    variants: list[tuple[str, type[DiskStore], bench.Layout]] = [
        ("capped", DiskStore, "segments"),
        ("whole-runs", WholeRuns, "segments"),
        ("packs", DiskStore, "packs"),
    ]
    reads: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name, cls, layout in variants:
            where = args.dir / f"{name}-{r}"
            where.mkdir(parents=True)
            bench.DiskStore = cls  # type: ignore[misc]
            try:
                figures = bench.bench_engine(where, plan, data, layout=layout)
            finally:
                bench.DiskStore = DiskStore  # type: ignore[misc]
                shutil.rmtree(where)
            for f in figures:
                if f.direction == "read":
                    label = name + ("-reuse" if f.system == "engine-reuse" else "")
                    reads.setdefault(label, []).append(round(f.gbps, 2))
    for label, values in reads.items():
        median = sorted(values)[len(values) // 2]
        print(f"{args.chunk_mib:g} MiB {label:18s} {values} median {median}")


if __name__ == "__main__":
    main()
