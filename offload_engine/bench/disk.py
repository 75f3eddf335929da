"""The disk tier's benchmark: this engine, fio, raw threads and vLLM's fs tier, side by side.

All of them move the same chunks (``chunk_bytes`` each, ``chunks`` of them) in
the same directory with the same queue depth, O_DIRECT where the filesystem
takes it. The plan's ``queue_depth`` ``None`` (the default) is the disk tier's
own default for the directory (derived from its block device,
:func:`~offload_engine.disk._depth.derive_queue_depth`), and fio and vLLM's fs
tier get that same depth:

* **engine**: a :class:`~offload_engine.DiskStore` with ``queue_depth``
  threads per direction (its default when the plan's is ``None``), driven
  through the sync facade with ``chunks_per_job`` chunks per job,
  ``jobs_in_flight`` jobs at once; segments sized an eighth of the bytes moved
  (at most 128 MiB), preallocated on first use;
* **engine-reuse**: a second pass of new keys into the same store, whose cap
  holds one pass and one segment more (:func:`engine_sizes`): its records go
  mostly into segments emptied by eviction (a full tier's steady state);
* **fio**: ``--ioengine=psync --direct=1 --bs=<chunk> --numjobs=<queue depth>``
  (each job one synchronous request at a time, as each engine thread), write
  then read of the same bytes into new files, then **fio-over**: the same files
  written a second time (blocks already allocated and written, what
  ``engine-reuse`` is compared with); for chunks under 1 MiB also **fio-1m**, the same
  bytes in 1 MiB requests (what the drive gives to requests of the size records make);
* **raw**: ``queue_depth`` Python threads, each one synchronous O_DIRECT
  ``pwritev``/``preadv`` at a time (as fio's jobs and the engine's threads), the
  chunks written into one file and read back into distinct rows of page-aligned
  memory, as a tier lands each chunk in its own host block: what any reader that
  lands bytes where a tier does gets on this drive, with no format, index or
  checksum; **raw-reused** reads the same requests into one buffer per thread, as
  fio does (a buffer that stays in cache);
* **vLLM fs tier**: ``FileSystemTierManager`` driven directly through its
  ``SecondaryTierManager`` API on a memoryview, the same jobs. Its pool's
  read-priority and write-priority threads both drain either queue, so a phase
  of only reads (or only writes) runs on all of them: it gets ``queue_depth``
  threads in all (half read-priority, half write-priority), the same number of
  requests in flight as fio and the engine.

Every figure is **cold**: O_DIRECT bypasses the page cache for all three
(the report records whether each one used it). Submit CPU is
``time.thread_time()`` of the submitting thread over the submit calls, per chunk.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from offload_engine.disk import DiskStore, disk_handlers, page_aligned_tier
from offload_engine.disk._depth import DiskDepth, derive_queue_depth
from offload_engine.disk._io import O_DIRECT, probe_direct, read_into, write_all
from offload_engine.disk.store import PACK_BYTES, SEGMENT_BYTES
from offload_engine.engine.sync import SyncOffloadingEngine
from offload_engine.keyed import LayoutDigest
from offload_engine.vocabulary import TransferSpec, cpu_blocks, disk_blocks


@dataclass(frozen=True)
class DiskBenchPlan:
    chunk_bytes: int = 2 * 2**20
    chunks: int = 256
    chunks_per_job: int = 16
    jobs_in_flight: int = 4
    queue_depth: int | None = None  # None: the disk tier's default for the directory

    @classmethod
    def quick(cls, chunk_bytes: int = 2**20, volume_mib: int | None = None) -> DiskBenchPlan:
        """A CI-sized plan: 32 chunks of ``chunk_bytes``, or ``volume_mib`` of them,
        8 a job."""
        if volume_mib is None:
            return cls(chunk_bytes=chunk_bytes, chunks=32, chunks_per_job=8)
        return cls.of_volume(chunk_bytes, volume_mib, chunks_per_job=8)

    @classmethod
    def of_volume(cls, chunk_bytes: int, volume_mib: int, **fields: int) -> DiskBenchPlan:
        """Chunks of ``chunk_bytes`` making ``volume_mib`` (at least 16 chunks),
        rounded up to whole jobs."""
        per = fields.get("chunks_per_job", cls.chunks_per_job)
        chunks = max(16, volume_mib * 2**20 // chunk_bytes)
        return cls(chunk_bytes=chunk_bytes, chunks=-(-chunks // per) * per, **fields)

    def host_bytes(self) -> int:
        """Host memory the bench holds at most: the random chunks, the engine's host
        tier, and the buffer vLLM's fs tier or the raw threads read into."""
        return 3 * self.chunks * self.chunk_bytes

    def random_chunks(self) -> np.ndarray:
        """What every system writes: seeded random bytes, one row per chunk."""
        return np.random.default_rng(0).integers(
            0, 256, (self.chunks, self.chunk_bytes), dtype=np.uint8
        )


@dataclass(frozen=True)
class DiskFigure:
    system: str  # engine | fio | raw | vllm-fs, and their variants
    direction: str  # write | read
    gbps: float
    seconds: float
    direct: bool
    submit_us_per_chunk: float | None = None


def _keys(n: int, salt: str) -> list[bytes]:
    return [salt.encode() + i.to_bytes(32, "big") + (0).to_bytes(4, "big") for i in range(n)]


def _drive(
    submit: Callable[[int], Any], finish: Callable[[], int], jobs: int, in_flight: int
) -> tuple[float, float]:
    """Submit ``jobs`` with at most ``in_flight`` outstanding; return (seconds, submit CPU)."""
    cpu = 0.0
    done = 0
    sent = 0
    t0 = time.perf_counter()
    while done < jobs:
        while sent < jobs and sent - done < in_flight:
            c0 = time.thread_time()
            submit(sent)
            cpu += time.thread_time() - c0
            sent += 1
        done += finish()
    return time.perf_counter() - t0, cpu


def engine_sizes(plan: DiskBenchPlan) -> tuple[int, int]:
    """``(segment_bytes, capacity_bytes)`` of the engine's store: segments of an
    eighth of the bytes moved and 1 MiB (at most :data:`SEGMENT_BYTES`), and a cap
    that holds one pass of the plan's chunks and one segment more, asked of the
    store itself (:meth:`DiskStore.capacity_for`), so the second pass writes into
    segments emptied by eviction and never finds the tier full."""
    slot = -(-(plan.chunk_bytes + 4096) // 4096) * 4096  # payload, trailer page, padding
    segment = min(SEGMENT_BYTES, -(-plan.chunks * slot // 8 // 4096) * 4096 + 2**20)
    one_pass = DiskStore.capacity_for(plan.chunks, plan.chunk_bytes, segment_bytes=segment)
    return segment, one_pass + segment


def disk_bytes_needed(plan: DiskBenchPlan, repeats: int) -> int:
    """Drive space one :func:`run_disk_bench` of ``plan`` takes at its peak: every
    repeat's directories stay until the end (the engine's preallocated segments,
    fio's files, fio-1m's for small chunks, the raw file, vLLM's files, a page of
    metadata each)."""
    volume = plan.chunks * (plan.chunk_bytes + 4096)
    others = 4 if plan.chunk_bytes < PACK_BYTES else 3
    return repeats * (engine_sizes(plan)[1] + others * volume)


def bench_engine(
    path: Path, plan: DiskBenchPlan, data: np.ndarray, *, depth_from_store: bool = False
) -> list[DiskFigure]:
    """Write then read the plan's chunks (``engine``), then a second pass of new
    keys (``engine-reuse``) into the same store, whose cap holds one pass plus a
    segment: it writes mostly into segments emptied by eviction (a full tier's
    steady state). ``depth_from_store``: the store chooses its own queue depth
    (its default), which must equal the plan's when the plan names one."""
    n, per = plan.chunks, plan.chunks_per_job
    tier = page_aligned_tier(n, plan.chunk_bytes)
    tier.memory.copy_(torch.from_numpy(data))
    digest = LayoutDigest(
        model="bench", dtype="uint8", block_size=16, chunk_blocks=1, page_bytes=plan.chunk_bytes
    )
    jobs = n // per
    out: list[DiskFigure] = []
    segment, capacity = engine_sizes(plan)
    expected = plan.queue_depth
    with (
        DiskStore(
            path,
            digest,
            capacity_bytes=capacity,
            queue_depth=None if depth_from_store else plan.queue_depth,
            segment_bytes=segment,
        ) as disk,
        SyncOffloadingEngine(disk_handlers(disk, tier)) as engine,
    ):
        if expected is not None and disk.queue_depth != expected:
            raise RuntimeError(
                f"engine bench: the store chose queue_depth {disk.depth}, the others run at "
                f"{expected}"
            )
        pending: list[int] = []

        def finish() -> int:
            [r] = engine.wait([pending.pop(0)])
            if not r.success:
                raise r.error  # type: ignore[misc]
            return 1

        for system in ("engine", "engine-reuse"):
            keys = _keys(n, system)
            for direction in ("write", "read"):
                if direction == "read":
                    tier.memory.zero_()

                def submit(
                    j: int, store: bool = direction == "write", keys: list[bytes] = keys
                ) -> None:
                    host = cpu_blocks(range(j * per, (j + 1) * per))
                    keyed = disk_blocks(keys[j * per : (j + 1) * per])
                    spec = TransferSpec(host, keyed) if store else TransferSpec(keyed, host)
                    pending.append(engine.submit_nowait(spec))

                secs, cpu = _drive(submit, finish, jobs, plan.jobs_in_flight)
                gbps = n * plan.chunk_bytes / secs / 1e9
                out.append(DiskFigure(system, direction, gbps, secs, disk.direct, cpu / n * 1e6))
            if not np.array_equal(tier.memory.numpy(), data):
                raise RuntimeError("engine bench: the loaded bytes differ from the stored ones")
    return out


def bench_fio(
    path: Path, plan: DiskBenchPlan, *, bs: int | None = None, again: bool = False
) -> list[DiskFigure]:
    """fio on the plan's bytes in requests of ``bs`` (default: the chunk size):
    write new files, read them; with ``again`` also write them a second time
    (``fio-over``: overwriting blocks already written)."""
    fio = shutil.which("fio")
    if fio is None:
        return []
    bs = plan.chunk_bytes if bs is None else bs
    name = "fio" if bs == plan.chunk_bytes else f"fio-{bs // 2**20}m"
    qd = _depth(plan)
    size = plan.chunks * plan.chunk_bytes // qd
    out: list[DiskFigure] = []
    for rw in ("write", "read", "write") if again else ("write", "read"):
        cmd = [
            fio, "--name=disk-bench", f"--directory={path}", f"--rw={rw}",
            f"--bs={bs}", f"--size={size}", f"--numjobs={qd}", "--ioengine=psync",
            "--direct=1", "--group_reporting", "--output-format=json", "--fallocate=none",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0][rw]
        bw = job["io_bytes"] / (job["runtime"] / 1000)
        over = len(out) == 2
        out.append(
            DiskFigure(f"{name}-over" if over else name, rw, bw / 1e9, job["runtime"] / 1000, True)
        )
    return out


def _threads(depth: int, n: int, io: Callable[[int], None]) -> float:
    """Seconds for ``depth`` threads to run ``io(i)`` for ``i`` in ``range(n)``, chunk
    ``i`` on thread ``i % depth``."""

    def worker(t: int) -> None:
        for i in range(t, n, depth):
            io(i)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(depth)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - t0


def bench_raw(path: Path, plan: DiskBenchPlan, data: np.ndarray) -> list[DiskFigure]:
    """``raw`` and ``raw-reused`` (see the module docstring): one file of the plan's
    chunks written, then read twice."""
    n, size, qd = plan.chunks, plan.chunk_bytes, _depth(plan)
    memory = mmap.mmap(-1, n * size)  # page-aligned, as O_DIRECT needs
    rows = np.frombuffer(memory, dtype=np.uint8).reshape(n, size)
    rows[:] = data  # also faults every page in, as a tier's used blocks are
    view = memoryview(memory)
    own = [mmap.mmap(-1, size) for _ in range(qd)]
    for buffer in own:
        buffer.write(bytes(size))
    target = path / "raw.bin"
    out: list[DiskFigure] = []

    def into_rows(i: int) -> memoryview:
        return view[i * size : (i + 1) * size]

    def into_own(i: int) -> mmap.mmap:
        return own[i % qd]

    direct = probe_direct(path)
    flags = os.O_CLOEXEC | (O_DIRECT if direct else 0)

    def write(i: int) -> None:
        write_all(fd, [into_rows(i)], size, i * size)

    fd = os.open(target, os.O_CREAT | os.O_WRONLY | flags, 0o600)
    try:
        seconds = _threads(qd, n, write)
    finally:
        os.close(fd)
    out.append(DiskFigure("raw", "write", n * size / seconds / 1e9, seconds, direct))
    rows[:] = 0
    reads: list[tuple[str, Callable[[int], Any]]] = [("raw", into_rows), ("raw-reused", into_own)]
    for name, into in reads:
        fd = os.open(target, os.O_RDONLY | flags)
        try:
            seconds = _threads(qd, n, _reader(fd, size, into))
        finally:
            os.close(fd)
        out.append(DiskFigure(name, "read", n * size / seconds / 1e9, seconds, direct))
    if not np.array_equal(rows, data):
        raise RuntimeError("the raw read-back differs from what was written")
    return out


def _reader(fd: int, size: int, into: Callable[[int], Any]) -> Callable[[int], None]:
    """Chunk ``i``'s read: all ``size`` bytes at its offset into ``into(i)``."""

    def read(i: int) -> None:
        done = read_into(fd, [memoryview(into(i))], i * size)
        if done != size:
            raise OSError(f"a raw read returned {done} of {size} bytes")

    return read


def _depth(plan: DiskBenchPlan) -> int:
    if plan.queue_depth is None:
        raise ValueError("the plan's queue_depth must be resolved (resolve_depth)")
    return plan.queue_depth


def resolve_depth(plan: DiskBenchPlan, directory: Path) -> tuple[DiskBenchPlan, DiskDepth]:
    """``plan`` with its queue depth set: the one it names, or the disk tier's
    default for ``directory`` (what a :class:`DiskStore` there would choose)."""
    if plan.queue_depth is not None:
        n = plan.queue_depth
        return plan, DiskDepth(n, "explicit", None, f"queue_depth={n}")
    depth = derive_queue_depth(directory)
    return replace(plan, queue_depth=depth.depth), depth


def _fs_tier_spec(plan: DiskBenchPlan) -> Any:
    config = SimpleNamespace(
        groups=(SimpleNamespace(tokens_per_block=16, layer_names=("layer0",)),),
        model=SimpleNamespace(name="bench", dtype="uint8"),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=SimpleNamespace(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            is_parallelism_agnostic=True,
        ),
        canonical_layout=False,
        kv_cache_layout=None,
        replicated_layout=False,
    )  # fmt: skip
    return SimpleNamespace(
        config=config,
        blocks_per_chunk=1,
        kv_events_config=SimpleNamespace(enable_kv_cache_events=False),
    )


def bench_vllm_fs(path: Path, plan: DiskBenchPlan, data: np.ndarray) -> list[DiskFigure]:
    try:
        with warnings.catch_warnings():  # vLLM's imports warn about torch APIs; not ours
            warnings.simplefilter("ignore", DeprecationWarning)
            from vllm.v1.kv_offload.base import OffloadKey, ReqContext
            from vllm.v1.kv_offload.tiering.base import TransferJob
            from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
    except ImportError:
        return []
    n, per, qd = plan.chunks, plan.chunks_per_job, _depth(plan)
    buf = mmap.mmap(-1, n * plan.chunk_bytes)
    array = np.frombuffer(buf, dtype=np.uint8).reshape(n, plan.chunk_bytes)
    array[:] = data
    view = memoryview(array)  # type: ignore[arg-type]
    tier = FileSystemTierManager(
        _fs_tier_spec(plan), view, "fs", root_dir=str(path),
        n_read_threads=max(1, -(-qd // 2)), n_write_threads=max(1, qd // 2),
    )  # fmt: skip
    keys = [OffloadKey(k) for k in _keys(n, "vllm")]
    jobs = n // per
    ctx = ReqContext("bench")
    out: list[DiskFigure] = []
    finished: list[Any] = []

    def finish() -> int:
        while not finished:
            finished.extend(tier.get_finished_jobs())  # vLLM's scheduler polls like this
            if not finished:
                time.sleep(0.0002)
        r = finished.pop()
        if not r.success:
            raise RuntimeError(f"vLLM fs tier job {r.job_id} failed")
        return 1

    try:
        for direction, promotion in (("write", False), ("read", True)):
            if promotion:
                array[:] = 0

            def submit(j: int, promotion: bool = promotion) -> None:
                job = TransferJob(
                    j + (jobs if promotion else 0),
                    keys[j * per : (j + 1) * per],
                    np.arange(j * per, (j + 1) * per),
                    promotion,
                    ctx,
                )
                if promotion:
                    tier.submit_load(job)
                else:
                    tier.submit_store(job)

            secs, cpu = _drive(submit, finish, jobs, plan.jobs_in_flight)
            out.append(
                DiskFigure(
                    "vllm-fs", direction, n * plan.chunk_bytes / secs / 1e9, secs,
                    bool(tier._use_o_direct), cpu / n * 1e6,
                )
            )  # fmt: skip
        if not np.array_equal(array, data):
            raise RuntimeError("vLLM fs bench: the loaded bytes differ from the stored ones")
    finally:
        tier.shutdown()
        view.release()
    return out


def missing_systems() -> dict[str, str]:
    """The systems this machine cannot run, and why (their rows are left out)."""
    missing: dict[str, str] = {}
    if shutil.which("fio") is None:
        missing["fio"] = "fio is not on PATH"
    if importlib.util.find_spec("vllm") is None:
        missing["vllm-fs"] = (
            "vllm is not installed (from the offload-engine checkout: pip install -e '.[vllm]')"
        )
    return missing


def run_disk_bench(directory: Path, plan: DiskBenchPlan, *, repeats: int = 3) -> dict[str, Any]:
    """Run all three ``repeats`` times, round-robin (so drive noise hits each alike),
    each round starting one system later (so none always follows the same one),
    in fresh subdirectories of ``directory`` that are removed at the end; report
    the median of each (system, direction). A plan without a queue depth runs
    every system at the disk tier's default depth for ``directory``."""
    data = plan.random_chunks()
    default_depth = plan.queue_depth is None
    plan, depth = resolve_depth(plan, directory)
    runs: list[tuple[str, Callable[[Path], list[DiskFigure]]]] = [
        ("engine", lambda p: bench_engine(p, plan, data, depth_from_store=default_depth)),
        ("fio", lambda p: bench_fio(p, plan, again=True)),
        ("raw", lambda p: bench_raw(p, plan, data)),
        ("vllm-fs", lambda p: bench_vllm_fs(p, plan, data)),
    ]
    if plan.chunk_bytes < PACK_BYTES:  # what the drive gives to record-sized requests
        runs.insert(2, ("fio-1m", lambda p: bench_fio(p, plan, bs=2**20)))
    samples: dict[tuple[str, str], list[DiskFigure]] = {}
    made: list[Path] = []
    try:
        for rep in range(repeats):
            shift = rep % len(runs)
            for name, run in runs[shift:] + runs[:shift]:
                where = directory / f"disk-bench-{name}-{os.getpid()}-{rep}"
                where.mkdir(parents=True)
                made.append(where)
                for f in run(where):
                    samples.setdefault((f.system, f.direction), []).append(f)
    finally:
        # deleted only at the end: with `discard` mounts, deleting hundreds of MiB
        # starts a TRIM that would slow whichever system runs next
        for where in made:
            shutil.rmtree(where, ignore_errors=True)
    figures = [sorted(fs, key=lambda f: f.gbps)[len(fs) // 2] for fs in samples.values()]
    measured = {f.system for f in figures}
    skipped = {name: why for name, why in missing_systems().items() if name not in measured}
    by = {(f.system, f.direction): f for f in figures}
    ratios: dict[str, float] = {}
    pairs = [("engine", other) for other in ("fio", "fio-1m", "raw", "vllm-fs")] + [
        ("engine-reuse", "fio-over"), ("engine-reuse", "vllm-fs"),
        ("raw", "fio"), ("raw-reused", "fio"),
    ]  # fmt: skip
    for d in ("write", "read"):
        for mine, other in pairs:
            ours, theirs = by.get((mine, d)), by.get((other, d))
            if ours and theirs:
                ratios[f"{d} {mine}/{other}"] = ours.gbps / theirs.gbps
    return {
        "plan": asdict(plan),
        "queue_depth_from": str(depth),
        "repeats": repeats,
        "directory": str(directory),
        "figures": [asdict(f) for f in figures],
        "all_gbps": {f"{s} {d}": [round(f.gbps, 3) for f in fs] for (s, d), fs in samples.items()},
        "ratios": ratios,
        "skipped": skipped,
    }
