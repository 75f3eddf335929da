"""The local-disk store behind the ``CPU <-> DISK`` handlers: records appended to
preallocated segment files (the layout of a new directory), or, in a directory
written before segments, a file per object or a pack file per few small objects.

Directory layout (``path`` must exist and be writable)::

    path/config.json           the LayoutDigest, and "store" for the segment layout
    path/lock                  flock-ed by the one DiskStore that owns the directory
    path/segments/<n>.seg      head page || record || record ... (segment layout)
    path/objects/ab/cd/<key hex>.kv       payload || trailer (padded to 4096 bytes)
    path/objects/ab/cd/<key hex>.kv.tmp   an object being written
    path/packs/ef/<pack number>.pk        header || slot || slot ... (objects < pack_bytes)
    path/packs/ef/<pack number>.pk.tmp    a pack being written

A directory is opened only in the layout it was written in (``segment_bytes``:
``None`` follows the directory, segments for a new one; 0 or N asks for one, and
another layout is a :class:`LayoutMismatchError`).

**Segments.** A segment file of ``segment_bytes`` is preallocated at its first
use and reused, never re-created. Page 0 is its head (its generation, random at
each use); records follow back to back, each a pack's ``header || slots`` whose
header also carries the generation. A record's slots are written first and its
header after them, so a killed writer leaves nothing a restart indexes. A
restart walks each segment's record headers from page 1 and stops at the first
that is not whole or not of the head's generation (stale records of an earlier
use never come back); segments holding records are closed to appends, empty ones
are free. ``used`` is the segments' bytes; eviction empties a whole idle
segment, which is then reused under a new generation.

**Files and packs.** ``ab/cd`` are the first four hex digits of the key's xxh64,
so directories stay small whatever the keys look like; ``ef`` is the pack number
mod 256.

**Packs.** Objects smaller than ``pack_bytes`` (1 MiB by default) are written
``pack_slots`` at a time (enough for ``pack_bytes``) into one pack file with one
``pwritev``: a header naming the keys, then one page-aligned slot per object,
``payload || trailer`` as in a file of its own (:mod:`offload_engine.disk._pack`).
The index maps each key to (pack, slot). A load whose keys sit in consecutive
slots of one pack reads them with one ``preadv``; each object is verified alone,
so a bad one is a miss alone. The packs of one store job are the job's new keys
in job order, ``pack_slots`` each (the last may be smaller). Pack numbers
are never reused; a restart indexes a pack from its header (one read) and, if a
key is in two packs, keeps the newer one.

**Publishing (files and packs).** A writer fills ``<name>.tmp`` and renames it over ``<name>``
(``os.replace``, atomic), so a reader sees a whole object or none. The fsync
policy (``fsync=``): ``"never"`` (default) leaves flushing to the kernel. A
killed *process* loses nothing the rename published; after a *power loss* a
published file may be torn, and then its checksum fails and it is a miss.
``"data"`` fdatasyncs each file before the rename (durable objects),
``"always"`` also fsyncs the directory after it (durable names). With
segments, ``"data"`` fdatasyncs after the head, the slots and the header (a
header is durable only after its slots), ``"always"`` also fsyncs ``segments/``
after creating a segment file.

**Verifying.** A load reads payload and trailer in one ``preadv`` straight into
the host slot, then checks the trailer's key, length, version and xxh3-64. A
missing, truncated, corrupted or foreign object is a *miss*: counted, reported in
:class:`~offload_engine.KeyMissError`, its slot zeroed, and it is dropped (its
file deleted; in a pack or segment, its index entry).

**I/O.** ``os.preadv``/``os.pwritev`` (they release the GIL) on two thread pools
of ``queue_depth`` threads each, one for loads and one for stores. A job's
objects are split into at most ``queue_depth`` batches, each run by one thread.
Loads have priority: a store thread waits between objects while any load is in
flight. With O_DIRECT (probed per directory, needs page-aligned host memory and
page-multiple objects; otherwise buffered I/O, logged) the page cache is bypassed.

**Capacity (files and packs).** ``capacity_bytes`` caps the bytes of published and in-progress
files (payload and trailer, pack headers). A store evicts the policy's victims
(LRU by default) until the object (or pack) fits; objects being read or written
are never evicted; if it still cannot fit, that object (or pack) fails with
:class:`~offload_engine.TierFullError`. A victim in a pack evicts its whole pack
(a pack's bytes are freed only with its file); an object dropped as corrupt
leaves its pack, whose file goes when its last indexed object does. At start
the index is rebuilt from the file names and sizes and the packs' headers (no
payload is read), leftover ``.tmp`` files are deleted, and the LRU order is the
files' modification times.
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
import secrets
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import xxhash

from offload_engine._checks import check_int
from offload_engine.disk import _pack
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

PACK_BYTES = 2**20
"""Objects smaller than this are written several to a pack file, one request of at
least this many bytes (``DiskStore(pack_bytes=)``; 0 writes one file per object)."""

SEGMENT_BYTES = 128 * 2**20
"""The largest segment a new directory gets by default (``segment_bytes=None``:
a 16th of ``capacity_bytes``, at most this), and a reasonable explicit size for a
large tier."""

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


class _Pack:
    """One pack file: its objects' keys in slot order and how many are still indexed.

    ``size`` (the file's bytes) is counted in the store's ``used`` from the pack's
    creation until its file is deleted: when it is evicted (whole), or when its
    last indexed object goes (dropped as corrupt).
    """

    __slots__ = ("base", "first", "keys", "live", "path", "pins", "seg", "size", "slot", "writing")

    def __init__(
        self,
        path: Path,
        keys: list[bytes],
        first: int,
        slot: int,
        size: int,
        seg: _Segment | None = None,
        base: int = 0,
    ) -> None:
        self.path = path
        self.keys = keys
        self.base = base  # where its header starts in the file (0 for a pack file)
        self.first = first  # the file offset of slot 0 (after the header)
        self.slot = slot
        self.size = size
        self.live = len(keys)
        self.pins = 0  # loads in flight of its objects
        self.writing = True
        self.seg = seg  # the segment holding this record; None for a pack file


class _Segment:
    """One preallocated segment file: records appended at ``cursor`` during one use
    (``generation``), recycled whole when its last indexed object goes.

    Its ``segment_bytes`` count in the store's ``used`` from its creation on
    (the file is kept and reused, never deleted, except when the cap shrinks).
    """

    __slots__ = (
        "cursor", "fresh", "generation", "holes", "live", "number", "path", "prep", "ready",
        "records", "writing",
    )  # fmt: skip

    def __init__(self, number: int, path: Path, *, fresh: bool) -> None:
        self.number = number
        self.path = path
        self.fresh = fresh  # the file is still to be created and preallocated
        self.generation = 0  # of the current use; 0: free
        self.ready = 0  # the generation whose segment head is on disk
        self.cursor = PAGE  # where the next record goes (page 0 is the head)
        self.records: list[_Pack] = []
        self.live = 0  # indexed objects (stored or being written)
        self.writing = 0  # records being written
        self.prep = threading.Lock()
        # records that failed before the head of their generation was written:
        # (base, bytes, generation), marked as holes once it is
        self.holes: list[tuple[int, int, int]] = []


class _Entry:
    __slots__ = ("pack", "readers", "size", "slot", "state")

    def __init__(self, state: int, size: int, pack: _Pack | None = None, slot: int = 0) -> None:
        self.state = state
        self.size = size  # the object file's bytes; 0 in a pack (the pack counts)
        self.readers = 0
        self.pack = pack
        self.slot = slot


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
_T = TypeVar("_T")
_Unit = tuple[_Pack | None, list[bytes], list[memoryview]]
"""What one write request stores: a pack and its objects, or one object (pack ``None``)."""
_Run = tuple[_Pack | None, int, list[tuple[bytes, memoryview]]]
"""What one read request loads: objects in consecutive slots of a pack from ``slot``,
or one object file (pack ``None``)."""


class _Pool:
    """``n`` threads running batches from one queue; each has its own page-aligned
    scratch of ``scratch_bytes`` (trailers, pack headers)."""

    def __init__(self, n: int, name: str, scratch_bytes: int) -> None:
        self.scratch_bytes = scratch_bytes
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
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


def _write_all(fd: int, bufs: list[memoryview], total: int, offset: int = 0) -> None:
    """pwritev until ``total`` bytes are written at ``offset`` (a short write retries
    the rest, so a full disk surfaces as ENOSPC)."""
    done = _pwritev(fd, bufs, offset)
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
    """Objects of ``digest.page_bytes`` payload bytes under ``path``.

    ``segment_bytes`` picks the layout. ``None`` (default): the directory's own,
    and for a new directory segments of a 16th of ``capacity_bytes`` (at most
    :data:`SEGMENT_BYTES`). ``N`` > 0: segments of ``N`` bytes (a multiple of
    4096): every object goes into a record appended to a preallocated segment
    file, each record at least ``pack_bytes`` and, for a job of many objects, one
    per I/O thread; segments are evicted and reused whole. ``0``: one file per
    object or, when smaller than ``pack_bytes`` (``None``: :data:`PACK_BYTES`,
    1 MiB; 0: never), several to a pack file written with one request of >=
    ``pack_bytes``. A directory written in another layout raises
    :class:`LayoutMismatchError`.

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
        pack_bytes: int | None = None,
        segment_bytes: int | None = None,
    ) -> None:
        if not isinstance(digest, LayoutDigest):
            raise ConfigError(f"DiskStore takes a LayoutDigest, got {type(digest).__name__}")
        check_int(capacity_bytes, "DiskStore capacity_bytes")
        check_int(queue_depth, "DiskStore queue_depth")
        if pack_bytes is None:
            pack_bytes = PACK_BYTES
        check_int(pack_bytes, "DiskStore pack_bytes", minimum=0)
        if segment_bytes is not None:
            check_int(segment_bytes, "DiskStore segment_bytes", minimum=0)
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
        self.pack_bytes = pack_bytes
        self._slot_bytes = _pack.slot_bytes(self.payload_bytes, PAGE)
        self._tail_bytes = self._slot_bytes - self.payload_bytes
        slots = -(-pack_bytes // self._slot_bytes)
        # objects smaller than pack_bytes go into packs of >= pack_bytes (one request each)
        self.pack_slots = (
            min(slots, _pack.MAX_PACK_SLOTS) if self.payload_bytes < pack_bytes and slots > 1 else 0
        )
        self._segments: dict[int, _Segment] = {}
        self._free: list[_Segment] = []  # emptied segments, reused before new ones
        self._active: _Segment | None = None  # where new records go
        self._record_min = max(1, slots)  # a record holds >= pack_bytes ...
        self._record_max = 0  # ... and at most this many objects (what fits a segment)
        if segment_bytes:  # a bad size fails before the directory is touched
            self._fit_slots(segment_bytes, capacity_bytes)
        self.segment_bytes = 0  # files and packs, or segments of this size: set by the config
        self._next_pack = 0
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
            self._check_config(segment_bytes)
            if self.segment_bytes:
                self.pack_slots = 0
                self._record_max = self._fit_slots(self.segment_bytes, capacity_bytes)
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
        # a read request covers at most this many slots (packs of an earlier run with
        # another pack_bytes may hold more)
        self._run_slots = max(1, self.pack_slots, self._record_max)
        # a run stops growing once it reaches pack_bytes: requests of about that size
        # read small objects well, and a run of several large objects read slower
        # than one request per object (performance.md, session 4)
        self._read_slots = min(self._run_slots, max(1, slots))
        trailers = max(PAGE, self._run_slots * self._tail_bytes)
        most = max(self.pack_slots, self._record_max)
        headers = _pack.max_header_bytes(most, PAGE) if most else 0
        self._readers = _Pool(queue_depth, "offload-engine-disk-read", trailers)
        self._writers = _Pool(queue_depth, "offload-engine-disk-write", headers + trailers)

    def _fit_slots(self, segment_bytes: int, capacity_bytes: int) -> int:
        """The most objects one record may hold in a segment of ``segment_bytes``
        (:class:`ConfigError` if not even one fits, or the cap holds no segment)."""
        if segment_bytes % PAGE:
            raise ConfigError(f"DiskStore segment_bytes must be a multiple of {PAGE}")
        room = segment_bytes - PAGE  # page 0 is the segment head
        fit = 0
        for k in range(_pack.MAX_PACK_SLOTS, 0, -1):
            if _pack.max_header_bytes(k, PAGE) + k * self._slot_bytes <= room:
                fit = k
                break
        if not fit:
            need = PAGE + _pack.max_header_bytes(1, PAGE) + self._slot_bytes
            raise ConfigError(
                f"DiskStore segment_bytes={segment_bytes} cannot hold one object of "
                f"{self.payload_bytes} bytes (needs >= {need})"
            )
        if capacity_bytes < segment_bytes:
            raise ConfigError(
                f"DiskStore capacity_bytes={capacity_bytes} is less than one segment "
                f"({segment_bytes} bytes)"
            )
        return fit

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

    @staticmethod
    def _store_format(segment_bytes: int) -> dict[str, object] | None:
        """What ``config.json`` records beside the digest: ``None`` for files and packs."""
        if not segment_bytes:
            return None
        return {"format": "segments", "segment_bytes": segment_bytes}

    def _default_segment_bytes(self) -> int:
        """A new directory's segment size: a 16th of the cap, at most
        :data:`SEGMENT_BYTES`, at least what one object needs."""
        smallest = PAGE + _pack.max_header_bytes(1, PAGE) + self._slot_bytes
        return max(min(SEGMENT_BYTES, self.capacity_bytes // 16 // PAGE * PAGE), smallest)

    def _check_config(self, segment_bytes: int | None) -> None:
        """Check (or write) ``config.json`` and set ``self.segment_bytes``: the
        directory's layout when ``segment_bytes`` is ``None``, else that one (a
        directory written in another layout is refused)."""
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
            have = data.get("store")
            if have is not None and (
                not isinstance(have, dict) or have.get("format") != "segments"
            ):
                raise LayoutMismatchError(f"{config} names an unknown store layout: {have!r}")
            if segment_bytes is None:
                try:
                    self.segment_bytes = int(have["segment_bytes"]) if have is not None else 0
                except (TypeError, KeyError, ValueError) as exc:
                    raise LayoutMismatchError(f"{config} names no store layout: {exc}") from exc
                return
            want = self._store_format(segment_bytes)
            if have != want:

                def name(f: object) -> str:
                    return "files and packs" if f is None else json.dumps(f, sort_keys=True)

                raise LayoutMismatchError(
                    f"disk tier directory {self.path} was written in the {name(have)} "
                    f"layout; this store was opened for {name(want)}"
                )
            self.segment_bytes = segment_bytes
            return
        if segment_bytes is None:  # a new directory: segments
            segment_bytes = self._default_segment_bytes()
        if segment_bytes:
            self._fit_slots(segment_bytes, self.capacity_bytes)
        self.segment_bytes = segment_bytes
        layout = {"layout": json.loads(self.digest.to_json())}
        want = self._store_format(segment_bytes)
        if want is not None:
            layout["store"] = want
        body = json.dumps(layout, indent=2, sort_keys=True)
        tmp = config.with_suffix(".json.tmp")
        try:
            tmp.write_text(body + "\n")
            os.replace(tmp, config)
        except OSError as exc:
            raise TierUnavailableError(
                f"disk tier directory {self.path} is not writable: {exc.strerror}"
            ) from exc

    def _rebuild_index(self) -> None:
        """Index every whole object file from its name and size, and every whole pack
        from its header (no payload is read); delete leftovers."""
        if self.segment_bytes:
            self._rebuild_segments()
            return
        found: list[tuple[float, int, list[bytes], _Pack | None, int]] = []
        removed = 0
        root = self.path / "objects"
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
                    found.append((st.st_mtime, -1, [key], None, st.st_size))
        for dirpath, _dirs, files in os.walk(self.path / "packs"):
            for name in files:
                packed = Path(dirpath) / name
                seq = self._pack_seq(name)
                pack = None
                if seq is not None and packed.parent == self._pack_file(seq).parent:
                    pack = self._read_pack(packed)
                if pack is None or seq is None:
                    packed.unlink(missing_ok=True)  # a half write, a bad header, or not ours
                    removed += 1
                    continue
                self._next_pack = max(self._next_pack, seq + 1)
                found.append((packed.stat().st_mtime, seq, pack.keys, pack, pack.size))
        found.sort(key=lambda f: (f[0], f[1], f[2][0]))  # oldest first; a later copy wins
        for _mtime, _seq, keys, pack, size in found:
            self._used += size
            for slot, key in enumerate(keys):
                old = self._index.get(key)
                if old is not None:
                    stale = self._forget_locked(key, old)
                    if stale is not None:
                        stale.unlink(missing_ok=True)
                        removed += 1
                self._index[key] = _Entry(_READY, 0 if pack else size, pack, slot)
                self.policy.inserted(key)
            if pack is not None:
                pack.writing = False
        self._counts["recovered"] = len(self._index)
        self._counts["removed_at_start"] = removed
        if self._used > self.capacity_bytes:  # the cap shrank since the last run
            self._unlink(self._evict_locked(self._used - self.capacity_bytes))

    def _rebuild_segments(self) -> None:
        """Index every segment's records by walking their headers from page 1 (no
        payload is read): a record counts if its header is whole and carries the
        generation of the segment's head; the walk stops at the first that does
        not (never written, torn, or left from an earlier use). Every segment that
        holds records is closed to new ones (it is reused once emptied); one that
        holds none is free."""
        sb = self.segment_bytes
        found: list[tuple[float, int, int, _Pack]] = []
        removed = 0
        root = self.path / "segments"
        names = sorted(os.listdir(root)) if root.is_dir() else []
        for name in names:
            file = root / name
            number = self._segment_number(name)
            try:
                st = file.stat()
            except FileNotFoundError:
                continue
            if number is None or st.st_size != sb or file != self._segment_file(number):
                file.unlink(missing_ok=True)  # not ours, or preallocation never finished
                removed += 1
                continue
            seg = _Segment(number, file, fresh=False)
            self._segments[number] = seg
            self._used += sb
            for pack in self._walk_segment(seg):
                found.append((st.st_mtime, number, pack.base, pack))
            if not seg.records:
                self._free.append(seg)
            else:
                seg.cursor = sb  # closed: appending after a torn record could revive stale ones
        found.sort(key=lambda f: f[:3])  # oldest first; a later copy wins
        for _mtime, _n, _base, pack in found:
            for slot, key in enumerate(pack.keys):
                old = self._index.get(key)
                if old is not None:
                    self._forget_locked(key, old)
                    removed += 1
                self._index[key] = _Entry(_READY, 0, pack, slot)
                self.policy.inserted(key)
        self._counts["recovered"] = len(self._index)
        self._counts["removed_at_start"] = removed
        while self._used > self.capacity_bytes:  # the cap shrank since the last run
            gone = self._free.pop() if self._free else self._evict_segment_locked()
            if gone is None:
                break
            del self._segments[gone.number]
            self._used -= sb
            gone.path.unlink(missing_ok=True)

    def _walk_segment(self, seg: _Segment) -> list[_Pack]:
        """The whole records of ``seg``'s current use (sets its generation)."""
        sb = self.segment_bytes
        try:
            fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            try:
                head = _pack.SegmentHead.decode(os.pread(fd, PAGE, 0))
            except (OSError, TrailerError):
                return []
            if head.segment_bytes != sb:
                return []
            seg.generation = seg.ready = head.generation
            at = PAGE
            while at + PAGE <= sb:
                try:
                    header = _read_header(fd, at)
                except (OSError, TrailerError):
                    break
                size = header.file_bytes(PAGE)
                if not header.keys:  # a hole left by a failed record: step over it
                    size += header.slot_bytes
                if header.generation != head.generation or at + size > sb:
                    break
                if not header.keys:
                    at += size
                    continue
                if header.slot_bytes != self._slot_bytes:
                    break
                first = at + header.size(PAGE)
                pack = _Pack(seg.path, list(header.keys), first, self._slot_bytes, size, seg, at)
                pack.writing = False
                seg.records.append(pack)
                seg.live += len(pack.keys)
                at += size
            return seg.records
        finally:
            os.close(fd)

    @staticmethod
    def _segment_number(name: str) -> int | None:
        return _hex_stem(name, ".seg")

    def _segment_file(self, number: int) -> Path:
        return self.path / "segments" / f"{number:08x}.seg"

    def _read_pack(self, file: Path) -> _Pack | None:
        """The pack in ``file`` from its header (one read, two if the header is long),
        or ``None`` if it is not a whole pack of this store's slot size."""
        try:
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                header = _read_header(fd, 0)
            finally:
                os.close(fd)
        except (OSError, TrailerError):
            return None
        if header.slot_bytes != self._slot_bytes or size != header.file_bytes(PAGE):
            return None
        return _Pack(file, list(header.keys), header.size(PAGE), header.slot_bytes, size)

    @staticmethod
    def _pack_seq(name: str) -> int | None:
        return _hex_stem(name, ".pk")

    def _pack_file(self, seq: int) -> Path:
        return self.path / "packs" / f"{seq % 256:02x}" / f"{seq:012x}.pk"

    def _forget_locked(self, key: bytes, entry: _Entry) -> Path | None:
        """Drop ``key`` from the index and accounting; the file to delete, if any
        (its object file, or its pack once the pack's last object is gone)."""
        del self._index[key]
        self.policy.removed(key)
        pack = entry.pack
        if pack is None:
            self._used -= entry.size
            return self.file_of(key)
        pack.live -= 1
        seg = pack.seg
        if seg is not None:  # the segment's bytes stay counted; it is reused once empty
            seg.live -= 1
            self._release_if_empty_locked(seg)
            return None
        if pack.live:
            return None
        self._used -= pack.size
        return pack.path

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
        """Where ``key``'s object lives as a file of its own (whether or not it is stored)."""
        return self._shard(key) / f"{key.hex()}.kv"

    def location(self, key: bytes) -> tuple[Path, int, int] | None:
        """``(file, offset, length)`` of stored ``key``'s object (payload and trailer),
        or ``None`` if it is not stored (or still being written)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.state != _READY:
                return None
            if entry.pack is None:
                return self.file_of(key), 0, entry.size
            pack = entry.pack
            return pack.path, pack.first + entry.slot * pack.slot, pack.slot

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

    def _evict_locked(self, need: int) -> list[bytes | _Pack]:
        """Drop idle objects until ``need`` bytes are freed (or none is left).

        A victim in a pack takes its whole pack with it (a pack's bytes are freed
        only with its file); a pack with an object being read or written is skipped.
        """
        gone: list[bytes | _Pack] = []
        index = self._index
        for key in self.policy.victims():
            if need <= 0:
                break
            entry = index.get(key)
            if entry is None or entry.state != _READY or entry.readers:
                continue
            pack = entry.pack
            if pack is None:
                self._forget_locked(key, entry)  # its file goes in _unlink
                need -= entry.size
                gone.append(key)
                self._counts["evictions"] += 1
                continue
            if pack.pins or pack.writing:
                continue
            self._evict_pack_locked(pack)
            self._used -= pack.size
            need -= pack.size
            gone.append(pack)
        return gone

    def _evict_pack_locked(self, pack: _Pack) -> None:
        """Drop every object of ``pack`` (a pack file or a segment record) still indexed."""
        index = self._index
        for k in pack.keys:
            e = index.get(k)
            if e is not None and e.pack is pack:
                del index[k]
                self.policy.removed(k)
                self._counts["evictions"] += 1
        pack.live = 0

    def _unlink(self, items: Iterable[bytes | _Pack]) -> None:
        """Delete dropped objects' files and dropped packs.

        An object file is kept if its key was stored again since: the check and
        the unlink share the lock, and a new store of the key adds its index
        entry before it writes, so the file removed here is never its. (A new
        store that is still writing replaces the old file when it publishes.)
        Pack files are never reused, so a dropped one simply goes.
        """
        for item in items:
            if isinstance(item, _Pack):
                item.path.unlink(missing_ok=True)
                continue
            path = self.file_of(item)
            with self._lock:
                if item in self._index:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # ------------------------------------------------------------ segments

    def _release_if_empty_locked(self, seg: _Segment) -> None:
        """Put ``seg`` on the free list once nothing in it is indexed or written."""
        if seg.live or seg.writing or seg is self._active or not seg.generation:
            return
        seg.generation = 0
        seg.records = []
        self._free.append(seg)

    def _evict_segment_locked(self) -> _Segment | None:
        """Empty the segment of the policy's first victim whose segment is idle (no
        record read or written, not the one being appended to); ``None`` if none is."""
        index = self._index
        for key in self.policy.victims():
            entry = index.get(key)
            if entry is None or entry.state != _READY or entry.pack is None:
                continue
            seg = entry.pack.seg
            if (
                seg is None
                or seg is self._active
                or seg.writing
                or any(r.pins for r in seg.records)
            ):
                continue
            for record in seg.records:
                self._evict_pack_locked(record)
            seg.live = 0
            seg.generation = 0
            seg.records = []
            return seg
        return None

    def _reserve_locked(self, size: int) -> tuple[_Segment, int] | None:
        """Room for a record of ``size`` bytes: (segment, offset), taking a free
        segment, a new one (if the cap allows one more) or an evicted one when the
        active one is full; ``None`` if none can be had."""
        seg = self._active
        if seg is None or seg.cursor + size > self.segment_bytes:
            self._active = None
            if seg is not None:
                self._release_if_empty_locked(seg)
            if self._free:
                seg = self._free.pop()
            elif (len(self._segments) + 1) * self.segment_bytes <= self.capacity_bytes:
                number = next(i for i in range(len(self._segments) + 1) if i not in self._segments)
                seg = _Segment(number, self._segment_file(number), fresh=True)
                self._segments[number] = seg
                self._used += self.segment_bytes
            else:
                seg = self._evict_segment_locked()
                if seg is None:
                    return None
            seg.generation = secrets.randbits(64) | 1  # never 0, never a likely earlier one
            seg.cursor = PAGE
            self._active = seg
        at = seg.cursor
        seg.cursor += size
        seg.writing += 1
        return seg, at

    def _fit_active_locked(self, keys: list[bytes]) -> list[bytes]:
        """The longest head of ``keys`` whose record fits the rest of the active
        segment; all of them if none fits (the record then opens another segment)."""
        seg = self._active
        if seg is None:
            return keys
        rest = self.segment_bytes - seg.cursor
        for k in range(len(keys), 0, -1):
            if _pack.header_bytes(keys[:k], PAGE, record=True) + k * self._slot_bytes <= rest:
                return keys[:k]
        return keys

    def _record_slots(self, n: int) -> int:
        """Objects per record for a job storing ``n``: >= pack_bytes, one record per
        I/O thread for a large job, no more than a segment holds."""
        return min(self._record_max, max(self._record_min, -(-n // self.queue_depth)))

    def _prepare_segment(self, seg: _Segment, generation: int, fd: int, page: memoryview) -> None:
        """Create and preallocate ``seg``'s file (first use), and write the head of
        ``generation`` before any of its records (each use, once)."""
        with seg.prep:
            if seg.ready == generation:
                return
            if seg.fresh:
                os.posix_fallocate(fd, 0, self.segment_bytes)
                seg.fresh = False
                if self.fsync == "always":
                    self._sync_dir(seg.path.parent)
            page[:] = _pack.SegmentHead(self.segment_bytes, generation).encode(PAGE)
            _write_all(fd, [page], PAGE, 0)
            for base, size, gen in seg.holes:
                if gen == generation:
                    page[:] = _pack.PackHeader((), size - PAGE, gen).encode(PAGE)
                    _write_all(fd, [page], PAGE, base)
            seg.holes = []
            if self.fsync != "never":
                os.fdatasync(fd)
            seg.ready = generation

    def _write_record(
        self,
        seg: _Segment,
        pack: _Pack,
        generation: int,
        payloads: list[memoryview],
        direct: bool,
        scratch: mmap.mmap,
    ) -> None:
        """Slots first, then (once they are written) the header that makes them a
        record: a killed writer leaves no header, so nothing of it is indexed."""
        if seg.path.parent not in self._shards:
            seg.path.parent.mkdir(exist_ok=True)
            self._shards.add(seg.path.parent)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
        fd = os.open(seg.path, flags, 0o644)
        mem = memoryview(scratch)
        hsize = pack.first - pack.base
        views: list[memoryview] = []
        try:
            head = mem[:PAGE]
            views.append(head)
            self._prepare_segment(seg, generation, fd, head)
            bufs = self._slots(pack.keys, payloads, mem, hsize, views)
            _write_all(fd, bufs, pack.size - hsize, pack.first)
            if self.fsync != "never":
                os.fdatasync(fd)
            header = mem[:hsize]
            views.append(header)
            header[:] = _pack.PackHeader(tuple(pack.keys), pack.slot, generation).encode(PAGE)
            _write_all(fd, [header], hsize, pack.base)
            if self.fsync != "never":
                os.fdatasync(fd)
        finally:
            for v in views:
                v.release()
            mem.release()
            os.close(fd)

    def _write_hole(self, seg: _Segment, pack: _Pack, direct: bool, scratch: mmap.mmap) -> None:
        """After a record failed: a header with no keys spanning it, so a restart's
        walk steps over it to the records after it (best effort: if this fails
        too, the walk stops there and those records are missed)."""
        generation = seg.generation
        page = memoryview(scratch)[:PAGE]
        try:
            with seg.prep:
                if seg.ready != generation:  # the head is not written yet: with it
                    seg.holes.append((pack.base, pack.size, generation))
                    return
                page[:] = _pack.PackHeader((), pack.size - PAGE, generation).encode(PAGE)
                flags = os.O_WRONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
                fd = os.open(seg.path, flags)
                try:
                    _write_all(fd, [page], PAGE, pack.base)
                finally:
                    os.close(fd)
        except OSError as exc:
            log.warning("could not mark a failed record in %s: %s", seg.path, exc)
        finally:
            page.release()

    @staticmethod
    def _sync_dir(path: Path) -> None:
        dfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

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
        With packing on, the job's objects go in job order into packs of
        ``pack_slots`` (the last one smaller), one file and one request each.
        """
        units: list[_Unit] = []
        with self._lock:
            self._check_open()
            victims: list[bytes | _Pack] = []
            full: list[bytes] = []
            fresh: dict[bytes, memoryview] = {}
            for key, payload in zip(keys, payloads, strict=True):
                if key in self._index or key in fresh:
                    self._counts["already_stored"] += 1
                    self.policy.touched(key)
                else:
                    fresh[key] = payload
            new = list(fresh.items())
            per = self._record_slots(len(new)) if self.segment_bytes else (self.pack_slots or 1)
            i = 0
            while i < len(new):
                group = new[i : i + per]
                gkeys = [k for k, _ in group]
                pack: _Pack | None = None
                if self.segment_bytes:
                    # a record that does not fit the rest of the active segment is cut
                    # to what does, so a segment's tail is not left empty
                    gkeys = self._fit_active_locked(gkeys)
                    group = group[: len(gkeys)]
                i += len(group)
                if self.segment_bytes:
                    first = _pack.header_bytes(gkeys, PAGE, record=True)
                    size = first + len(gkeys) * self._slot_bytes
                    room = self._reserve_locked(size)
                    if room is None:
                        full += gkeys
                        continue
                    seg, at = room
                    pack = _Pack(seg.path, gkeys, at + first, self._slot_bytes, size, seg, at)
                    seg.records.append(pack)
                    seg.live += len(gkeys)
                    for slot, key in enumerate(gkeys):
                        self._index[key] = _Entry(_WRITING, 0, pack, slot)
                        self.policy.inserted(key)
                    units.append((pack, gkeys, [p for _, p in group]))
                    continue
                if self.pack_slots:
                    seq = self._next_pack
                    first = _pack.header_bytes(gkeys, PAGE)
                    size = first + len(gkeys) * self._slot_bytes
                else:
                    size = self._file_bytes(gkeys[0])
                over = self._used + size - self.capacity_bytes
                if over > 0:
                    victims += self._evict_locked(over)
                    if self._used + size > self.capacity_bytes:
                        full += gkeys
                        continue
                if self.pack_slots:
                    self._next_pack += 1
                    pack = _Pack(self._pack_file(seq), gkeys, first, self._slot_bytes, size)
                for slot, key in enumerate(gkeys):
                    self._index[key] = _Entry(_WRITING, 0 if pack else size, pack, slot)
                    self.policy.inserted(key)  # in job order; victims skip it while writing
                self._used += size
                units.append((pack, gkeys, [p for _, p in group]))
            self._counts["store_failures"] += len(full)
        batches = _split(units, self.queue_depth)
        job = _Job(max(1, len(batches)), self._store_done(done, full))
        if not units:
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
        batch: list[_Unit],
        victims: list[bytes | _Pack],
        direct: bool,
        scratch: mmap.mmap,
    ) -> None:
        nbytes = 0
        try:
            self._unlink(victims)
            for pack, keys, payloads in batch:
                with self._lock:  # loads go first
                    while self._loads_active:
                        self._loads_idle.wait()
                seg = pack.seg if pack is not None else None
                try:
                    if pack is None:
                        self._write_one(keys[0], payloads[0], direct, scratch)
                    elif seg is not None:  # stable while the record is being written
                        self._write_record(seg, pack, seg.generation, payloads, direct, scratch)
                    else:
                        self._write_pack(pack, payloads, direct, scratch)
                except Exception as exc:  # noqa: BLE001 - reported in the job's result
                    if seg is not None and pack is not None:
                        self._write_hole(seg, pack, direct, scratch)
                    with self._lock:
                        for key in keys:
                            entry = self._index.pop(key, None)
                            if entry is not None:
                                self._used -= entry.size
                                self.policy.removed(key)
                        if seg is not None and pack is not None:
                            # its bytes stay in the segment, never indexed (no header)
                            seg.live -= pack.live
                            pack.live = 0
                            seg.writing -= 1
                            self._release_if_empty_locked(seg)
                        elif pack is not None:
                            self._used -= pack.size
                            pack.live = 0
                        self._counts["store_failures"] += len(keys)
                    with job.lock:
                        job.errors += [(key, exc) for key in keys]
                    continue
                with self._lock:
                    for key in keys:
                        entry = self._index.get(key)
                        if entry is not None:
                            entry.state = _READY
                    if pack is not None:
                        pack.writing = False
                    if seg is not None:
                        seg.writing -= 1
                        self._release_if_empty_locked(seg)
                    self._counts["stored"] += len(keys)
                nbytes += sum(p.nbytes for p in payloads)
        finally:
            job.finish_batch(nbytes)

    def _write_one(self, key: bytes, payload: memoryview, direct: bool, scratch: mmap.mmap) -> None:
        trailer = Trailer.for_payload(key, payload).encode(PAGE)
        tail = memoryview(scratch)[: len(trailer)]
        tail[:] = trailer
        try:
            self._publish(self.file_of(key), [payload, tail], direct)
        finally:
            tail.release()

    def _slots(
        self,
        keys: list[bytes],
        payloads: list[memoryview],
        mem: memoryview,
        at: int,
        views: list[memoryview],
    ) -> list[memoryview]:
        """``payload, trailer, payload, trailer ...`` for one write of consecutive slots,
        the (page-padded) trailers built in ``mem`` from ``at`` (their views added
        to ``views``, to release)."""
        bufs: list[memoryview] = []
        tb = self._tail_bytes
        for key, payload in zip(keys, payloads, strict=True):
            trailer = Trailer.for_payload(key, payload).encode(PAGE)
            tail = mem[at : at + tb]
            views.append(tail)
            tail[: len(trailer)] = trailer
            if tb > len(trailer):
                tail[len(trailer) :] = bytes(tb - len(trailer))
            bufs += [payload, tail]
            at += tb
        return bufs

    def _write_pack(
        self, pack: _Pack, payloads: list[memoryview], direct: bool, scratch: mmap.mmap
    ) -> None:
        """Header, then each object's payload and (page-padded) trailer: one ``pwritev``."""
        header = _pack.PackHeader(tuple(pack.keys), pack.slot).encode(PAGE)
        mem = memoryview(scratch)
        views = [mem[: len(header)]]
        views[0][:] = header
        try:
            bufs = [views[0], *self._slots(pack.keys, payloads, mem, len(header), views)]
            self._publish(pack.path, bufs, direct)
        finally:
            for v in views:
                v.release()
            mem.release()

    def _publish(self, final: Path, bufs: list[memoryview], direct: bool) -> None:
        """Write ``bufs`` to ``final``'s ``.tmp``, then rename it over ``final`` (fsync policy)."""
        shard = final.parent
        if shard not in self._shards:
            shard.mkdir(parents=True, exist_ok=True)
            self._shards.add(shard)  # a set add is atomic under the GIL
        tmp = final.with_name(final.name + ".tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o644)
        try:
            _write_all(fd, bufs, sum(b.nbytes for b in bufs))
            if self.fsync != "never":
                os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, final)
        if self.fsync == "always":
            self._sync_dir(shard)

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
        Keys that follow each other in consecutive slots of one pack are read
        with one request.
        """
        runs: list[_Run] = []
        missing: list[bytes] = []
        count = 0
        with self._lock:
            self._check_open()
            last: _Entry | None = None
            for key, dest in zip(keys, dests, strict=True):
                entry = self._index.get(key)
                if entry is None or entry.state != _READY:
                    missing.append(key)
                    last = None
                    continue
                entry.readers += 1  # pinned: eviction skips it until the read ends
                pack = entry.pack
                if pack is not None:
                    pack.pins += 1
                self.policy.touched(key)
                count += 1
                if (
                    pack is not None
                    and last is not None
                    and last.pack is pack
                    and last.slot + 1 == entry.slot
                    and len(runs[-1][2]) < self._read_slots
                ):
                    runs[-1][2].append((key, dest))
                else:
                    runs.append((pack, entry.slot, [(key, dest)]))
                last = entry
            self._counts["misses"] += len(missing)
            if runs:
                self._loads_active += 1
        gone = set(missing)
        for key, dest in zip(keys, dests, strict=True):
            if key in gone:
                _zero(dest)
        batches = _split(runs, self.queue_depth) if runs else []
        job = _Job(max(1, len(batches)), self._load_done(keys, done, active=bool(runs)))
        job.missing += missing
        if not runs:
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

    def _read_batch(self, job: _Job, batch: list[_Run], direct: bool, scratch: mmap.mmap) -> None:
        nbytes = 0
        bad: list[tuple[bytes, BaseException]] = []
        try:
            for pack, slot, items in batch:
                try:
                    if pack is None:
                        [(key, dest)] = items
                        self._read_one(key, dest, direct, scratch)
                        failed = []
                    else:
                        failed = self._read_run(pack, slot, items, direct, scratch)
                except (OSError, TrailerError) as exc:
                    failed = [(key, exc) for key, _ in items]
                wrong = {key for key, _ in failed}
                for key, dest in items:
                    if key in wrong:
                        _zero(dest)
                    else:
                        nbytes += dest.nbytes
                bad += failed
        finally:
            with self._lock:
                for run_pack, _slot, items in batch:
                    for key, _dest in items:
                        entry = self._index.get(key)
                        if entry is not None:
                            entry.readers -= 1
                    if run_pack is not None:
                        run_pack.pins -= len(items)
                self._counts["hits"] += sum(len(r[2]) for r in batch) - len(bad)
                self._counts["misses"] += len(bad)
                corrupt: list[bytes | _Pack] = []
                for key, err in bad:
                    if isinstance(err, TrailerError):
                        self._counts["corrupt"] += 1
                    elif not isinstance(err, FileNotFoundError):
                        continue  # an I/O error says nothing about the file: keep it
                    entry = self._index.get(key)
                    if entry is None or entry.state != _READY or entry.readers:
                        continue
                    # unverifiable: never served again
                    if self._forget_locked(key, entry) is not None:
                        corrupt.append(key if entry.pack is None else entry.pack)
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

    def _read_run(
        self,
        pack: _Pack,
        slot: int,
        items: list[tuple[bytes, memoryview]],
        direct: bool,
        scratch: mmap.mmap,
    ) -> list[tuple[bytes, BaseException]]:
        """Read consecutive slots of ``pack`` with one ``preadv``; verify each object
        alone. Returns the objects that failed verification."""
        tb = self._tail_bytes
        mem = memoryview(scratch)
        tails = [mem[i * tb : (i + 1) * tb] for i in range(len(items))]
        try:
            bufs: list[memoryview] = []
            for (_key, dest), tail in zip(items, tails, strict=True):
                bufs += [dest, tail]
            flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
            fd = os.open(pack.path, flags)
            try:
                n = _preadv(fd, bufs, pack.first + slot * pack.slot)
            finally:
                os.close(fd)
            bad: list[tuple[bytes, BaseException]] = []
            for i, ((key, dest), tail) in enumerate(zip(items, tails, strict=True)):
                try:
                    if n < (i + 1) * pack.slot:
                        raise TrailerError(
                            "truncated", f"{pack.path.name}: slot {slot + i} is cut short"
                        )
                    Trailer.decode(bytes(tail), key=key, length=dest.nbytes).verify(dest)
                except TrailerError as exc:
                    bad.append((key, exc))
            return bad
        finally:
            for t in tails:
                t.release()
            mem.release()

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


def _hex_stem(name: str, suffix: str) -> int | None:
    """The number a ``<hex><suffix>`` file name carries, or ``None``."""
    if not name.endswith(suffix):
        return None
    try:
        return int(name[: -len(suffix)], 16)
    except ValueError:
        return None


def _read_header(fd: int, at: int) -> _pack.PackHeader:
    """The pack or record header at ``at``: one ``pread``, two if it is longer than a page."""
    raw = os.pread(fd, PAGE, at)
    need = _pack.PackHeader.needed(raw)
    if need > len(raw):
        raw = os.pread(fd, need, at)
    return _pack.PackHeader.decode(raw)


def _split(items: list[_T], parts: int) -> list[list[_T]]:
    """``items`` in at most ``parts`` contiguous batches of near-equal size."""
    if not items:
        return []
    step = math.ceil(len(items) / min(parts, len(items)))
    return [items[i : i + step] for i in range(0, len(items), step)]


def _zero(view: memoryview) -> None:
    view[:] = bytes(view.nbytes)
