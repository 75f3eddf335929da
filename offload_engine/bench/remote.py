"""The remote tier's benchmark: the engine against the backend's raw client, same run.

For each chunk size and number of concurrent jobs, the same transfers run three
ways on one server:

* **engine**: a :class:`~offload_engine.remote.tier.RemoteTier` driven
  through the sync facade, ``concurrency`` jobs in flight (one worker thread
  each), every object with its trailer and checksum;
* **raw**: the backend's own client in a tight loop, one thread per concurrent
  job, moving the same chunks from and into the same memory (Redis: a
  pipelined ``GET`` per job, and for puts ``SET`` sent from the chunks' memory
  on one of the client's connections, :func:`~offload_engine.remote.redis_store.send_sets`,
  as the tier sends; Mooncake: ``batch_put_from`` /
  ``batch_get_into`` on registered memory), with no trailer and no checksum;
* **redis-benchmark** (Redis only): ``-d`` chunk bytes, ``-P`` chunks per job,
  ``-c`` concurrency.

Engine and raw alternate twice per case, and the best of each counts (the
machine may be shared).

Mooncake's objects live in a second process that contributes the memory
segment (the benchmark's own client contributes none), so every byte crosses
TCP loopback as it would cross a network.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from offload_engine.engine.sync import SyncOffloadingEngine
from offload_engine.errors import ConfigError, StoreError
from offload_engine.host.tier import HostTier
from offload_engine.keyed import LayoutDigest
from offload_engine.remote.mooncake_store import MooncakeStore, MooncakeStoreConfig
from offload_engine.remote.redis_store import RedisStore, RedisStoreConfig, send_sets
from offload_engine.remote.store import RemoteStore
from offload_engine.remote.tier import RemoteTier
from offload_engine.testing.servers import MooncakeMaster, RedisServer
from offload_engine.vocabulary import TransferSpec, cpu_blocks, remote_blocks

CHUNKS_PER_JOB = 2
CHUNK_MIB = (0.5, 2.0, 8.0)
CONCURRENCY = (1, 4, 16)


@dataclass(frozen=True)
class RemotePlan:
    """What one run measures: bytes per direction per case, sizes, concurrency."""

    volume_mib: int = 128
    chunk_mib: tuple[float, ...] = CHUNK_MIB
    concurrency: tuple[int, ...] = CONCURRENCY
    chunks_per_job: int = CHUNKS_PER_JOB
    reps: int = 2  # engine and raw alternate; the best of each counts

    @classmethod
    def quick(cls) -> RemotePlan:
        return cls(volume_mib=16, chunk_mib=(0.5, 2.0), concurrency=(1, 4))


@dataclass(frozen=True)
class RemotePoint:
    """GB/s of one (chunk size, concurrency) case, each way, engine against raw."""

    backend: str
    chunk_bytes: int
    concurrency: int
    chunks: int
    engine_put_gbps: float
    engine_get_gbps: float
    raw_put_gbps: float
    raw_get_gbps: float
    submit_us_per_chunk: float
    #: process CPU ms per MiB moved: engine put, raw put, engine get, raw get (all threads
    #: of the benchmark's process; the servers' CPU is not counted)
    cpu_ms_per_mib: tuple[float, float, float, float]
    redis_benchmark_set_gbps: float | None = None
    redis_benchmark_get_gbps: float | None = None

    @property
    def put_ratio(self) -> float:
        return self.engine_put_gbps / self.raw_put_gbps

    @property
    def get_ratio(self) -> float:
        return self.engine_get_gbps / self.raw_get_gbps

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "put_ratio": self.put_ratio, "get_ratio": self.get_ratio}


class _Holder:
    """A second process that contributes the Mooncake segment and holds it."""

    def __init__(self, master: str, segment_bytes: int) -> None:
        code = (
            "import sys\n"
            "from mooncake.store import MooncakeDistributedStore\n"
            "s = MooncakeDistributedStore()\n"
            f"rc = s.setup('127.0.0.1', 'P2PHANDSHAKE', {segment_bytes}, 16 << 20, 'tcp', '', "
            f"'{master}')\n"
            "print('READY' if rc == 0 else f'FAILED {rc}', flush=True)\n"
            "sys.stdin.read()\n"
            "s.close()\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ready = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if ready != "READY":
            self.close()
            raise ConfigError(f"the Mooncake segment holder did not start: {ready!r}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _threads(n: int, fn: Callable[[int], None]) -> tuple[float, float]:
    """Run ``fn(i)`` on ``n`` threads at once; return wall and process CPU seconds."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, time.process_time() - c0


def _raw_case(
    backend: str, raw: Any, tier: HostTier, names: list[list[str]], concurrency: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """The raw client moving the same chunks: (wall, CPU) seconds for all puts, then all gets."""
    per_job = len(names[0])

    def chunks(job: int) -> list[torch.Tensor]:
        first = (job * per_job) % tier.num_blocks
        return [tier.block(first + i).view(-1) for i in range(per_job)]

    def jobs_of(worker: int) -> range:
        return range(worker, len(names), concurrency)

    if backend == "redis":

        def put(w: int) -> None:
            # the fastest way this client sends a value (see send_sets); its plain
            # pipelined SET copies each value first and runs 2-3x slower here
            for j in jobs_of(w):
                views = [[memoryview(c.numpy().data)] for c in chunks(j)]
                replies = send_sets(raw, names[j], views, retries=0)
                if any(isinstance(r, Exception) for r in replies):
                    raise StoreError(f"raw Redis put failed: {replies}")

        def get(w: int) -> None:
            for j in jobs_of(w):
                pipe = raw.pipeline(transaction=False)
                for name in names[j]:
                    pipe.get(name)
                for value, c in zip(pipe.execute(), chunks(j), strict=True):
                    c.numpy()[:] = memoryview(value)

    else:

        def put(w: int) -> None:
            for j in jobs_of(w):
                cs = chunks(j)
                rc = raw.batch_put_from(
                    names[j], [c.data_ptr() for c in cs], [c.numel() for c in cs]
                )
                if any(x != 0 for x in rc):
                    raise StoreError(f"raw Mooncake put failed: {rc}")

        def get(w: int) -> None:
            for j in jobs_of(w):
                cs = chunks(j)
                rc = raw.batch_get_into(
                    names[j], [c.data_ptr() for c in cs], [c.numel() for c in cs]
                )
                if any(x != c.numel() for x, c in zip(rc, cs, strict=True)):
                    raise StoreError(f"raw Mooncake get failed: {rc}")

    return _threads(concurrency, put), _threads(concurrency, get)


def _engine_case(
    remote: RemoteTier, keys: list[list[bytes]], concurrency: int
) -> tuple[tuple[float, float], tuple[float, float], float]:
    """The engine moving the chunks: (wall, CPU) seconds for the puts, then the gets,
    and the submitting thread's CPU seconds."""
    per_job = len(keys[0])
    blocks = remote.tier.num_blocks

    def ids(job: int) -> list[int]:
        first = (job * per_job) % blocks
        return list(range(first, first + per_job))

    submit_cpu = 0.0
    walls: list[tuple[float, float]] = []
    with SyncOffloadingEngine(remote.handlers(), capacity=4 * concurrency + 4) as engine:
        for store in (True, False):
            t0, p0 = time.perf_counter(), time.process_time()
            pending: set[int] = set()
            for j in range(len(keys)):
                while len(pending) >= concurrency:
                    for r in engine.wait([min(pending)]):
                        pending.discard(r.job_id)
                        if not r.success:
                            raise StoreError(f"an engine job failed: {r.error!r}") from r.error
                spec = (
                    TransferSpec(cpu_blocks(ids(j)), remote_blocks(keys[j]))
                    if store
                    else TransferSpec(remote_blocks(keys[j]), cpu_blocks(ids(j)))
                )
                c0 = time.thread_time()
                pending.add(engine.submit_nowait(spec))
                submit_cpu += time.thread_time() - c0
            for r in engine.wait(sorted(pending)):
                if not r.success:
                    raise StoreError(f"an engine job failed: {r.error!r}") from r.error
            walls.append((time.perf_counter() - t0, time.process_time() - p0))
    return walls[0], walls[1], submit_cpu


def _redis_benchmark(
    server: RedisServer, chunk: int, pipeline: int, concurrency: int, requests: int
) -> tuple[float, float] | None:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    cmd = [
        exe,
        "-h",
        server.host,
        "-p",
        str(server.port),
        "-a",
        server.password,
        "--csv",
        "-t",
        "set,get",
        "-d",
        str(chunk),
        "-P",
        str(pipeline),
        "-c",
        str(concurrency),
        "-n",
        str(requests),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    rates: dict[str, float] = {}
    for line in out.splitlines():
        m = re.match(r'"(SET|GET)","([0-9.]+)"', line)
        if m:
            rates[m.group(1)] = float(m.group(2)) * chunk / 1e9
    if "SET" not in rates or "GET" not in rates:
        return None
    return rates["SET"], rates["GET"]


def run_remote_bench(
    backend: str,
    plan: RemotePlan,
    *,
    tick: Callable[[str], None] = lambda _what: None,
) -> list[RemotePoint]:
    """Start a server for ``backend`` on 127.0.0.1 and measure every case of ``plan``."""
    if backend not in ("redis", "mooncake"):
        raise ConfigError(f"backend must be redis or mooncake, got {backend!r}")
    points: list[RemotePoint] = []
    slots = max(plan.concurrency) * plan.chunks_per_job
    server: RedisServer | MooncakeMaster
    holder: _Holder | None = None
    server = RedisServer() if backend == "redis" else MooncakeMaster()
    with server:
        if isinstance(server, MooncakeMaster):
            holder = _Holder(server.address, (2 * plan.volume_mib + 64) << 20)
        try:
            for mib in plan.chunk_mib:
                chunk = int(mib * 2**20)
                tier = HostTier(slots, chunk)
                tier.memory.copy_(torch.randint(0, 256, tier.memory.shape, dtype=torch.uint8))
                n_chunks = max(slots, (plan.volume_mib << 20) // chunk)
                n_jobs = n_chunks // plan.chunks_per_job
                for conc in plan.concurrency:
                    tick(f"{backend} {mib:g} MiB x{conc}")
                    points.append(_one_case(backend, server, tier, chunk, conc, n_jobs, plan))
                tier.release()
        finally:
            if holder is not None:
                holder.close()
    return points


def _connect(server: RedisServer | MooncakeMaster) -> RemoteStore:
    if isinstance(server, RedisServer):
        return RedisStore(RedisStoreConfig(server.url, socket_timeout=30))
    return MooncakeStore(
        MooncakeStoreConfig(server.address, segment_bytes=0, local_buffer_bytes=16 << 20)
    )


def _best(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return min(a[0], b[0]), min(a[1], b[1])


def _one_case(
    backend: str,
    server: RedisServer | MooncakeMaster,
    tier: HostTier,
    chunk: int,
    conc: int,
    n_jobs: int,
    plan: RemotePlan,
) -> RemotePoint:
    per_job, reps = plan.chunks_per_job, plan.reps
    digest = LayoutDigest("bench", "uint8", 16, 1, chunk)
    tag = f"{chunk}-{conc}"
    keys = [[f"{tag}-{j}-{i}".encode() for i in range(per_job)] for j in range(n_jobs)]
    raw_names = [[f"raw:{k.decode()}" for k in ks] for ks in keys]
    total = n_jobs * per_job * chunk
    mib = total / 2**20
    remote = RemoteTier(lambda: _connect(server), tier, digest, workers=conc)
    inf = (math.inf, math.inf)
    put_s = get_s = raw_put = raw_get = inf
    submit_cpu = math.inf
    try:
        store = remote.store()
        raw = store.client  # the same client library, driven directly
        # engine, raw, engine, raw: the best of two of each, so that a burst of load
        # on a shared machine does not decide a ratio alone
        for _ in range(reps):
            e_put, e_get, e_cpu = _engine_case(remote, keys, conc)
            # free the server's memory before each next set of objects
            store.remove([n for ks in keys for n in remote.names(ks)])
            r_put, r_get = _raw_case(backend, raw, tier, raw_names, conc)
            store.remove([n for ns in raw_names for n in ns])
            # the best wall and the least CPU, each over the repetitions
            put_s, get_s = _best(put_s, e_put), _best(get_s, e_get)
            raw_put, raw_get = _best(raw_put, r_put), _best(raw_get, r_get)
            submit_cpu = min(submit_cpu, e_cpu)
    finally:
        remote.close()
    rb = None
    if isinstance(server, RedisServer):
        rb = _redis_benchmark(server, chunk, per_job, conc, max(n_jobs * per_job, 64))
    return RemotePoint(
        backend=backend,
        chunk_bytes=chunk,
        concurrency=conc,
        chunks=n_jobs * per_job,
        engine_put_gbps=total / put_s[0] / 1e9,
        engine_get_gbps=total / get_s[0] / 1e9,
        raw_put_gbps=total / raw_put[0] / 1e9,
        raw_get_gbps=total / raw_get[0] / 1e9,
        cpu_ms_per_mib=(
            put_s[1] * 1e3 / mib,
            raw_put[1] * 1e3 / mib,
            get_s[1] * 1e3 / mib,
            raw_get[1] * 1e3 / mib,
        ),
        submit_us_per_chunk=submit_cpu / (n_jobs * per_job) * 1e6,
        redis_benchmark_set_gbps=rb[0] if rb else None,
        redis_benchmark_get_gbps=rb[1] if rb else None,
    )
