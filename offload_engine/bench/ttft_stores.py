"""Stores of a prefill's new blocks: after the forward pass, or part by part as its layers finish.

The prefill of :mod:`offload_engine.bench.ttft` (its model, KV cache, tier and engine)
computes ``N`` new tokens over a prefix of ``H`` tokens already in the cache; its
``N / block_tokens`` new blocks are then stored into the pinned tier. Per ``(H, N)``
cell, each the median of ``reps`` rounds (variants interleaved within a round, after
one untimed round):

* **C**, the prefill alone;
* **s1**, the store after the forward pass (as vLLM stores a step's blocks): the
  forward pass is launched, then one engine job stores every new block, its copies
  ordered after the last layer's compute;
* **s2**, once per ``G`` in ``layers_per_load``: one store job per ``G`` consecutive
  layers of the new blocks (``TransferSpec(..., tensors=<the part's KV tensors>)``),
  each submitted right after the forward pass launched the part's last layer, so its
  copies wait for that layer's compute and run while the later layers compute (as
  ``store_mode: layerwise`` of the vLLM adapter does).

Two times per run, both from the prefill's start (the device synchronized): the
**prefill**, until the compute stream has finished the last layer (an event recorded
there right after the forward pass, waited on by the host), and **done**, until the
last store's result. Reported per cell: each variant's prefill against C (the
slowdown the stores in flight cost the forward pass) and its done time, and
``s2 done / s1 done`` (below 1 where storing during the forward pass pays).

Before a cell is timed, an s2 per ``G`` runs untimed over a poisoned copy of the
new blocks; the tier's bytes are then loaded back over poison and compared, bit for
bit, with the cache's bytes after the forward pass: a store part that did not wait
for its layers' compute leaves poison in the tier. A mismatch is an error in the row.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from offload_engine import TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.bench.ttft import (
    POISON,
    TtftBench,
    TtftDevice,
    TtftPlan,
    check_results,
    timed_rounds,
)
from offload_engine.errors import ConfigError

#: the prefill alone, and the store of every new block after it
COMPUTE, AFTER = "C", "s1"


def store_variants(plan: TtftPlan) -> tuple[str, ...]:
    """A round's variants, in the order they run."""
    return (COMPUTE, AFTER, *(f"s2-{g}" for g in plan.layers_per_load))


def store_ticks(plan: TtftPlan) -> int:
    """How many times :func:`run_store_pass` calls ``tick``."""
    cells = len(plan.hits) * len(plan.new)
    return cells * ((plan.reps + 1) * len(store_variants(plan)) + len(plan.layers_per_load))


class StoreBench:
    """The prefill of a :class:`TtftBench`, with its new blocks stored into the tier
    (slots ``0 .. N / block_tokens - 1``, over the hit stored there)."""

    def __init__(self, bench: TtftBench) -> None:
        plan = bench.plan
        if max(plan.new) > bench.tier.num_blocks * plan.shape.block_tokens:
            raise ConfigError(
                f"the store pass keeps the new blocks in the hit's tier: new tokens "
                f"{max(plan.new)} must not exceed the largest hit, {max(plan.hits)}"
            )
        self.bench = bench

    def _fresh(self, hit: int, new: int) -> tuple[int, np.ndarray[Any, Any]]:
        """The request's block count and its new blocks' cache ids."""
        bt = self.bench.plan.shape.block_tokens
        blocks = (hit + new) // bt
        return blocks, self.bench.table_np[blocks - new // bt : blocks]

    def run(self, variant: str, hit: int, new: int) -> tuple[float, float]:
        """Seconds of one run of ``variant``: (prefill, done)."""
        b = self.bench
        layers = b.plan.shape.layers
        engine = b._engine()
        blocks, fresh = self._fresh(hit, new)
        cache, tier = gpu_blocks(fresh), cpu_blocks(np.arange(len(fresh)))
        per = int(variant.split("-", 1)[1]) if variant.startswith("s2") else 0
        table, x = b.table[:blocks], b.x[:new]
        end = b.runtime.new_event()
        jobs: list[int] = []
        b.device.sync()
        t0 = time.perf_counter()
        for i in range(layers):
            b.device.launch(partial(b.model.step, i, b.cache[i], table, x))
            if per and ((i + 1) % per == 0 or i + 1 == layers):
                part = tuple(range(i - i % per, i + 1))
                jobs.append(engine.submit(TransferSpec(cache, tier, tensors=part)))
        if variant == AFTER:
            jobs.append(engine.submit(TransferSpec(cache, tier)))
        b.runtime.record(end, b.runtime.current_stream())
        b.runtime.synchronize(end)
        prefill = time.perf_counter() - t0
        if jobs:
            check_results(engine.wait(jobs))
        return prefill, time.perf_counter() - t0

    def _poison(self, fresh: np.ndarray[Any, Any]) -> None:
        ids = torch.as_tensor(fresh, device=self.bench.table.device)
        for t in self.bench.cache:
            t.index_fill_(0, ids, POISON)
        self.bench.device.sync()

    def mismatched(self, hit: int, new: int, per: int) -> int:
        """Run s2 with ``per`` layers a part over poisoned new blocks; how many of them
        differ in any byte between the cache and the tier (loaded back over poison)."""
        b = self.bench
        _, fresh = self._fresh(hit, new)
        self._poison(fresh)
        self.run(f"s2-{per}", hit, new)
        ids = torch.as_tensor(fresh, device=b.table.device)
        want = [t.index_select(0, ids) for t in b.cache]
        self._poison(fresh)
        engine = b._engine()
        load = TransferSpec(cpu_blocks(np.arange(len(fresh))), gpu_blocks(fresh))
        check_results(engine.wait([engine.submit(load)]))
        n = len(fresh)
        bad = torch.zeros(n, dtype=torch.bool, device=ids.device)
        for t, ref in zip(b.cache, want, strict=True):
            got = t.index_select(0, ids).reshape(n, -1).view(torch.uint8)
            bad |= (got != ref.reshape(n, -1).view(torch.uint8)).any(dim=1)
        return int(bad.sum())


def _row(
    plan: TtftPlan,
    hit: int,
    new: int,
    samples: dict[str, list[tuple[float, float]]],
    mismatches: dict[int, int],
) -> dict[str, Any]:
    prefill = {v: statistics.median(p for p, _ in x) * 1e3 for v, x in samples.items()}
    done = {v: statistics.median(d for _, d in x) * 1e3 for v, x in samples.items()}
    compute = prefill[COMPUTE]
    gs = {str(g): f"s2-{g}" for g in plan.layers_per_load}
    errors = [
        f"G={g}: {n} of {new // plan.shape.block_tokens} new blocks differ in the tier "
        "after the layer-wise store"
        for g, n in mismatches.items()
        if n
    ]
    return {
        "hit_tokens": hit,
        "new_tokens": new,
        "new_bytes": new // plan.shape.block_tokens * plan.shape.block_bytes,
        "compute_ms": compute,
        "after_prefill_ms": prefill[AFTER],
        "after_done_ms": done[AFTER],
        "layerwise_prefill_ms": {g: prefill[v] for g, v in gs.items()},
        "layerwise_done_ms": {g: done[v] for g, v in gs.items()},
        "after_prefill_vs_compute": prefill[AFTER] / compute,
        "layerwise_prefill_vs_compute": {g: prefill[v] / compute for g, v in gs.items()},
        "layerwise_done_vs_after": {g: done[v] / done[AFTER] for g, v in gs.items()},
        "bit_exact": not errors,
        "mismatched_blocks": {str(g): n for g, n in mismatches.items()},
        "errors": errors,
        "reps": plan.reps,
        "samples_ms": {
            v: [[p * 1e3, d * 1e3] for p, d in x] for v, x in samples.items()
        },  # [prefill, done] per timed run
    }


def run_store_pass(
    device: TtftDevice,
    plan: TtftPlan | None = None,
    *,
    tick: Callable[[str], None] = lambda what: None,
) -> list[dict[str, Any]]:
    """One row (a plain dict) per ``(H, N)`` of ``plan`` (see the module docstring)."""
    plan = plan or TtftPlan()
    bench = TtftBench(device, plan)
    try:
        stores = StoreBench(bench)
        rows = []
        for hit in plan.hits:
            for new in plan.new:
                mismatches = {}
                for g in plan.layers_per_load:
                    tick(f"stores H {hit} N {new} check G={g}")
                    mismatches[g] = stores.mismatched(hit, new, g)
                samples = timed_rounds(
                    store_variants(plan),
                    plan.reps,
                    partial(stores.run, hit=hit, new=new),
                    tick,
                    f"stores H {hit} N {new}",
                )
                rows.append(_row(plan, hit, new, samples, mismatches))
        return rows
    finally:
        bench.close()


def format_store_rows(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The rows as a text table, one line per ``(H, N)``, milliseconds and ratios."""
    if not rows:
        return []
    gs = list(rows[0]["layerwise_done_ms"])
    head = (
        f"{'H':>6} {'N':>5} {'C':>8} {'s1 pre':>8} {'s1 done':>8} "
        + " ".join(f"{'s2 pre G=' + g:>11} {'s2 done G=' + g:>12}" for g in gs)
        + " "
        + " ".join(f"{'s2/s1 G=' + g:>10}" for g in gs)
        + "  check"
    )
    out = [head]
    for r in rows:
        cells = " ".join(
            f"{r['layerwise_prefill_ms'][g]:11.2f} {r['layerwise_done_ms'][g]:12.2f}" for g in gs
        )
        ratios = " ".join(f"{r['layerwise_done_vs_after'][g]:10.3f}" for g in gs)
        check = "bit-exact" if r["bit_exact"] else "ERROR: " + "; ".join(r["errors"])
        out.append(
            f"{r['hit_tokens']:6} {r['new_tokens']:5} {r['compute_ms']:8.2f} "
            f"{r['after_prefill_ms']:8.2f} {r['after_done_ms']:8.2f} {cells} {ratios}  {check}"
        )
    out.append(
        "ms, median of each row's reps, from the prefill's start: C the prefill alone; s1 the "
        "store of every new block after the forward pass, s2 one store per G layers as they "
        "finish; pre = until the last layer's compute is done, done = until the last store is; "
        "s2/s1 = s2 done / s1 done"
    )
    return out
