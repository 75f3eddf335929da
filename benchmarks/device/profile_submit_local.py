"""Where a submit's CPU goes in the caller's thread, without a GPU.

    PYTHONPATH=$PWD python benchmarks/device/profile_submit_local.py [--jobs 200] [--profile]

The device handlers run over the driverless runtime of
``benchmarks/device/profile_launcher_local.py`` (every driver entry point one C
function that returns 0), in a :class:`SyncOffloadingEngine` with the default
launch, on ``bench_cuda.py``'s shape at a smaller scale. For 8, 64 and 512
blocks per job (random slots, stores) it prints the median thread CPU of

* ``submit`` through the engine, each job right after the previous one's result
  (what ``bench_cuda.py --passes cpu`` calls *alone*) and after a 20 ms sleep,
  and ``prepare`` called back to back;
* ``prepare`` called directly, hot (back to back), after a 20 ms sleep and after
  20 ms of other Python work (building and summing lists), with its parts:
  ``map_transfer`` (the checks), ``record_current`` and the rest.

``--profile`` adds a cProfile of the hot direct ``prepare``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.device.profile_launcher_local import NB, staged_handlers
from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device import handler as device


def _python_work() -> None:
    """20 ms of unrelated Python (objects made and dropped), as a serving step does."""
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:
        sum([i * 3 for i in range(200)])
        {str(i): i for i in range(50)}.clear()


def _sleep() -> None:
    time.sleep(0.02)


def _hot() -> None:
    pass


def _timer(name: str, fn: Callable[..., Any], parts: dict[str, list[float]]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name].append((time.thread_time_ns() - t0) / 1e3)

    return timed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sizes", default="8,64,512")
    args = parser.parse_args()
    tier, store, load = staged_handlers()
    rt = store.runtime
    rng = np.random.default_rng(0)
    half = NB // 2
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    with SyncOffloadingEngine([store, load], capacity=100_000) as engine:
        for per_job in (int(s) for s in args.sizes.split(",")):
            specs = [
                TransferSpec(
                    gpu_blocks(rng.choice(half, per_job, replace=False)),
                    cpu_blocks(rng.choice(half, per_job, replace=False)),
                )
                for _ in range(args.jobs)
            ]
            engine.wait([engine.submit(s) for s in specs[:4]])
            # through the engine, one job at a time (bench_cuda.py's "alone"), right
            # after the previous result and after a 20 ms sleep (a 512-block job's time
            # on the H100)
            alone: dict[str, list[float]] = defaultdict(list)
            prep: list[float] = []
            for how, before in (("after the result", _hot), ("after a 20 ms sleep", _sleep)):
                for s in specs[: args.jobs if before is _hot else min(args.jobs, 60)]:
                    before()
                    t0 = time.thread_time_ns()
                    job = engine.submit(s)
                    alone[how].append((time.thread_time_ns() - t0) / 1e3)
                    engine.wait([job])
            for s in specs:
                t0 = time.thread_time_ns()
                store._recycle(store.prepare(s))
                prep.append((time.thread_time_ns() - t0) / 1e3)
            shown = ", ".join(f"{k} {statistics.median(v):6.1f} us" for k, v in alone.items())
            print(
                f"{per_job:3} blocks: submit alone: {shown}; prepare back to back "
                f"{statistics.median(prep):5.1f} us",
                flush=True,
            )
            # direct prepare, hot and cold, with its parts
            for how, before in (("hot", _hot), ("sleep", _sleep), ("python", _python_work)):
                parts: dict[str, list[float]] = defaultdict(list)
                saved = device.map_transfer
                device.map_transfer = _timer("map_transfer", saved, parts)  # type: ignore[assignment]
                rt.record_current = _timer("record_current", rt.record_current, parts)  # type: ignore[method-assign]
                total = []
                n = args.jobs if how == "hot" else min(args.jobs, 60)
                for s in specs[:n]:
                    before()
                    t0 = time.thread_time_ns()
                    p = store.prepare(s)
                    total.append((time.thread_time_ns() - t0) / 1e3)
                    store._recycle(p)
                device.map_transfer = saved  # type: ignore[assignment]
                del rt.record_current
                med = {k: statistics.median(v) for k, v in parts.items()}
                rest = statistics.median(total) - sum(med.values())
                shown = ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                print(
                    f"     prepare {how:6}: {statistics.median(total):6.1f} us [{shown}, "
                    f"rest {rest:.1f}] (timers included)",
                    flush=True,
                )
            if args.profile:
                prof = cProfile.Profile()
                for s in specs:
                    prof.enable()
                    p = store.prepare(s)
                    prof.disable()
                    store._recycle(p)
                pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    tier.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
