"""CPU time the vLLM adapter adds per engine step, measured inside real vLLM.

Runs vLLM (CPU backend, tiny local model; see tests/vllm/e2e_runner.py) with
``TimedEngineOffloadingSpec``: ``EngineOffloadingSpec`` whose worker has every
adapter entry point (``submit_store``, ``submit_load``, ``get_finished``,
``wait``) wrapped in a timer. vLLM's connector calls ``get_finished`` once at
the end of every step, so a *step* is every adapter call since the previous
``get_finished``, that one included. For each step it records wall time
(``perf_counter_ns``) and the calling thread's CPU time (``thread_time_ns``)
spent inside the adapter; ``wait`` may block on transfers (vLLM requires it on
preemption/block reuse), so steps with a ``wait`` are also reported apart.

    PYTHONPATH=. python benchmarks/vllm_step_overhead.py [--out bench-out/overhead.json]

The timer itself costs two clock reads per call (well under a microsecond).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "vllm" / "e2e_runner.py"


def _timed_spec_class() -> type:
    from offload_engine.connectors.vllm.spec import EngineOffloadingSpec

    class TimedEngineOffloadingSpec(EngineOffloadingSpec):  # type: ignore[misc]
        """Times the worker's entry points; writes them to extra key ``overhead_path``."""

        def get_worker(self, kv_caches: Any) -> Any:
            worker = super().get_worker(kv_caches)
            if getattr(worker, "_timed", False):
                return worker
            worker._timed = True
            path = self.extra_config.get("overhead_path")
            steps: list[dict[str, Any]] = []
            current: dict[str, Any] = {"wall_ns": 0, "cpu_ns": 0, "calls": {}, "waited": False}

            def timed(name: str, fn: Any, ends_step: bool = False) -> Any:
                def wrapper(*args: Any) -> Any:
                    nonlocal current
                    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                    try:
                        return fn(*args)
                    finally:
                        wall = time.perf_counter_ns() - w0
                        cpu = time.thread_time_ns() - c0
                        current["wall_ns"] += wall
                        current["cpu_ns"] += cpu
                        current["calls"].setdefault(name, []).append(wall)
                        if name == "wait":
                            current["waited"] = True
                        if ends_step:
                            steps.append(current)
                            current = {"wall_ns": 0, "cpu_ns": 0, "calls": {}, "waited": False}

                return wrapper

            worker.submit_store = timed("submit_store", worker.submit_store)
            worker.submit_load = timed("submit_load", worker.submit_load)
            worker.wait = timed("wait", worker.wait)
            worker.get_finished = timed("get_finished", worker.get_finished, ends_step=True)
            shutdown = worker.shutdown

            def shutdown_and_dump() -> None:
                shutdown()
                if path:
                    Path(path).write_text(json.dumps({"steps": steps}))

            worker.shutdown = shutdown_and_dump
            return worker

    return TimedEngineOffloadingSpec


def __getattr__(name: str) -> Any:
    # vLLM's worker process imports this module by path and asks for the spec by
    # name; vLLM is imported only then.
    if name == "TimedEngineOffloadingSpec":
        cls = _timed_spec_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _summary(values_ns: list[int]) -> dict[str, float]:
    us = [v / 1000 for v in values_ns]
    if not us:
        return {"n": 0}
    return {
        "n": len(us),
        "median_us": statistics.median(us),
        "p90_us": _pct(us, 90),
        "p99_us": _pct(us, 99),
        "max_us": max(us),
        "mean_us": statistics.fmean(us),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the summary JSON here too")
    p.add_argument("--num-prompts", default="32")
    p.add_argument("--rounds", default="3")
    p.add_argument("--max-tokens", default="16")
    p.add_argument("--blocks-per-chunk", default="1")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="vllm-overhead-") as tmp:
        work = Path(tmp)
        raw = work / "overhead.json"
        stats = work / "engine-stats.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [
            sys.executable,
            str(RUNNER),
            "--model-dir",
            str(work / "model"),
            "--out",
            str(work / "run.json"),
            "--offload",
            "--spec-module",
            "benchmarks.vllm_step_overhead",
            "--spec-name",
            "TimedEngineOffloadingSpec",
            "--stats-path",
            str(stats),
            "--extra",
            json.dumps({"overhead_path": str(raw)}),
            "--num-prompts",
            args.num_prompts,
            "--rounds",
            args.rounds,
            "--max-tokens",
            args.max_tokens,
            "--blocks-per-chunk",
            args.blocks_per_chunk,
        ]
        log = work / "vllm.log"
        with log.open("w") as f:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=False
            )
        if proc.returncode != 0 or not raw.exists():
            sys.exit(f"vLLM run failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
        steps = json.loads(raw.read_text())["steps"]
        run = json.loads((work / "run.json").read_text())
        engine = json.loads(stats.read_text())["engine"]

    calls: dict[str, list[int]] = {}
    for s in steps:
        for name, walls in s["calls"].items():
            calls.setdefault(name, []).extend(walls)
    # a busy step submitted or waited on transfers; the others only polled get_finished
    busy = [s for s in steps if set(s["calls"]) != {"get_finished"}]
    idle = [s for s in steps if set(s["calls"]) == {"get_finished"}]
    no_wait = [s for s in steps if not s["waited"]]
    summary = {
        "steps": len(steps),
        "steps_with_transfer_calls": len(busy),
        "steps_with_wait": len(steps) - len(no_wait),
        "per_step_cpu": _summary([s["cpu_ns"] for s in steps]),
        "per_step_wall": _summary([s["wall_ns"] for s in steps]),
        "per_step_wall_without_wait": _summary([s["wall_ns"] for s in no_wait]),
        "per_busy_step_cpu": _summary([s["cpu_ns"] for s in busy]),
        "per_idle_step_cpu": _summary([s["cpu_ns"] for s in idle]),
        "per_call_wall": {name: _summary(v) for name, v in sorted(calls.items())},
        "engine": {
            k: engine[k]
            for k in ("stores_succeeded", "loads_succeeded", "bytes_stored", "bytes_loaded")
        },
        "external_prefix_cache_hits": run["metrics"].get("vllm:external_prefix_cache_hits"),
        "generate_seconds": run["seconds"]["generate"],
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
