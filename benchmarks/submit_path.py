"""The submit path's CPU cost: building a spec from each kind of id buffer, and submitting.

    python benchmarks/submit_path.py [--ids 16] [--calls 20000] [--rounds 3]
                                     [--baseline PATH] [--json out.json]

Cases (microseconds per call, the median over ``--rounds`` runs):

* ``spec from <kind>``: ``TransferSpec(host_cache_blocks(ids), cpu_blocks(ids))`` where the
  ids are a Python list, an int64 or int32 numpy array, or an int64 torch tensor;
* ``submit_nowait (fake)``: the sync facade's ``submit_nowait`` of a prebuilt spec to a fake
  handler that completes each job inside ``launch``; results are drained every 64 calls;
* ``spec + submit_nowait (host)``: what a serving engine does each step: rewrite one numpy
  id buffer, build the spec from it, and submit it to a ``HostCopyHandler`` (the handler maps
  the ids at submit); results are drained every 64 calls.

With ``--baseline PATH`` (another checkout of this repository, e.g. one made with
``git archive``), each round runs the cases once with PATH's code and once with this
checkout's, each in a fresh process, alternating, and the table shows both and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

from _compare import compare, print_table  # a sibling: benchmarks/ is this script's path


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(calls, 1000)):  # warm-up
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(n_ids: int, calls: int) -> dict[str, float]:
    """Every case once, in this process, with the ``offload_engine`` on ``sys.path``."""
    import numpy as np
    import torch

    from offload_engine import (
        HostCopyHandler,
        HostTier,
        KVLayout,
        SyncOffloadingEngine,
        TransferSpec,
        cpu_blocks,
        gpu_blocks,
        host_cache_blocks,
    )
    from offload_engine.testing import FakeHandler

    ids_list = list(range(n_ids))
    buffers = {
        "list": ids_list,
        "numpy int64": np.arange(n_ids, dtype=np.int64),
        "numpy int32": np.arange(n_ids, dtype=np.int32),
        "torch int64": torch.arange(n_ids, dtype=torch.int64),
    }
    out: dict[str, float] = {}
    for kind, ids in buffers.items():
        out[f"spec from {kind}"] = _per_call_us(
            lambda ids=ids: TransferSpec(host_cache_blocks(ids), cpu_blocks(ids)),  # type: ignore[misc]
            calls,
        )

    fake_spec = TransferSpec(gpu_blocks(ids_list), cpu_blocks(ids_list))
    with SyncOffloadingEngine([FakeHandler()], capacity=4096) as engine:
        count = [0]

        def submit_fake() -> None:
            engine.submit_nowait(fake_spec)
            count[0] += 1
            if count[0] % 64 == 0:
                engine.get_finished()

        out["submit_nowait (fake)"] = _per_call_us(submit_fake, calls)

    num_blocks = 4 * n_ids
    layout = KVLayout.from_block_tensors([torch.zeros(num_blocks, 256) for _ in range(2)])
    tier = HostTier.for_layout(layout, num_blocks)
    buf = np.zeros(n_ids, dtype=np.int64)
    rng = np.random.default_rng(0)
    perms = [rng.permutation(num_blocks)[:n_ids] for _ in range(64)]
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)], capacity=4096) as engine:
        step = [0]

        def submit_host() -> None:
            i = step[0]
            buf[:] = perms[i % 64]  # the caller reuses its id buffer every step
            engine.submit_nowait(TransferSpec(host_cache_blocks(buf), cpu_blocks(buf)))
            step[0] = i + 1
            if step[0] % 64 == 0:
                engine.get_finished()

        out["spec + submit_nowait (host)"] = _per_call_us(submit_host, calls // 4)
    tier.release()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", type=int, default=16, help="block ids per job")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare against")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # one run of every case, in this process, as JSON on stdout
        print(json.dumps(measure(args.ids, args.calls)))
        return 0
    case_args = ["--ids", str(args.ids), "--calls", str(args.calls)]
    medians, runs, trees = compare(__file__, args.baseline, case_args, args.rounds)
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "python": sys.version.split()[0],
        "ids": args.ids,
        "calls": args.calls,
        "rounds": args.rounds,
        "trees": trees,
        "median_us": medians,
        "runs_us": runs,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"submit path, {args.ids} ids per job, median of {args.rounds} rounds, {report['date']}")
    print_table(medians, "us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
