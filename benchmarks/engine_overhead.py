"""Engine overhead with an instant handler: jobs/s and submit->result latency.

    python benchmarks/engine_overhead.py [--jobs 100000] [--latency-samples 3000] [--json out.json]
    python benchmarks/engine_overhead.py --baseline PATH [--rounds 3] [--jobs 30000]

The throughput and latency cases live in ``offload_engine.bench.overhead``
(``offload-engine bench`` runs them too); its docstring says what each one
measures. This script adds the cost of the awaits that need not wait, each of
which is a checkpoint (it yields to the loop once): CPU microseconds per

* ``await wait([job])`` whose result is already in,
* ``await wait([id])`` that fails at once (an id that is not live),
* ``await submit(spec)`` with room in the queue,

on asyncio and on trio, with an instant fake handler. With ``--baseline PATH``
(another checkout, e.g. one made with ``git archive``), each round runs every
case once on PATH's code and once on this checkout's, each in a fresh process,
alternating, and the table shows both with their ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from datetime import date
from pathlib import Path

import anyio
from _compare import compare, print_table  # a sibling: benchmarks/ is this script's path

from offload_engine import (
    OffloadingQueueManager,
    TransferSpec,
    UnknownJobError,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.bench.overhead import run_overhead
from offload_engine.testing import FakeHandler

SPEC = TransferSpec(gpu_blocks([1, 2, 3, 4]), cpu_blocks([5, 6, 7, 8]))


async def _cpu_per_await(n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with OffloadingQueueManager([FakeHandler()], capacity=n + 1) as mgr:
        ids = [mgr.submit_nowait(SPEC) for _ in range(n)]
        await mgr.wait(ids[-1:])  # an ordered route: every result is in now

        async def timed(call: Callable[[int], Awaitable[object]]) -> float:
            t0 = time.process_time()
            for i in range(n - 1):
                try:
                    await call(i)
                except UnknownJobError:
                    pass
            return (time.process_time() - t0) / (n - 1) * 1e6

        out["await wait, result already in"] = await timed(lambda i: mgr.wait([ids[i]]))
        out["await wait, fails at once"] = await timed(lambda i: mgr.wait([10**12 + i]))
        out["await submit, room in the queue"] = await timed(lambda i: mgr.submit(SPEC))
        mgr.get_finished()
    return out


def measure(jobs: int, latency_samples: int) -> dict[str, float]:
    """Every case once, in this process, as flat numbers."""
    figures: dict[str, float] = {}
    for r in run_overhead(jobs, latency_samples):
        figures[f"{r.host}: jobs/s"] = r.jobs_per_s
        figures[f"{r.host}: p50 us"] = r.p50_us
        figures[f"{r.host}: p99 us"] = r.p99_us
    for backend in ("asyncio", "trio"):
        costs = anyio.run(_cpu_per_await, min(jobs, 20_000), backend=backend)
        for case, us in costs.items():
            figures[f"{case} ({backend}), CPU us"] = us
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--latency-samples", type=int, default=3000)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare against")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.jobs, args.latency_samples)))
        return 0

    case_args = ["--jobs", str(args.jobs), "--latency-samples", str(args.latency_samples)]
    medians = compare(__file__, args.baseline, case_args, args.rounds, args.json)
    print(
        f"engine overhead, instant handler, {args.jobs:,} jobs, median of {args.rounds} "
        f"round(s), {date.today()}"
    )
    print_table(medians, "value", width=52)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
