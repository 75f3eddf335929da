"""How fast the trailer's checksum could be: xxh64 (the format's) against xxh3.

    python benchmarks/remote/hash_speed.py [--mib 2] [--rounds 100]

Hashes one random buffer with each function of the ``xxhash`` package, same
run, one thread, and prints GB/s.
"""

from __future__ import annotations

import argparse
import os
import time

import xxhash


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    data = os.urandom(int(args.mib * 2**20))
    for name in ("xxh64", "xxh3_64", "xxh3_128"):
        fn = getattr(xxhash, f"{name}_intdigest")
        fn(data)  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            fn(data)
        seconds = time.perf_counter() - t0
        print(f"{name:<9} {args.rounds * len(data) / seconds / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
