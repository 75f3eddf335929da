"""The ``offload-engine`` command (also ``python -m offload_engine``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from offload_engine.handlers.host import HostCopyHandler
from offload_engine.hosts import SyncOffloadingEngine
from offload_engine.testing import cache_block_bytes, poisoned_tier, random_host_cache
from offload_engine.vocabulary import TransferResult, TransferSpec, cpu_blocks, host_cache_blocks


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


class _DemoTierBook:
    """What a scheduler knows about the tier: free blocks, readable stores, pins.

    Like a serving engine's offloading manager, it lets a load read only blocks
    whose store has completed, never evicts blocks a load is reading, and never
    aims two in-flight loads at one destination block.
    """

    def __init__(self, tier_blocks: int, cache_range: range) -> None:
        self.free: deque[int] = deque(range(tier_blocks))
        self.readable: deque[tuple[list[int], list[int]]] = deque()  # (tier ids, source ids)
        self.pins: dict[int, int] = {}
        self.dst_free: deque[int] = deque(cache_range)
        self.final: dict[int, int] = {}  # destination cache block -> source cache block

    def take_free(self, n: int) -> list[int] | None:
        """``n`` tier blocks to store into, evicting the oldest unpinned stores."""
        for entry in list(self.readable):
            if len(self.free) >= n:
                break
            if not any(self.pins.get(t) for t in entry[0]):
                self.readable.remove(entry)
                self.free.extend(entry[0])
        if len(self.free) < n:
            return None
        return [self.free.popleft() for _ in range(n)]

    def pick_hit(self, n: int) -> tuple[list[int], list[int], list[int]] | None:
        if not self.readable or len(self.dst_free) < n:
            return None
        tiers, sources = self.readable[-1]
        for t in tiers:
            self.pins[t] = self.pins.get(t, 0) + 1
        dsts = [self.dst_free.popleft() for _ in range(n)]
        return tiers, sources, dsts

    def load_done(self, tiers: list[int], sources: list[int], dsts: list[int], ok: bool) -> None:
        for t in tiers:
            self.pins[t] -= 1
        if ok:
            self.final.update(zip(dsts, sources, strict=True))
        self.dst_free.extend(dsts)


def run_demo(args: argparse.Namespace) -> int:
    """A serving loop in miniature: each step stores new blocks and loads a prefix hit."""
    steps, per_job = args.steps, args.blocks_per_job
    nb = 1024
    if per_job * 8 > nb // 2:
        raise SystemExit(f"--blocks-per-job {per_job} is too large for the demo (max {nb // 16})")
    _, layout = random_host_cache(
        num_layers=args.layers, num_blocks=nb, block_tokens=16, kv_heads=4, head_dim=64, seed=0
    )
    half = nb // 2  # stores read cache blocks [0, half); loads write [half, nb)
    book = _DemoTierBook(tier_blocks=half, cache_range=range(half, nb))
    rng = np.random.default_rng(0)
    pending: dict[int, tuple[str, list[int], list[int], list[int]]] = {}
    results: list[TransferResult] = []

    def settle(batch: list[TransferResult]) -> None:
        for r in batch:
            results.append(r)
            kind, tiers, sources, dsts = pending.pop(r.job_id)
            if kind == "store":
                book.free.extend(tiers) if not r.success else book.readable.append((tiers, sources))
            else:
                book.load_done(tiers, sources, dsts, r.success)

    print(
        f"demo: {steps} steps, each storing {per_job} new blocks and loading a prefix hit of "
        f"{per_job}; {layout.slot_bytes / 1024:.0f} KiB per block; host memory <-> host tier"
    )
    tier = poisoned_tier(layout, half)
    t0 = time.perf_counter()
    with SyncOffloadingEngine([HostCopyHandler(layout, tier, workers=args.workers)]) as engine:
        for _ in range(steps):
            tiers = book.take_free(per_job)
            if tiers is not None:
                sources = rng.choice(half, size=per_job, replace=False).tolist()
                jid = engine.submit(TransferSpec(host_cache_blocks(sources), cpu_blocks(tiers)))
                pending[jid] = ("store", tiers, sources, [])
            hit = book.pick_hit(per_job)
            if hit is not None:
                tiers, sources, dsts = hit
                jid = engine.submit(TransferSpec(cpu_blocks(tiers), host_cache_blocks(dsts)))
                pending[jid] = ("load", tiers, sources, dsts)
            settle(engine.get_finished())
            while len(pending) > args.max_outstanding:
                # a real step computes for a while; here the oldest job sets the pace
                settle(engine.wait([next(iter(pending))]))
        settle(engine.wait(list(pending)))
    seconds = time.perf_counter() - t0
    failed = sum(not r.success for r in results)
    moved = sum(r.bytes_moved for r in results)
    corrupt = sum(
        cache_block_bytes(layout, d) != cache_block_bytes(layout, s) for d, s in book.final.items()
    )
    lat = sorted(r.latency for r in results)
    p50, p99 = lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3
    print(f"jobs        {len(results):>10,}   failed {failed}")
    print(f"throughput  {len(results) / seconds:>10,.0f} jobs/s   {moved / seconds / 1e9:.2f} GB/s")
    print(f"latency     p50 {p50:.2f} ms   p99 {p99:.2f} ms (submit -> result)")
    print(f"integrity   {len(book.final):,} loaded blocks compared bytewise, {corrupt} corrupt")
    return 1 if failed or corrupt else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload-engine", description="Move KV-cache blocks between memory tiers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="push a few thousand host-to-host jobs through the engine")
    demo.add_argument("--steps", type=_positive_int, default=2000, help="scheduling steps")
    demo.add_argument("--blocks-per-job", type=_positive_int, default=8)
    demo.add_argument("--layers", type=_positive_int, default=8)
    demo.add_argument("--workers", type=_positive_int, default=2, help="host copy threads")
    demo.add_argument(
        "--max-outstanding", type=_positive_int, default=16, help="jobs in flight per step"
    )
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
