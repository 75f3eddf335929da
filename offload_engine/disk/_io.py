"""The disk tier's I/O: the thread pools that run reads and writes, the write
loop, and the O_DIRECT probe.

``os.preadv``/``os.pwritev`` release the GIL, so a pool of threads keeps several
requests on the drive at once while the caller's thread only queues work.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from offload_engine._loop import block_application_signals
from offload_engine.disk._record import PAGE

log = logging.getLogger("offload_engine.disk")

O_DIRECT = getattr(os, "O_DIRECT", 0)

# the I/O calls, module attributes so fault tests can wrap them
pwritev = os.pwritev
preadv = os.preadv

_STOP = object()
_T = TypeVar("_T")


class Pool:
    """``n`` threads running batches from one queue; each has its own page-aligned
    scratch of ``scratch_bytes`` (trailers, record headers), so a batch builds
    O_DIRECT-aligned buffers without allocating."""

    def __init__(self, n: int, name: str, scratch_bytes: int) -> None:
        self.scratch_bytes = scratch_bytes
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def put(self, work: Callable[[mmap.mmap], None]) -> None:
        self.queue.put(work)

    def _run(self) -> None:
        block_application_signals()
        # page-aligned; freed with the thread (an error's traceback may still view it)
        scratch = mmap.mmap(-1, self.scratch_bytes)
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            item(scratch)  # type: ignore[operator]

    def close(self) -> None:
        for _ in self.threads:
            self.queue.put(_STOP)
        for t in self.threads:
            t.join()


class Job:
    """One store or load request, split into batches; the last batch reports."""

    __slots__ = ("done", "errors", "lock", "missing", "nbytes", "pending")

    def __init__(self, batches: int, done: Callable[[Job], None]) -> None:
        self.lock = threading.Lock()
        self.pending = batches
        self.done = done
        self.nbytes = 0
        self.errors: list[tuple[bytes, BaseException]] = []
        self.missing: list[bytes] = []

    def finish_batch(self, nbytes: int) -> None:
        with self.lock:
            self.nbytes += nbytes
            self.pending -= 1
            last = self.pending == 0
        if last:
            self.done(self)


def write_all(fd: int, bufs: list[memoryview], total: int, offset: int = 0) -> None:
    """pwritev until ``total`` bytes are written at ``offset`` (a short write retries
    the rest, so a full disk surfaces as ENOSPC)."""
    done = pwritev(fd, bufs, offset)
    while done < total:
        rest: list[memoryview] = []
        skip = done
        for b in bufs:
            if skip >= b.nbytes:
                skip -= b.nbytes
            else:
                rest.append(b[skip:])
                skip = 0
        n = os.pwrite(fd, b"".join(rest), offset + done) if rest else 0
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def read_into(fd: int, bufs: list[memoryview], offset: int) -> int:
    """One ``preadv`` of ``bufs`` at ``offset``; the bytes read."""
    return int(preadv(fd, bufs, offset))


def probe_direct(path: Path) -> bool:
    """Can this directory take O_DIRECT writes and reads of one aligned page?"""
    if not O_DIRECT:
        return False
    probe = path / ".direct-probe"
    buf = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [buf], 0)
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        return True
    except OSError as exc:
        log.warning("O_DIRECT is not usable in %s (%s); using buffered I/O", path, exc)
        return False
    finally:
        buf.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


def sync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def split(items: list[_T], parts: int) -> list[list[_T]]:
    """``items`` in at most ``parts`` contiguous batches of near-equal size."""
    if not items:
        return []
    step = math.ceil(len(items) / min(parts, len(items)))
    return [items[i : i + step] for i in range(0, len(items), step)]


def zero(view: memoryview) -> None:
    view[:] = bytes(view.nbytes)
