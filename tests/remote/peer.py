"""One engine in its own process, sharing a remote store with another (run by the tests).

    python -m tests.remote.peer store|load redis URL|mooncake MASTER --seed S --blocks N

``store`` fills a host tier from ``seed``, stores its blocks under keys 0..N-1,
prints ``STORED``, and keeps its store client (and, on Mooncake, its memory
segment) alive until its standard input closes. ``load`` loads the keys into a
zeroed tier, compares every byte with the tier ``seed`` makes, and prints
``LOADED N EXACT`` (exit 0) or what differed (exit 1).
"""

from __future__ import annotations

import argparse
import sys

import torch

from offload_engine import (
    MooncakeStore,
    MooncakeStoreConfig,
    RedisStore,
    RedisStoreConfig,
    RemoteStore,
    RemoteTier,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    remote_blocks,
)
from tests.remote.conftest import digest, keys, random_tier


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["store", "load"])
    ap.add_argument("backend", choices=["redis", "mooncake"])
    ap.add_argument("address")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    args = ap.parse_args()

    def connect() -> RemoteStore:
        if args.backend == "redis":
            return RedisStore(RedisStoreConfig(args.address))
        # each process contributes its own segment, as one node of a cluster would
        return MooncakeStore(
            MooncakeStoreConfig(args.address, segment_bytes=64 << 20, local_buffer_bytes=16 << 20)
        )

    n = args.blocks
    expected = random_tier(n, seed=args.seed)
    tier = expected if args.role == "store" else random_tier(n, seed=args.seed + 1)
    with (
        RemoteTier(connect, tier, digest()) as remote,
        SyncOffloadingEngine(remote.handlers()) as engine,
    ):
        if args.role == "store":
            spec = TransferSpec(cpu_blocks(list(range(n))), remote_blocks(keys(n)))
            [r] = engine.wait([engine.submit_nowait(spec)])
            if not r.success:
                print(f"STORE FAILED {r.error!r}", flush=True)
                return 1
            print("STORED", flush=True)
            sys.stdin.read()  # hold the client (and its segment) until the test is done
            return 0
        found = remote.contains(keys(n))
        spec = TransferSpec(remote_blocks(keys(n)), cpu_blocks(list(range(n))))
        [r] = engine.wait([engine.submit_nowait(spec)])
        if not r.success:
            print(f"LOAD FAILED (contains {found}) {r.error!r}", flush=True)
            return 1
        bad = [b for b in range(n) if not torch.equal(tier.block(b), expected.block(b))]
        if bad:
            print(f"LOADED {n} WRONG BLOCKS {bad}", flush=True)
            return 1
        print(f"LOADED {n} EXACT (contains {found})", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
