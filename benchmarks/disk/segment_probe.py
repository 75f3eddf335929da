"""Is an append-only segment format worth building? Raw write bandwidth, no engine.

Writes ``--mib`` MiB in requests of each ``--kib`` size with O_DIRECT, ``--qd``
threads each issuing one ``os.pwritev`` at a time (queue depth ``--qd``), as:

* ``new-files``: one new file per request (``.tmp``, write, close, ``os.replace``),
  what the disk tier does today for every chunk of >= 1 MiB and every pack;
* ``seg-append``: increasing page-aligned offsets (one shared cursor) into
  segment files of ``--seg-mib`` MiB preallocated with ``fallocate`` once
  (first use: unwritten extents);
* ``seg-over``: the same segments written a second time (written extents);
* ``seg-grow``: increasing offsets into segment files *not* preallocated
  (each write extends the file);
* ``fio-new`` / ``fio-over``: fio (psync, direct, ``numjobs=qd``, same bs) into
  fresh files, then over the same files again.

Every system runs once per round, round-robin, ``--rounds`` rounds; the median
is printed (GB/s) with the ratio to fio-over (what the bench's fio measures after
its first round). Usage::

    python benchmarks/disk/segment_probe.py --dir /tmp/segprobe [--kib 256,1024]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

O_DIRECT = os.O_DIRECT


def _threads(qd: int, n: int, write: Callable[[int, mmap.mmap], None], bs: int) -> float:
    """Seconds for ``qd`` threads to run ``write(k, buffer)`` for k in 0..n-1, each
    taking the next k (one request in flight per thread), each its own random buffer."""
    bufs = []
    for _ in range(qd):
        b = mmap.mmap(-1, bs)
        b.write(os.urandom(bs))
        bufs.append(b)
    counter = iter(range(n))
    lock = threading.Lock()

    def work(buf: mmap.mmap) -> None:
        while True:
            with lock:
                k = next(counter, None)
            if k is None:
                return
            write(k, buf)

    ts = [threading.Thread(target=work, args=(bufs[i],)) for i in range(qd)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for b in bufs:
        b.close()
    return dt


def new_files(d: Path, total: int, bs: int, qd: int) -> float:
    d.mkdir(parents=True, exist_ok=True)

    def write(k: int, buf: mmap.mmap) -> None:
        final = d / f"{k:08x}.kv"
        tmp = d / f"{k:08x}.kv.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o644)
        os.pwritev(fd, [buf], 0)
        os.close(fd)
        os.replace(tmp, final)

    return _threads(qd, total // bs, write, bs)


def segments(d: Path, total: int, bs: int, qd: int, seg: int, *, prealloc: bool) -> float:
    """Append at a shared cursor into ``total // seg`` segment files (created on first use)."""
    d.mkdir(parents=True, exist_ok=True)
    nseg = max(1, total // seg)
    fds = []
    for i in range(nseg):
        fd = os.open(d / f"{i}.seg", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | O_DIRECT, 0o644)
        if prealloc and os.fstat(fd).st_size < seg:
            os.posix_fallocate(fd, 0, seg)
        fds.append(fd)
    per_seg = seg // bs

    def write(k: int, buf: mmap.mmap) -> None:
        os.pwritev(fds[k // per_seg], [buf], (k % per_seg) * bs)

    try:
        return _threads(qd, total // bs, write, bs)
    finally:
        for fd in fds:
            os.close(fd)


def fio(d: Path, total: int, bs: int, qd: int) -> float:
    d.mkdir(parents=True, exist_ok=True)
    cmd = [
        "fio", "--name=probe", f"--directory={d}", "--rw=write", f"--bs={bs}",
        f"--size={total // qd}", f"--numjobs={qd}", "--ioengine=psync", "--direct=1",
        "--group_reporting", "--output-format=json", "--fallocate=none",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]["write"]
    return job["io_bytes"] / (job["runtime"] / 1000) / 1e9


def _one(name: str, base: Path, total: int, bs: int, qd: int, seg: int) -> float:
    """GB/s of one system (in ``base``: its second run reuses the first's files)."""
    if name.startswith("fio"):
        return fio(base / "fio", total, bs, qd)
    if name == "new-files":
        seconds = new_files(base / "files", total, bs, qd)
    elif name == "seg-grow":
        seconds = segments(base / "grow", total, bs, qd, seg, prealloc=False)
    else:  # seg-append, then seg-over into the same files
        seconds = segments(base / "seg", total, bs, qd, seg, prealloc=True)
    return total / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--kib", default="256,1024")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--seg-mib", type=int, default=128)
    ap.add_argument("--qd", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    root = Path(a.dir)
    total, seg, qd = a.mib * 2**20, a.seg_mib * 2**20, a.qd
    report: dict[str, dict[str, list[float]]] = {}
    for kib in (int(k) for k in a.kib.split(",")):
        bs = kib * 1024
        figs: dict[str, list[float]] = {}
        for r in range(a.rounds):
            base = root / f"{kib}k-r{r}"
            shutil.rmtree(base, ignore_errors=True)
            for name in ("new-files", "seg-append", "seg-over", "seg-grow", "fio-new", "fio-over"):
                figs.setdefault(name, []).append(_one(name, base, total, bs, qd, seg))
            shutil.rmtree(base, ignore_errors=True)
        report[f"{kib}KiB"] = figs
        ref = statistics.median(figs["fio-over"])
        print(f"{kib} KiB requests, {a.mib} MiB, qd {qd}, median of {a.rounds}", end="")
        print(" (GB/s, ratio to fio-over):")
        for name, v in figs.items():
            med = statistics.median(v)
            runs_s = " ".join(f"{x:.2f}" for x in v)
            print(f"  {name:10s} {med:5.2f}  x{med / ref:4.2f}   [{runs_s}]")
    if a.output:
        Path(a.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
