"""The submit path's CPU cost: building a spec from each kind of id buffer, and submitting.

    python benchmarks/submit_path.py [--ids 16] [--calls 20000] [--rounds 3]
                                     [--baseline PATH] [--json out.json]

Cases (microseconds per call, the median over ``--rounds`` runs):

* ``spec from <kind>``: ``TransferSpec(host_cache_blocks(ids), cpu_blocks(ids))`` where the
  ids are a Python list, an int64 or int32 numpy array, or an int64 torch tensor;
* ``submit_nowait (fake)``: the sync facade's ``submit_nowait`` of a prebuilt spec to a fake
  handler that completes each job inside ``launch``;
* ``spec + submit_nowait (host)``: what a serving engine does each step: rewrite one numpy
  id buffer, build the spec from it, and submit it to a ``HostCopyHandler`` (the handler maps
  the ids at submit).

Submits are timed in batches of 64, whose jobs are then waited for untimed.

With ``--baseline PATH`` (another checkout of this repository, e.g. one made with
``git archive``), each round runs the cases once with PATH's code and once with this
checkout's, each in a fresh process, alternating, and the table shows both and their ratio.
"""

from __future__ import annotations

import argparse
import json
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

    def timed_batches(engine: SyncOffloadingEngine, submit: Callable[[int], int], n: int) -> float:
        """Microseconds per submit: batches of 64 submits are timed, and their jobs are
        waited for untimed (so the queue never fills); 4 batches warm up first."""
        spent, batches = 0.0, max(1, n // 64)
        for b in range(batches + 4):
            t0 = time.perf_counter()
            ids = [submit(i) for i in range(64)]
            if b >= 4:
                spent += time.perf_counter() - t0
            engine.wait(ids)
        return spent / (batches * 64) * 1e6

    fake_spec = TransferSpec(gpu_blocks(ids_list), cpu_blocks(ids_list))
    with SyncOffloadingEngine([FakeHandler()], capacity=4096) as engine:
        out["submit_nowait (fake)"] = timed_batches(
            engine, lambda i: engine.submit_nowait(fake_spec), calls
        )

    num_blocks = 4 * n_ids
    layout = KVLayout.from_block_tensors([torch.zeros(num_blocks, 256) for _ in range(2)])
    tier = HostTier.for_layout(layout, num_blocks)
    buf = np.zeros(n_ids, dtype=np.int64)
    rng = np.random.default_rng(0)
    perms = [rng.permutation(num_blocks)[:n_ids] for _ in range(64)]
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)], capacity=4096) as engine:

        def submit_host(i: int) -> int:
            buf[:] = perms[i]  # the caller reuses its id buffer every step
            return engine.submit_nowait(TransferSpec(host_cache_blocks(buf), cpu_blocks(buf)))

        out["spec + submit_nowait (host)"] = timed_batches(engine, submit_host, calls // 4)
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
    medians = compare(__file__, args.baseline, case_args, args.rounds, args.json)
    print(f"submit path, {args.ids} ids per job, median of {args.rounds} rounds, {date.today()}")
    print_table(medians, "us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
