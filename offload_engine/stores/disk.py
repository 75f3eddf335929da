"""The local-disk store behind the ``CPU <-> DISK`` handlers: one file per object.

Directory layout (``path`` must exist and be writable)::

    path/config.json           the LayoutDigest the directory was created under
    path/lock                  flock-ed by the one DiskStore that owns the directory
    path/objects/ab/cd/<key hex>.kv       payload || trailer (padded to 4096 bytes)
    path/objects/ab/cd/<key hex>.kv.tmp   an object being written

``ab/cd`` are the first four hex digits of the key's xxh64, so directories stay
small whatever the keys look like.

**Publishing.** A writer fills ``<name>.tmp`` and renames it over ``<name>``
(``os.replace``, atomic), so a reader sees a whole object or none. The fsync
policy (``fsync=``): ``"never"`` (default) leaves flushing to the kernel. A
killed *process* loses nothing the rename published; after a *power loss* a
published file may be torn, and then its checksum fails and it is a miss.
``"data"`` fdatasyncs each file before the rename (durable objects),
``"always"`` also fsyncs the directory after it (durable names).

**Verifying.** A load reads payload and trailer in one ``preadv`` straight into
the host slot, then checks the trailer's key, length, version and xxh64. A
missing, truncated, corrupted or foreign file is a *miss*: counted, reported in
:class:`~offload_engine.KeyMissError`, its slot zeroed, and the file dropped.

**I/O.** ``os.preadv``/``os.pwritev`` (they release the GIL) on two thread pools
of ``queue_depth`` threads each, one for loads and one for stores. A job's
objects are split into at most ``queue_depth`` batches, each run by one thread.
Loads have priority: a store thread waits between objects while any load is in
flight. With O_DIRECT (probed per directory, needs page-aligned host memory and
page-multiple objects; otherwise buffered I/O, logged) the page cache is bypassed.

**Capacity.** ``capacity_bytes`` caps the bytes of published and in-progress
files (payload and trailer). A store evicts the policy's victims (LRU by
default) until the object fits; objects being read or written are never
evicted; if it still cannot fit, that object fails with
:class:`~offload_engine.TierFullError`. At start the index is rebuilt from the
file names and sizes (no payload is read), leftover ``.tmp`` files are
deleted, and the LRU order is the files' modification times.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import queue
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import xxhash

from offload_engine._checks import check_int
from offload_engine.errors import (
    ConfigError,
    EngineClosedError,
    KeyMissError,
    LayoutMismatchError,
    TierFullError,
    TierUnavailableError,
    TrailerError,
    TransferError,
)
from offload_engine.keyed import LayoutDigest, Trailer
from offload_engine.vocabulary import MAX_KEY_BYTES, as_keys

log = logging.getLogger("offload_engine.disk")

PAGE = 4096
"""Object files are laid out in units of this many bytes (the O_DIRECT alignment)."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
FsyncPolicy = Literal["never", "data", "always"]

# the I/O calls, module attributes so fault tests can wrap them
_pwritev = os.pwritev
_preadv = os.preadv


class EvictionPolicy(Protocol):
    """Chooses which stored objects to drop when the byte cap is reached.

    The store calls it under its lock: keep each call O(1) and free of I/O.
    """

    def inserted(self, key: bytes) -> None: ...

    def touched(self, key: bytes) -> None: ...

    def removed(self, key: bytes) -> None: ...

    def victims(self) -> Iterator[bytes]:
        """Keys in the order they should go (the store skips busy ones)."""
        ...


class LRUPolicy:
    """Least recently stored or loaded goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def inserted(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touched(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[bytes]:
        return iter(list(self._order))


@dataclass(frozen=True)
class DiskStoreStats:
    """Counters of one :class:`DiskStore` since it opened (``objects``/``used_bytes``: now)."""

    objects: int
    used_bytes: int
    capacity_bytes: int
    direct: bool
    stored: int  # objects written and published
    already_stored: int  # store requests for keys present or being written
    store_failures: int  # objects that failed to store (full, I/O error)
    hits: int  # objects loaded and verified
    misses: int  # load requests for absent keys
    corrupt: int  # files that failed verification (each also a miss)
    evictions: int
    recovered: int  # objects found at start
    removed_at_start: int  # .tmp and malformed files deleted at start


_READY, _WRITING = 0, 1


class _Entry:
    __slots__ = ("readers", "size", "state")

    def __init__(self, state: int, size: int) -> None:
        self.state = state
        self.size = size
        self.readers = 0


class _Job:
    """One store or load request, split into batches; the last batch reports."""

    __slots__ = ("done", "errors", "lock", "missing", "nbytes", "pending")

    def __init__(self, batches: int, done: Callable[[_Job], None]) -> None:
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


_STOP = object()


class _Pool:
    """``n`` threads running batches from one queue; each has its own trailer page."""

    def __init__(self, n: int, name: str) -> None:
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        # page-aligned; freed with the thread (an error's traceback may still view it)
        scratch = mmap.mmap(-1, Trailer.size(MAX_KEY_BYTES, PAGE))
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


def _write_all(fd: int, bufs: list[memoryview], total: int) -> None:
    """pwritev until ``total`` bytes are written (a short write retries the rest,
    so a full disk surfaces as ENOSPC)."""
    done = _pwritev(fd, bufs, 0)
    while done < total:
        rest: list[memoryview] = []
        skip = done
        for b in bufs:
            if skip >= b.nbytes:
                skip -= b.nbytes
            else:
                rest.append(b[skip:])
                skip = 0
        n = os.pwrite(fd, b"".join(rest), done) if rest else 0
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def _probe_direct(path: Path) -> bool:
    """Can this directory take O_DIRECT writes and reads of one aligned page?"""
    if not _O_DIRECT:
        return False
    probe = path / ".direct-probe"
    buf = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o600)
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


class DiskStore:
    """Objects of ``digest.page_bytes`` payload bytes, one file each, under ``path``.

    ``direct``: ``None`` probes O_DIRECT, ``False`` forces buffered I/O, ``True``
    requires O_DIRECT (:class:`TierUnavailableError` if the probe fails).
    ``queue_depth`` is the number of I/O threads per direction (requests in
    flight at once). Close it (``close()`` or ``with``) after the engine that
    uses it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        digest: LayoutDigest,
        *,
        capacity_bytes: int,
        direct: bool | None = None,
        fsync: FsyncPolicy = "never",
        queue_depth: int = 4,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if not isinstance(digest, LayoutDigest):
            raise ConfigError(f"DiskStore takes a LayoutDigest, got {type(digest).__name__}")
        check_int(capacity_bytes, "DiskStore capacity_bytes")
        check_int(queue_depth, "DiskStore queue_depth")
        if fsync not in ("never", "data", "always"):
            raise ConfigError(f"DiskStore fsync must be never|data|always, got {fsync!r}")
        if direct not in (None, True, False):
            raise ConfigError(f"DiskStore direct must be None, True or False, got {direct!r}")
        self.path = Path(path)
        self.digest = digest
        self.capacity_bytes = capacity_bytes
        self.fsync: FsyncPolicy = fsync
        self.queue_depth = queue_depth
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.payload_bytes = digest.page_bytes
        self._closed = False
        self._lock = threading.Lock()
        self._loads_idle = threading.Condition(self._lock)
        self._loads_active = 0
        self._index: dict[bytes, _Entry] = {}
        self._used = 0
        self._counts = dict.fromkeys(
            (
                "stored", "already_stored", "store_failures", "hits", "misses",
                "corrupt", "evictions", "recovered", "removed_at_start",
            ),
            0,
        )  # fmt: skip
        self._shards: set[Path] = set()
        self._lock_fd = self._open_directory()
        try:
            self._check_config()
            probed = _probe_direct(self.path) if direct is not False else False
            if direct and not probed:
                raise TierUnavailableError(f"O_DIRECT was required but does not work in {path}")
            # O_DIRECT also needs whole pages; the host memory is checked per handler
            self.direct = probed and self.payload_bytes % PAGE == 0
            if probed and not self.direct:
                log.warning(
                    "objects of %d bytes are not whole pages; %s uses buffered I/O",
                    self.payload_bytes,
                    path,
                )
            self._rebuild_index()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._readers = _Pool(queue_depth, "offload-engine-disk-read")
        self._writers = _Pool(queue_depth, "offload-engine-disk-write")

    # ------------------------------------------------------------ opening

    def _open_directory(self) -> int:
        path = self.path
        if not path.is_dir():
            raise TierUnavailableError(f"disk tier directory {path} does not exist")
        try:
            fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise TierUnavailableError(
                f"disk tier directory {path} is not writable: {exc.strerror}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise TierUnavailableError(
                f"disk tier directory {path} is in use by another DiskStore (flock: {exc.strerror})"
            ) from exc
        return fd

    def _check_config(self) -> None:
        config = self.path / "config.json"
        try:
            text = config.read_text()
        except FileNotFoundError:
            text = None
        if text is not None:
            try:
                data = json.loads(text)
                found = LayoutDigest.from_json(json.dumps(data["layout"]))
            except (ValueError, KeyError, TypeError) as exc:
                if isinstance(exc, LayoutMismatchError):
                    raise
                raise LayoutMismatchError(f"{config} is not a disk tier config: {exc}") from exc
            self.digest.check_same(found, where=f"disk tier directory {self.path}")
            return
        body = json.dumps({"layout": json.loads(self.digest.to_json())}, indent=2, sort_keys=True)
        tmp = config.with_suffix(".json.tmp")
        try:
            tmp.write_text(body + "\n")
            os.replace(tmp, config)
        except OSError as exc:
            raise TierUnavailableError(
                f"disk tier directory {self.path} is not writable: {exc.strerror}"
            ) from exc

    def _rebuild_index(self) -> None:
        """Index every whole object from names and sizes; delete leftovers."""
        root = self.path / "objects"
        found: list[tuple[float, bytes, int]] = []
        removed = 0
        if root.is_dir():
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    file = os.path.join(dirpath, name)
                    key = self._key_of(name)
                    try:
                        st = os.stat(file)
                    except FileNotFoundError:
                        continue
                    if (
                        key is None
                        or st.st_size != self._file_bytes(key)
                        or (os.path.dirname(file) != str(self._shard(key)))
                    ):
                        os.unlink(file)  # a half write, or not ours
                        removed += 1
                        continue
                    found.append((st.st_mtime, key, st.st_size))
        found.sort()
        for _mtime, key, size in found:
            self._index[key] = _Entry(_READY, size)
            self._used += size
            self.policy.inserted(key)
        self._counts["recovered"] = len(found)
        self._counts["removed_at_start"] = removed
        if self._used > self.capacity_bytes:  # the cap shrank since the last run
            self._unlink(self._evict_locked(self._used - self.capacity_bytes))

    @staticmethod
    def _key_of(name: str) -> bytes | None:
        if not name.endswith(".kv"):
            return None
        try:
            key = bytes.fromhex(name[:-3])
        except ValueError:
            return None
        return key if 0 < len(key) <= MAX_KEY_BYTES else None

    def _file_bytes(self, key: bytes) -> int:
        return self.payload_bytes + Trailer.size(len(key), PAGE)

    def _shard(self, key: bytes) -> Path:
        h = xxhash.xxh64_hexdigest(key)
        return self.path / "objects" / h[:2] / h[2:4]

    def file_of(self, key: bytes) -> Path:
        """Where ``key``'s object lives (whether or not it is stored)."""
        return self._shard(key) / f"{key.hex()}.kv"

    # ------------------------------------------------------------ queries

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored (the longest stored prefix)."""
        keys = as_keys(keys)
        n = 0
        with self._lock:
            index = self._index
            for key in keys:
                entry = index.get(key)
                if entry is None or entry.state != _READY:
                    break
                n += 1
        return n

    def state(self, key: bytes) -> Literal["stored", "writing", "absent"]:
        """Whether ``key`` is stored, being written (ask again later), or absent."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return "absent"
        return "stored" if entry.state == _READY else "writing"

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark stored ``keys`` as recently used."""
        with self._lock:
            for key in keys:
                self.policy.touched(bytes(key))

    def stats(self) -> DiskStoreStats:
        with self._lock:
            return DiskStoreStats(
                objects=sum(1 for e in self._index.values() if e.state == _READY),
                used_bytes=self._used,
                capacity_bytes=self.capacity_bytes,
                direct=self.direct,
                **self._counts,
            )

    # ------------------------------------------------------------ eviction

    def _evict_locked(self, need: int) -> list[bytes]:
        """Drop idle objects until ``need`` bytes are freed (or none is left)."""
        gone: list[bytes] = []
        for key in self.policy.victims():
            if need <= 0:
                break
            entry = self._index.get(key)
            if entry is None or entry.state != _READY or entry.readers:
                continue
            del self._index[key]
            self.policy.removed(key)
            self._used -= entry.size
            need -= entry.size
            gone.append(key)
        self._counts["evictions"] += len(gone)
        return gone

    def _unlink(self, keys: Iterable[bytes]) -> None:
        """Delete dropped objects' files, unless the key was stored again since.

        The check and the unlink share the lock: a new store of the key adds its
        index entry before it writes, so the file removed here is never its.
        (A new store that is still writing replaces the old file when it publishes.)
        """
        for key in keys:
            path = self.file_of(key)
            with self._lock:
                if key in self._index:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # ------------------------------------------------------------ stores

    def start_store(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        *,
        direct: bool,
        done: Callable[[int, BaseException | None], None],
    ) -> None:
        """Write ``payloads[i]`` under ``keys[i]`` on the write pool; never blocks.

        ``done(nbytes, error)`` is called once, from a pool thread (or here, if
        nothing needs writing). Keys already stored or being written are skipped
        (the same key names the same bytes). ``error`` is a
        :class:`TierFullError` or :class:`TransferError` naming what failed.
        """
        todo: list[tuple[bytes, memoryview]] = []
        with self._lock:
            self._check_open()
            victims: list[bytes] = []
            full: list[bytes] = []
            for key, payload in zip(keys, payloads, strict=True):
                if key in self._index:
                    self._counts["already_stored"] += 1
                    self.policy.touched(key)
                    continue
                size = self._file_bytes(key)
                over = self._used + size - self.capacity_bytes
                if over > 0:
                    victims += self._evict_locked(over)
                    if self._used + size > self.capacity_bytes:
                        full.append(key)
                        continue
                self._index[key] = _Entry(_WRITING, size)
                self._used += size
                self.policy.inserted(key)  # in job order; victims skip it while writing
                todo.append((key, payload))
            self._counts["store_failures"] += len(full)
        batches = _split(todo, self.queue_depth)
        job = _Job(max(1, len(batches)), self._store_done(done, full))
        if not todo:
            self._unlink(victims)
            job.finish_batch(0)
            return
        for i, batch in enumerate(batches):
            self._writers.queue.put(
                lambda scratch, b=batch, v=(victims if i == 0 else []): self._write_batch(
                    job, b, v, direct, scratch
                )
            )

    def _store_done(
        self, done: Callable[[int, BaseException | None], None], full: list[bytes]
    ) -> Callable[[_Job], None]:
        def report(job: _Job) -> None:
            if not full and not job.errors:
                done(job.nbytes, None)
                return
            failed = [k.hex()[:16] for k in full] + [k.hex()[:16] for k, _ in job.errors]
            error: TransferError
            causes = [e for _, e in job.errors]
            if full or any(getattr(e, "errno", None) == errno.ENOSPC for e in causes):
                error = TierFullError(
                    f"{len(failed)} object(s) not stored, the disk tier is full "
                    f"(cap {self.capacity_bytes} bytes or ENOSPC): {failed[:4]}"
                )
            else:
                error = TransferError(f"{len(failed)} object(s) not stored: {failed[:4]}")
            if causes:
                error.__cause__ = causes[0]
            done(job.nbytes, error)

        return report

    def _write_batch(
        self,
        job: _Job,
        batch: list[tuple[bytes, memoryview]],
        victims: list[bytes],
        direct: bool,
        scratch: mmap.mmap,
    ) -> None:
        nbytes = 0
        try:
            self._unlink(victims)
            for key, payload in batch:
                with self._lock:  # loads go first
                    while self._loads_active:
                        self._loads_idle.wait()
                try:
                    self._write_one(key, payload, direct, scratch)
                except Exception as exc:  # noqa: BLE001 - reported in the job's result
                    with self._lock:
                        entry = self._index.pop(key, None)
                        if entry is not None:
                            self._used -= entry.size
                            self.policy.removed(key)
                        self._counts["store_failures"] += 1
                    with job.lock:
                        job.errors.append((key, exc))
                    continue
                with self._lock:
                    entry = self._index.get(key)
                    if entry is not None:
                        entry.state = _READY
                    self._counts["stored"] += 1
                nbytes += payload.nbytes
        finally:
            job.finish_batch(nbytes)

    def _write_one(self, key: bytes, payload: memoryview, direct: bool, scratch: mmap.mmap) -> None:
        trailer = Trailer.for_payload(key, payload).encode(PAGE)
        tail = memoryview(scratch)[: len(trailer)]
        tail[:] = trailer
        shard = self._shard(key)
        if shard not in self._shards:
            shard.mkdir(parents=True, exist_ok=True)
            self._shards.add(shard)  # a set add is atomic under the GIL
        final = shard / f"{key.hex()}.kv"
        tmp = shard / f"{key.hex()}.kv.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o644)
        try:
            _write_all(fd, [payload, tail], payload.nbytes + len(trailer))
            if self.fsync != "never":
                os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            tail.release()
        os.close(fd)
        os.replace(tmp, final)
        if self.fsync == "always":
            dfd = os.open(shard, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    # ------------------------------------------------------------ loads

    def start_load(
        self,
        keys: Sequence[bytes],
        dests: Sequence[memoryview],
        *,
        direct: bool,
        done: Callable[[int, BaseException | None], None],
    ) -> None:
        """Read ``keys[i]`` into ``dests[i]`` on the read pool; never blocks.

        ``done(nbytes, error)`` is called once; ``error`` is a
        :class:`KeyMissError` naming the missing keys and the loaded ones. A
        missing key's destination is zeroed, never left with unverified bytes.
        """
        todo: list[tuple[bytes, memoryview]] = []
        missing: list[bytes] = []
        with self._lock:
            self._check_open()
            for key, dest in zip(keys, dests, strict=True):
                entry = self._index.get(key)
                if entry is None or entry.state != _READY:
                    missing.append(key)
                    continue
                entry.readers += 1  # pinned: eviction skips it until the read ends
                self.policy.touched(key)
                todo.append((key, dest))
            self._counts["misses"] += len(missing)
            if todo:
                self._loads_active += 1
        gone = set(missing)
        for key, dest in zip(keys, dests, strict=True):
            if key in gone:
                _zero(dest)
        batches = _split(todo, self.queue_depth)
        job = _Job(max(1, len(batches)), self._load_done(keys, done, active=bool(todo)))
        job.missing += missing
        if not todo:
            job.finish_batch(0)
            return
        for batch in batches:
            self._readers.queue.put(
                lambda scratch, b=batch: self._read_batch(job, b, direct, scratch)
            )

    def _load_done(
        self,
        keys: Sequence[bytes],
        done: Callable[[int, BaseException | None], None],
        *,
        active: bool,
    ) -> Callable[[_Job], None]:
        def report(job: _Job) -> None:
            if active:  # this load counted as active: stores may go on once none is
                with self._lock:
                    self._loads_active -= 1
                    if not self._loads_active:
                        self._loads_idle.notify_all()
            if not job.missing:
                done(job.nbytes, None)
                return
            gone = set(job.missing)
            loaded = tuple(k for k in keys if k not in gone)
            error = KeyMissError(
                f"{len(gone)} of {len(keys)} key(s) missed in the disk tier: "
                f"{[k.hex()[:16] for k in job.missing[:4]]}",
                missing=tuple(k for k in keys if k in gone),
                loaded=loaded,
            )
            if job.errors:
                error.__cause__ = job.errors[0][1]
            done(job.nbytes, error)

        return report

    def _read_batch(
        self, job: _Job, batch: list[tuple[bytes, memoryview]], direct: bool, scratch: mmap.mmap
    ) -> None:
        nbytes = 0
        bad: list[tuple[bytes, BaseException]] = []
        try:
            for key, dest in batch:
                try:
                    self._read_one(key, dest, direct, scratch)
                    nbytes += dest.nbytes
                except (OSError, TrailerError) as exc:
                    _zero(dest)
                    bad.append((key, exc))
        finally:
            with self._lock:
                for key, _dest in batch:
                    entry = self._index.get(key)
                    if entry is not None:
                        entry.readers -= 1
                self._counts["hits"] += len(batch) - len(bad)
                self._counts["misses"] += len(bad)
                corrupt: list[bytes] = []
                for key, err in bad:
                    if isinstance(err, TrailerError):
                        self._counts["corrupt"] += 1
                    elif not isinstance(err, FileNotFoundError):
                        continue  # an I/O error says nothing about the file: keep it
                    entry = self._index.get(key)
                    if entry is not None and entry.state == _READY and not entry.readers:
                        del self._index[key]  # unverifiable: never served again
                        self.policy.removed(key)
                        self._used -= entry.size
                        corrupt.append(key)
            self._unlink(corrupt)
            with job.lock:
                job.errors += bad
                job.missing += [k for k, _ in bad]
            job.finish_batch(nbytes)

    def _read_one(self, key: bytes, dest: memoryview, direct: bool, scratch: mmap.mmap) -> None:
        tsize = Trailer.size(len(key), PAGE)
        total = dest.nbytes + tsize
        fd = os.open(self.file_of(key), os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise TrailerError("truncated", f"object file has {size} bytes, expected {total}")
            tail = memoryview(scratch)[:tsize]
            try:
                n = _preadv(fd, [dest, tail], 0)
                if n != total:
                    raise TrailerError("truncated", f"read {n} of {total} bytes")
                Trailer.decode(bytes(tail), key=key, length=dest.nbytes).verify(dest)
            finally:
                tail.release()
        finally:
            os.close(fd)

    # ------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"the disk store at {self.path} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish queued I/O, stop the threads, release the directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._readers.close()
        self._writers.close()
        os.close(self._lock_fd)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and hasattr(self, "_writers"):
            warnings.warn(
                f"DiskStore at {self.path} was never closed", ResourceWarning, stacklevel=2
            )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        with self._lock:
            used, n = self._used, len(self._index)
        return (
            f"<DiskStore {self.path} {state} objects={n} used={used}/{self.capacity_bytes} "
            f"direct={self.direct} queue_depth={self.queue_depth}>"
        )


def _split(
    items: list[tuple[bytes, memoryview]], parts: int
) -> list[list[tuple[bytes, memoryview]]]:
    """``items`` in at most ``parts`` contiguous batches of near-equal size."""
    if not items:
        return []
    step = math.ceil(len(items) / min(parts, len(items)))
    return [items[i : i + step] for i in range(0, len(items), step)]


def _zero(view: memoryview) -> None:
    view[:] = bytes(view.nbytes)
