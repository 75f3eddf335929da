"""Engine overhead with an instant handler: jobs/s and submit->result latency.

    python benchmarks/engine_overhead.py [--jobs 100000] [--latency-samples 3000] [--json out.json]

The cases live in ``offload_engine.bench.overhead`` (``offload-engine bench``
runs them too); its docstring says what each one measures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date

from offload_engine.bench.overhead import run_overhead


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--latency-samples", type=int, default=3000)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    report: dict[str, object] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "python": sys.version.split()[0],
        "jobs": args.jobs,
    }
    results = run_overhead(args.jobs, args.latency_samples)
    for r in results:
        report[r.key] = r.as_dict()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"engine overhead, instant handler, {args.jobs:,} jobs, {report['date']}")
    print(f"{'host':<22} {'jobs/s':>12} {'p50 / p99 submit->result (us)':>32}")
    for r in results:
        lat = f"{r.p50_us:.0f} / {r.p99_us:.0f}"
        print(f"{r.host:<22} {r.jobs_per_s:>12,.0f} {lat:>32}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
