"""Chaos through the vLLM adapter: threads drive one EngineBridge the way vLLM's worker does.

    python benchmarks/chaos_bridge.py [--jobs 100000] [--threads 4] [--seed 0]
                                      [--backend asyncio] [--json out.json]

Each thread plays a worker's model-runner step loop against one shared
:class:`~offload_engine.connectors.vllm.bridge.EngineBridge` (no vLLM needed):

* each step submits a few stores (``submit_store``) and loads (``submit_load``) with
  vLLM-style ids: cache block ids, group sizes, first block indices and tier block ids,
  as lists, numpy arrays or torch tensors; some are malformed (refused: the bridge
  returns False) and some reuse an id that is still live (refused too);
* each step drains ``get_finished`` (which may hand out other threads' results);
* now and then, as on a preemption, it ``wait``s for some of its pending jobs (ids
  already finished or never submitted included), whose results then come out of a
  later ``get_finished``;
* at the end it waits for all of its jobs and drains.

The engine behind the bridge serves a store route (GPU -> CPU) and a load route
(CPU -> GPU) of :class:`~offload_engine.testing.FaultyHandler`, which act out the chaos
fault mix. A job's fault is coded in its first cache block id, so the handler can read
it from any spec the bridge builds. Every job the bridge accepted and every result
``get_finished`` handed out go through a :class:`~offload_engine.testing.Ledger`. The
run fails (exit status 1) if a result is lost, handed out twice, unexpected or
impossible for its fault, if a worker thread dies, if the bridge still holds jobs or
results at the end, or if the adapter's counters disagree.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
import threading
import time
from collections import Counter
from datetime import date
from typing import Any

import numpy as np
import torch
from chaos import MIX, ChaosThread, chaos_arguments  # a sibling: benchmarks/chaos.py

from offload_engine import (
    CacheBlocks,
    InvalidTransferError,
    Medium,
    SyncOffloadingEngine,
    TransferSpec,
)
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.testing import Fault, FaultPlan, FaultyHandler, Ledger

FAULTS = list(Fault)
STRIDE = 1 << 20  # cache block ids of fault k lie in [k * STRIDE, (k + 1) * STRIDE)
JOB_TIMEOUT = 0.5  # the engine's default job timeout: ends the lost jobs


class CodedFaultyHandler(FaultyHandler):
    """A :class:`FaultyHandler` that reads a job's fault from its first cache block id."""

    def prepare(self, spec: TransferSpec) -> Fault:
        cache = spec.src if isinstance(spec.src, CacheBlocks) else spec.dst
        if len(cache) == 0:
            raise InvalidTransferError("no cache blocks: no fault to act out")
        fault = FAULTS[int(cache.block_ids[0]) // STRIDE % len(FAULTS)]
        if fault is Fault.REFUSED:
            self._count(fault)
            raise InvalidTransferError("refused at submit by fault injection")
        return fault


def make_bridge(backend: str) -> tuple[EngineBridge, list[CodedFaultyHandler]]:
    handlers = [
        # lost jobs hold an in-flight slot until they time out: room for many
        CodedFaultyHandler(
            FaultPlan(Medium.GPU, Medium.CPU), workers=2, ordered=True, max_inflight=64
        ),
        CodedFaultyHandler(
            FaultPlan(Medium.CPU, Medium.GPU),
            workers=1,
            ordered=False,
            max_inflight=64,
            delay=0.0002,
        ),
    ]
    engine = SyncOffloadingEngine(
        handlers,
        capacity=256,
        default_timeout=JOB_TIMEOUT,
        backend=backend,  # type: ignore[arg-type]
        thread_name="offload-engine-chaos-bridge",
    )
    quiet = logging.getLogger("offload_engine.chaos_bridge")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False  # refusals and failures are logged by the bridge, on purpose
    return EngineBridge(engine, Medium.GPU, log=quiet), handlers


class Worker(ChaosThread):
    """One thread stepping the bridge as vLLM's worker does."""

    def __init__(
        self,
        index: int,
        bridge: EngineBridge,
        ledger: Ledger,
        next_id: Any,
        jobs: int,
        seed: int,
    ) -> None:
        super().__init__(index, ledger, jobs, seed, "chaos-bridge-worker")
        self.bridge = bridge
        self.next_id = next_id
        self.pending: list[int] = []
        self.faults: dict[int, Fault] = {}

    def _ids(self, values: list[int]) -> Any:
        kind = self.rng.random()
        if kind < 0.4:
            return values
        if kind < 0.7:
            return np.array(values, dtype=self.rng.choice([np.int64, np.int32]))
        return torch.tensor(values, dtype=torch.int64)

    def _drain(self) -> None:
        self.ledger.collected(self.bridge.get_finished())

    def _submit_one(self) -> None:
        rng, bridge = self.rng, self.bridge
        job_id = next(self.next_id)
        fault = rng.choices(list(MIX), list(MIX.values()))[0]
        reuse = bool(self.pending) and rng.random() < 0.01
        if reuse:  # an id still live (refused), or finished (accepted again)
            job_id = rng.choice(self.pending)
            fault = self.faults[job_id]  # the ledger wants a reused id's fault unchanged
        n = rng.randint(1, 2)
        base = FAULTS.index(fault) * STRIDE + rng.randrange(STRIDE - 4)
        cache = [base + k for k in range(n)]
        tier = list(range(n))  # the faulty handler moves no bytes: any ids do
        malformed = rng.random() < 0.02
        if malformed:  # a vLLM-side bug: the bridge must refuse it and go on
            cache = rng.choice([[-1] * n, [], [1.5] * n])  # type: ignore[list-item]
        store = rng.random() < 0.5
        cache_ids = cache if malformed else self._ids(cache)  # numpy would truncate 1.5
        args = (job_id, cache_ids, [n], [rng.randrange(4)], self._ids(tier))
        if store:
            ok = bridge.submit_store(*args)
        else:
            ok = bridge.submit_load(job_id, args[4], args[1], args[2], args[3])
        if not ok:
            self.counts["refused"] += 1
            return
        if malformed or fault is Fault.REFUSED:
            raise AssertionError(f"job {job_id}: the bridge accepted a job it must refuse")
        self.ledger.accepted(job_id, fault, timed=True, nbytes=2)
        self.counts["accepted"] += 1
        self.counts["reused_id"] += bool(reuse)
        self.pending.append(job_id)
        self.faults[job_id] = fault
        if len(self.pending) > 256:
            del self.pending[:128]
            keep = set(self.pending)  # a reused id may appear twice
            self.faults = {j: f for j, f in self.faults.items() if j in keep}

    def _run(self) -> None:
        rng, bridge = self.rng, self.bridge
        done = 0
        while done < self.jobs:
            for _ in range(min(rng.randint(1, 8), self.jobs - done)):  # one step's jobs
                self._submit_one()
                done += 1
            self._drain()
            roll = rng.random()
            if roll < 0.05 and self.pending:  # preemption: wait for some of ours
                some = rng.sample(self.pending, min(len(self.pending), rng.randint(1, 4)))
                some.append(rng.randrange(1 << 40, 1 << 41))  # an id never submitted
                bridge.wait(some)
                self.counts["waits"] += 1
            elif roll < 0.07:
                bridge.stats()
        bridge.wait(self.pending)  # flush: everything of ours is done...
        self._drain()  # ...and its results come out now (or out of another thread's drain)


def run(jobs: int, threads: int, seed: int, backend: str) -> dict[str, Any]:
    """One chaos run through the bridge; the figures, with ``ok`` and ``problems``."""
    bridge, handlers = make_bridge(backend)
    ledger = Ledger()
    ids = iter(range(1 << 62))
    id_lock = threading.Lock()

    class Ids:
        def __next__(self) -> int:
            with id_lock:
                return next(ids)

    share = [jobs // threads + (i < jobs % threads) for i in range(threads)]
    workers = [Worker(i, bridge, ledger, Ids(), n, seed) for i, n in enumerate(share)]
    t0 = time.perf_counter()
    for w in workers:
        w.thread.start()
    for w in workers:
        w.thread.join()
    ledger.collected(bridge.get_finished())  # whatever the last drains left
    leftover = (bridge.live_jobs, bridge.stashed_results)
    stats = bridge.stats()
    bridge.shutdown()
    wall = time.perf_counter() - t0

    problems = [f"worker {w.index}: {w.where}" for w in workers if w.error is not None]
    if leftover != (0, 0):
        problems.append(f"the bridge still held {leftover[0]} live jobs, {leftover[1]} results")
    if (
        stats["adapter"]["results_delivered"]
        != stats["adapter"]["stores_submitted"] + stats["adapter"]["loads_submitted"]
    ):
        problems.append(f"adapter counters disagree: {stats['adapter']}")
    report = ledger.report()
    problems += report.problems
    counts: Counter[str] = Counter()
    for w in workers:
        counts.update(w.counts)
    injected: Counter[str] = Counter()
    for h in handlers:
        for fault, n in h.injected.items():
            if fault not in (Fault.OK, Fault.INSTANT):
                injected[fault.value] += n
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}",
        "threads": threads,
        "backend": backend,
        "jobs_attempted": jobs,
        "jobs_accepted": report.jobs,
        "refused_at_submit": counts["refused"],
        "ids_reused": counts["reused_id"],
        "failures_injected_total": sum(injected.values()),
        "waits": counts["waits"],
        "results_delivered": report.results,
        "outcomes": report.outcomes,
        "lost": report.lost,
        "duplicates": report.duplicates,
        "unexpected": report.unexpected,
        "impossible_outcomes": report.wrong,
        "wall_s": round(wall, 2),
        "jobs_per_s": round(report.jobs / wall),
        "ok": report.clean and not problems,
        "problems": problems[:20],
    }


def main() -> int:
    args = chaos_arguments(__doc__, min_threads=2)
    figures = run(args.jobs, args.threads, args.seed, args.backend)
    figures["command"] = " ".join(sys.argv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    print(f"chaos run through the vLLM bridge, {figures['date']}, {figures['machine']}")
    for key, value in figures.items():
        if key not in ("problems", "date", "machine", "command", "ok"):
            print(f"  {key:<24} {value}")
    for problem in figures["problems"]:
        print("  PROBLEM:", problem)
    print("PASS" if figures["ok"] else "FAIL")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
