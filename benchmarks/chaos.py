"""Chaos run: many jobs from many threads with injected failures; nothing may be lost.

    python benchmarks/chaos.py [--jobs 100000] [--threads 4] [--seed 0] [--backend asyncio]
                               [--json out.json]

A :class:`~offload_engine.SyncOffloadingEngine` serves three routes of
:class:`~offload_engine.testing.FaultyHandler` (one ordered with two workers,
one unordered, one slow and narrow, so its queue fills). Each producer thread
submits its share of the jobs with a mix of faults: jobs that succeed (on a
worker or inside ``launch``), fail, raise in the worker or at launch,
misreport their byte count, are refused at submit, or are never reported
(those carry a timeout). On top of that, producers give some jobs tiny
timeouts, cancel some of their jobs, retry a live job id (which must be
refused), and use both ``submit_nowait`` (retrying on ``QueueFullError``) and
the blocking ``submit``. Results are collected by the producers
(``get_finished``, ``wait``), by a collector thread, and by ``close``.

Every accepted job and every result goes through a
:class:`~offload_engine.testing.Ledger`; the run fails (exit status 1) if a
result is lost, duplicated, unexpected, or impossible for its job's fault, if
a confirmed cancel has no cancelled result, or if the engine's own counters
disagree.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import threading
import time
import traceback
from collections import Counter
from datetime import date

from offload_engine import (
    DuplicateJobIdError,
    InvalidTransferError,
    Medium,
    QueueFullError,
    SyncOffloadingEngine,
    UnknownJobError,
)
from offload_engine.testing import Fault, FaultPlan, FaultyHandler, Ledger

# fault mix, per 1,000 jobs
MIX = {
    Fault.OK: 700,
    Fault.INSTANT: 100,
    Fault.FAIL: 40,
    Fault.RAISE: 40,
    Fault.LAUNCH_RAISES: 40,
    Fault.BAD_REPORT: 20,
    Fault.LOST: 20,
    Fault.REFUSED: 40,
}
EXPLICIT_IDS = 1 << 40  # explicit ids live above the automatic ones


class ChaosThread:
    """A thread of a chaos run: its seed, its counts, and what killed it (if anything).
    Subclasses implement :meth:`_run`."""

    def __init__(self, index: int, ledger: Ledger, jobs: int, seed: int, name: str) -> None:
        self.index = index
        self.ledger = ledger
        self.jobs = jobs
        self.rng = random.Random(seed * 1_000 + index)
        self.counts: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.where = ""  # the end of the traceback of ``error``
        self.thread = threading.Thread(target=self.run, name=f"{name}-{index}")

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
            self.where = traceback.format_exc(limit=-3)

    def _run(self) -> None:
        raise NotImplementedError


class Producer(ChaosThread):
    """One submitting thread and what it counted."""

    def __init__(
        self,
        index: int,
        engine: SyncOffloadingEngine,
        handlers: list[FaultyHandler],
        ledger: Ledger,
        jobs: int,
        seed: int,
    ) -> None:
        super().__init__(index, ledger, jobs, seed, "chaos-producer")
        self.engine = engine
        self.handlers = handlers
        self._next_id = EXPLICIT_IDS + (index << 32)

    def _collect(self, results: list) -> None:  # type: ignore[type-arg]
        self.ledger.collected(results)

    def _run(self) -> None:
        rng, engine, counts = self.rng, self.engine, self.counts
        faults, weights = list(MIX), list(MIX.values())
        recent: list[int] = []
        for i in range(self.jobs):
            handler = rng.choice(self.handlers)
            fault = rng.choices(faults, weights)[0]
            timeout = None
            if fault is Fault.LOST:
                timeout = rng.choice([0.001, 0.01, 0.05])
            elif rng.random() < 0.02:
                timeout = rng.choice([0.0001, 0.001])  # may time out in the queue or in flight
            explicit = rng.random() < 0.2
            jid = None
            if explicit:
                jid, self._next_id = self._next_id, self._next_id + 1
            spec = handler.plan.spec(fault)
            try:
                if rng.random() < 0.5:
                    try:
                        got = engine.submit_nowait(spec, job_id=jid, timeout=timeout)
                    except QueueFullError:  # drain what is there, then wait for room
                        counts["queue_full"] += 1
                        self._collect(engine.get_finished())
                        got = engine.submit(spec, job_id=jid, timeout=timeout)
                else:
                    got = engine.submit(spec, job_id=jid, timeout=timeout)
            except InvalidTransferError:
                if fault is not Fault.REFUSED:
                    raise
                counts["refused_at_submit"] += 1
                continue
            if fault is Fault.REFUSED:
                raise AssertionError(f"job {got}: a refused job was accepted")
            self.ledger.accepted(got, fault, timed=timeout is not None, nbytes=handler.plan.nbytes)
            counts["accepted"] += 1
            counts[f"fault:{fault.value}"] += 1
            if timeout is not None and fault is not Fault.LOST:
                counts["short_timeout"] += 1
            recent.append(got)
            if len(recent) > 64:
                recent.pop(0)
            roll = rng.random()
            if roll < 0.03:  # cancel one of ours; True only if it was still queued
                victim = rng.choice(recent)
                try:
                    if engine.cancel(victim):
                        self.ledger.cancel_confirmed(victim)
                        counts["cancelled"] += 1
                except UnknownJobError:
                    pass  # already collected by someone
            elif roll < 0.04 and explicit:  # the same id again, while it may be live
                try:
                    again = engine.submit_nowait(spec, job_id=got, timeout=timeout)
                except DuplicateJobIdError:
                    counts["duplicate_refused"] += 1
                except QueueFullError:
                    counts["queue_full"] += 1
                else:  # it was collected meanwhile: a legitimate reuse
                    self.ledger.accepted(
                        again, fault, timed=timeout is not None, nbytes=handler.plan.nbytes
                    )
                    counts["accepted"] += 1
                    counts["id_reused"] += 1
            elif roll < 0.06:  # wait for a few of ours; others may have collected them
                some = rng.sample(recent, min(3, len(recent)))
                try:
                    self._collect(engine.wait(some, timeout=0.002))
                except (TimeoutError, UnknownJobError):
                    pass
            if i % 64 == 63:
                self._collect(engine.get_finished())


def chaos_arguments(doc: str, min_threads: int) -> argparse.Namespace:
    """The command line every chaos script takes: jobs, threads, seed, backend, json."""
    parser = argparse.ArgumentParser(description=doc.split("\n", maxsplit=1)[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if args.threads < min_threads or args.jobs < 1:
        parser.error(f"use at least {min_threads} threads and 1 job")
    return args


def main() -> int:
    args = chaos_arguments(__doc__, min_threads=4)

    handlers = [
        FaultyHandler(FaultPlan(Medium.GPU, Medium.CPU), workers=2, ordered=True),
        FaultyHandler(FaultPlan(Medium.CPU, Medium.GPU), workers=2, ordered=False),
        FaultyHandler(FaultPlan(Medium.NPU, Medium.CPU), workers=1, max_inflight=4, delay=0.0002),
    ]
    ledger = Ledger()
    share = [
        args.jobs // args.threads + (i < args.jobs % args.threads) for i in range(args.threads)
    ]
    stop = threading.Event()
    t0 = time.perf_counter()
    engine = SyncOffloadingEngine(handlers, capacity=256, backend=args.backend)

    def collector() -> None:  # a third party collecting whatever is there
        while not stop.wait(0.005):
            ledger.collected(engine.get_finished())

    producers = [Producer(i, engine, handlers, ledger, n, args.seed) for i, n in enumerate(share)]
    side = threading.Thread(target=collector, name="chaos-collector")
    side.start()
    for p in producers:
        p.thread.start()
    for p in producers:
        p.thread.join()
    stop.set()
    side.join()
    leftovers = engine.close(timeout=1.0)
    ledger.collected(leftovers)
    wall = time.perf_counter() - t0
    stats = engine.stats()

    errors = [f"producer {p.index}: {p.error!r}" for p in producers if p.error is not None]
    counts: Counter[str] = Counter()
    for p in producers:
        counts.update(p.counts)
    report = ledger.report()
    injected: Counter[str] = Counter()
    for h in handlers:
        for fault, n in h.injected.items():
            if fault not in (Fault.OK, Fault.INSTANT):
                injected[fault.value] += n
    engine_submitted = sum(h.submitted for h in stats.handlers)
    engine_finished = sum(h.succeeded + h.failed for h in stats.handlers)
    if engine_submitted != report.jobs or engine_finished != report.results:
        errors.append(
            f"engine counters disagree: submitted {engine_submitted} vs {report.jobs} accepted, "
            f"finished {engine_finished} vs {report.results} results"
        )
    timed_out = report.outcomes.get("JobTimeoutError", 0)
    figures = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}",
        "command": " ".join(sys.argv),
        "threads": args.threads,
        "backend": args.backend,
        "jobs_attempted": args.jobs,
        "jobs_accepted": report.jobs,
        "refused_at_submit": counts["refused_at_submit"],
        "failures_injected": dict(injected),
        "failures_injected_total": sum(injected.values()),
        "timeouts": timed_out,
        "cancels_confirmed": report.cancels_confirmed,
        "duplicate_ids_refused": counts["duplicate_refused"],
        "ids_reused": counts["id_reused"],
        "queue_full": counts["queue_full"],
        "results_delivered": report.results,
        "results_at_close": len(leftovers),
        "outcomes": report.outcomes,
        "lost": report.lost,
        "duplicates": report.duplicates,
        "unexpected": report.unexpected,
        "impossible_outcomes": report.wrong,
        "wall_s": round(wall, 2),
        "jobs_per_s": round(report.jobs / wall),
        "problems": report.problems + errors,
    }
    ok = report.clean and not errors
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    print(f"chaos run, {figures['date']}, {figures['machine']}")
    for key in (
        "threads",
        "jobs_attempted",
        "jobs_accepted",
        "refused_at_submit",
        "failures_injected_total",
        "timeouts",
        "cancels_confirmed",
        "duplicate_ids_refused",
        "ids_reused",
        "queue_full",
        "results_delivered",
        "results_at_close",
        "lost",
        "duplicates",
        "unexpected",
        "impossible_outcomes",
        "wall_s",
        "jobs_per_s",
    ):
        print(
            f"  {key:<24} {figures[key]:>12,}"
            if isinstance(figures[key], int)
            else f"  {key:<24} {figures[key]:>12}"
        )
    print(f"  {'failures by kind':<24} {dict(sorted(injected.items()))}")
    print(f"  {'outcomes':<24} {dict(sorted(report.outcomes.items()))}")
    for problem in figures["problems"][:20]:  # type: ignore[index]
        print("  PROBLEM:", problem)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
