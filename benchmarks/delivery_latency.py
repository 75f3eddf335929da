"""How long a finished job's result takes to reach a thread that polls for it.

    PYTHONPATH=. python benchmarks/delivery_latency.py [--jobs 30] [--slice-us 300]

A stand-in for a device's completion watcher sleeps to a deadline with the GIL
released (as a thread blocked in ``cuEventSynchronize`` does), then reports the job
to a :class:`~offload_engine.testing.FakeHandler`; the main thread polls
``get_finished`` between slices of work. Printed: the delay from the deadline to the
main thread seeing the result (median and p90, ms) when the main thread sleeps
between polls, when it runs Python between them (as vLLM's engine loop does), and
the latter under a 0.5 ms switch interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from offload_engine import BlockSpec, Medium, SyncOffloadingEngine, TransferSpec
from offload_engine.testing import FakeHandler


def python_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(50))


def delivery_ms(busy: bool, jobs: int, slice_s: float, delay_s: float = 0.02) -> list[float]:
    handler = FakeHandler(Medium.GPU, Medium.CPU, manual=True)
    out: list[float] = []
    with SyncOffloadingEngine([handler]) as engine:
        for job in range(jobs):
            engine.submit_nowait(
                TransferSpec(BlockSpec(Medium.GPU, [job]), BlockSpec(Medium.CPU, [job])),
                job_id=job,
            )
            handler.wait_launched_blocking(job + 1)
            deadline = time.perf_counter() + delay_s

            def watcher(job: int = job, deadline: float = deadline) -> None:
                time.sleep(max(0.0, deadline - time.perf_counter()))
                handler.complete(job)

            thread = threading.Thread(target=watcher)
            thread.start()
            seen = None
            while seen is None:
                if busy:
                    python_work(slice_s)
                else:
                    time.sleep(slice_s)
                if engine.get_finished():
                    seen = time.perf_counter()
            thread.join()
            out.append(1e3 * (seen - deadline))
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=30)
    p.add_argument("--slice-us", type=float, default=300.0, help="work or sleep between polls")
    args = p.parse_args(argv)
    slice_s = args.slice_us * 1e-6
    interval = sys.getswitchinterval()
    print(
        f"delivery to the polling thread, ms ({args.jobs} jobs, {args.slice_us:g} us between polls)"
    )
    for label, busy, switch in (
        ("sleeps between polls", False, interval),
        ("runs Python between polls", True, interval),
        ("runs Python, switch interval 0.5 ms", True, 0.0005),
    ):
        sys.setswitchinterval(switch)
        try:
            ms = delivery_ms(busy, args.jobs, slice_s)
        finally:
            sys.setswitchinterval(interval)
        p90 = ms[int(0.9 * (len(ms) - 1))]
        print(f"  {label:38} median {statistics.median(ms):6.2f}  p90 {p90:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
