"""The disk tier without vLLM: store blocks, restart, load them back.

    python examples/disk_tier.py DIR              # store, then restart and load, in one run
    python examples/disk_tier.py DIR --phase store
    python examples/disk_tier.py DIR --phase load # in a fresh process: a real restart

A host tier of page-aligned memory holds the blocks; each one is stored under
a key (here a hash of the prompt prefix it would hold, as vLLM names them).
After a restart the store rebuilds its index from the directory, ``contains``
says how much of the key chain is there, and a load brings the bytes back,
verified against each object's checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

from offload_engine import (
    ConfigError,
    DiskStore,
    LayoutDigest,
    SyncOffloadingEngine,
    TierUnavailableError,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
    disk_handlers,
    page_aligned_tier,
)

BLOCKS = 8
BLOCK_BYTES = 256 * 1024
DIGEST = LayoutDigest(
    model="example-model", dtype="bfloat16", block_size=16, chunk_blocks=1, page_bytes=BLOCK_BYTES
)


def chain_keys(n: int) -> list[bytes]:
    """Prefix-chained keys: block i's key hashes block i-1's key (like vLLM's block hashes)."""
    keys, parent = [], b"root"
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        keys.append(parent + (0).to_bytes(4, "big"))  # hash + KV group 0
    return keys


def expected(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + i)
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=g)


def store(path: Path) -> None:
    tier = page_aligned_tier(BLOCKS, BLOCK_BYTES)
    for i in range(BLOCKS):
        tier.memory[i] = expected(i)
    with (
        DiskStore(path, DIGEST, capacity_bytes=64 * BLOCK_BYTES * 2) as disk,
        SyncOffloadingEngine(disk_handlers(disk, tier)) as engine,
    ):
        job = engine.submit(
            TransferSpec(cpu_blocks(range(BLOCKS)), disk_blocks(chain_keys(BLOCKS)))
        )
        [result] = engine.wait([job])
        if not result.success:
            raise SystemExit(f"store failed: {result.error}")
        print(
            f"stored {BLOCKS} blocks ({result.bytes_moved} bytes) in {path}; direct={disk.direct}"
        )


def load(path: Path) -> None:
    tier = page_aligned_tier(BLOCKS, BLOCK_BYTES)
    keys = chain_keys(BLOCKS) + chain_keys(BLOCKS + 2)[BLOCKS:]  # two more than were stored
    with (
        DiskStore(path, DIGEST, capacity_bytes=64 * BLOCK_BYTES * 2) as disk,
        SyncOffloadingEngine(disk_handlers(disk, tier)) as engine,
    ):
        stats = disk.stats()
        hit = disk.contains(keys)
        print(f"restarted: {stats.recovered} objects on disk; {hit} of {len(keys)} keys stored")
        if not hit:
            raise SystemExit(f"nothing to load: no block is stored in {path} (run --phase store)")
        ids = list(range(hit))[::-1]  # load into other slots than they came from
        job = engine.submit(TransferSpec(disk_blocks(keys[:hit]), cpu_blocks(ids)))
        [result] = engine.wait([job])
        if not result.success:
            raise SystemExit(f"load failed: {result.error}")
        for i, slot in enumerate(ids):
            if not torch.equal(tier.memory[slot], expected(i)):
                raise SystemExit(f"block {i} came back different")
        print(f"loaded {hit} blocks, bit-exact")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="an existing, writable directory")
    parser.add_argument("--phase", choices=("both", "store", "load"), default="both")
    args = parser.parse_args(argv)
    try:
        if args.phase in ("both", "store"):
            store(args.dir)
        if args.phase in ("both", "load"):
            load(args.dir)
    except (TierUnavailableError, ConfigError) as exc:  # a missing or foreign directory
        raise SystemExit(f"disk_tier.py: error: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
