"""Which Redis client to build the Redis/Valkey backend on: redis-py (+hiredis) or valkey-glide.

Starts one redis-server on 127.0.0.1 and, in the same run, moves the same
pipelined batches (``--batch`` values of ``--mib`` MiB, SET then GET) with each
client in a tight loop. Prints GB/s per client and direction.

    python benchmarks/remote/redis_clients.py [--mib 0.5 2] [--batch 16] [--rounds 20]

valkey-glide is optional (``pip install valkey-glide``); without it only
redis-py runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from offload_engine.testing.servers import RedisServer


def bench_redis_py(url: str, values: list[bytes], rounds: int) -> tuple[float, float]:
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"bench:{i}" for i in range(len(values))]
    put = get = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, values, strict=True):
            pipe.set(k, v)
        pipe.execute()
        put += time.perf_counter() - t
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        get += time.perf_counter() - t
        if [len(g) for g in got] != [len(v) for v in values]:
            raise RuntimeError("redis-py read back other sizes")
    client.close()
    return put, get


async def _glide(port: int, password: str, values: list[bytes], rounds: int) -> tuple[float, float]:
    from glide import (
        Batch,
        GlideClient,
        GlideClientConfiguration,
        NodeAddress,
        ServerCredentials,
    )

    config = GlideClientConfiguration(
        [NodeAddress("127.0.0.1", port)],
        credentials=ServerCredentials(password),
        request_timeout=10_000,
    )
    client = await GlideClient.create(config)
    keys = [f"bench:{i}" for i in range(len(values))]
    put = get = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        batch = Batch(is_atomic=False)
        for k, v in zip(keys, values, strict=True):
            batch.set(k, v)
        await client.exec(batch, raise_on_error=True)
        put += time.perf_counter() - t
        t = time.perf_counter()
        batch = Batch(is_atomic=False)
        for k in keys:
            batch.get(k)
        got = await client.exec(batch, raise_on_error=True)
        get += time.perf_counter() - t
        if got is None or [len(g) for g in got] != [len(v) for v in values]:  # type: ignore[arg-type]
            raise RuntimeError("glide read back other sizes")
    await client.close()
    return put, get


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    try:
        import glide  # noqa: F401

        have_glide = True
    except ImportError:
        have_glide = False
    with RedisServer() as server:
        print(f"redis-server on 127.0.0.1:{server.port}, {args.batch} values per pipeline")
        print(f"{'client':<14}{'MiB':>6}{'SET GB/s':>10}{'GET GB/s':>10}")
        for mib in args.mib:
            size = int(mib * 2**20)
            values = [os.urandom(size) for _ in range(args.batch)]
            total = size * args.batch * args.rounds
            runs = [("redis-py", lambda v=values: bench_redis_py(server.url, v, args.rounds))]
            if have_glide:
                runs.append(
                    (
                        "valkey-glide",
                        lambda v=values: asyncio.run(
                            _glide(server.port, server.password, v, args.rounds)
                        ),
                    )
                )
            for name, run in runs:
                run()  # warm-up round
                put, get = run()
                print(f"{name:<14}{mib:>6g}{total / put / 1e9:>10.2f}{total / get / 1e9:>10.2f}")


if __name__ == "__main__":
    main()
