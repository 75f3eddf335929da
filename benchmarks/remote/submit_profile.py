"""Where a remote job's submit CPU goes, in the caller's thread.

Starts a Redis server on 127.0.0.1, builds a :class:`RemoteTier` on it, and
submits ``--jobs`` jobs of ``--chunks`` chunks through the sync facade, one at
a time (submit, wait) and then back to back (all submitted, then waited for).
For each job it reads the caller's thread CPU clock (``time.thread_time_ns``)
around ``prepare`` (the handler's own submit-time work, timed separately in a
tight loop) and around ``submit_nowait``, and counts how many callbacks the
engine's loop was sent (each one wakes the loop thread).

    PYTHONPATH=$PWD python benchmarks/remote/submit_profile.py --jobs 400

Prints medians per chunk; figures are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from offload_engine import LayoutDigest, RedisStore, RedisStoreConfig, SyncOffloadingEngine
from offload_engine.host.tier import HostTier
from offload_engine.remote.tier import RemoteTier
from offload_engine.testing.servers import RedisServer
from offload_engine.vocabulary import TransferSpec, cpu_blocks, remote_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--chunk-kib", type=int, default=64)
    args = ap.parse_args()
    per = args.chunks
    tier = HostTier(4 * per, args.chunk_kib << 10)
    tier.memory.copy_(torch.randint(0, 256, tier.memory.shape, dtype=torch.uint8))
    digest = LayoutDigest("profile", "uint8", 16, 1, args.chunk_kib << 10)
    with RedisServer() as server:
        remote = RemoteTier(
            lambda: RedisStore(RedisStoreConfig(server.url)), tier, digest, workers=4
        )
        try:
            store_h, load_h = remote.handlers()

            def spec(j: int) -> TransferSpec:
                first = (j % 4) * per
                keys = [f"p-{j}-{i}".encode() for i in range(per)]
                return TransferSpec(cpu_blocks(range(first, first + per)), remote_blocks(keys))

            specs = [spec(j) for j in range(args.jobs)]
            # prepare alone, in a tight loop (no engine)
            prep = []
            for s in specs:
                c0 = time.thread_time_ns()
                store_h.prepare(s)
                prep.append(time.thread_time_ns() - c0)
            with SyncOffloadingEngine([store_h, load_h], capacity=4 * args.jobs) as engine:
                bridge = engine.manager._bridge
                assert bridge is not None
                calls = [0]
                real = bridge._call

                def counted(*a: object) -> object:
                    calls[0] += 1
                    return real(*a)

                bridge._call = counted
                alone, wakes = [], []
                for s in specs:
                    before = calls[0]
                    c0 = time.thread_time_ns()
                    jid = engine.submit_nowait(s)
                    alone.append(time.thread_time_ns() - c0)
                    (r,) = engine.wait([jid])
                    if not r.success:
                        raise RuntimeError(r.error)
                    wakes.append(calls[0] - before)
                # back to back: keep the handler busy (at most capacity jobs queued)
                c0 = time.thread_time_ns()
                ids = [engine.submit_nowait(s) for s in specs]
                b2b = time.thread_time_ns() - c0
                engine.wait(ids)
        finally:
            remote.close()

    def us(ns: float) -> float:
        return ns / per / 1e3

    print(f"chunks per job: {per}, jobs: {args.jobs}, chunk: {args.chunk_kib} KiB")
    print(f"prepare alone            : {us(statistics.median(prep)):6.1f} us/chunk (median)")
    print(f"submit_nowait, one job   : {us(statistics.median(alone)):6.1f} us/chunk (median)")
    print(f"submit_nowait, back2back : {us(b2b / len(specs)):6.1f} us/chunk (mean)")
    print(f"loop wake-ups per job    : {statistics.mean(wakes):6.2f} (mean, submit to result)")


if __name__ == "__main__":
    main()
