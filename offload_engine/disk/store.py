"""The local-disk store behind the ``CPU <-> DISK`` handlers: records of
checksummed objects appended to preallocated, recycled segment files.

Directory layout (``path`` must exist and be writable)::

    path/config.json           the LayoutDigest and the segment size
    path/lock                  flock-ed by the one DiskStore that owns the directory
    path/segments/<n>.seg      head page || record || record ...

The pieces, one module each: the record and segment format
(:mod:`._record`), the directory and segment geometry (:mod:`._layout`), the
index with its accounting, eviction and restart (:mod:`._index`), the I/O pools
(:mod:`._io`), the store path (:mod:`._write`) and the load path
(:mod:`._read`). ``docs/disk.md`` describes the format and its guarantees.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from offload_engine._checks import check_int
from offload_engine.disk._depth import DiskDepth, derive_queue_depth
from offload_engine.disk._index import READY, Index
from offload_engine.disk._io import Pool, probe_direct
from offload_engine.disk._layout import (
    ON_FOREIGN_LAYOUT,
    SEGMENT_BYTES,
    Geometry,
    OnForeignLayout,
    lock_directory,
    open_config,
)
from offload_engine.disk._read import Reader
from offload_engine.disk._record import PAGE, max_header_bytes
from offload_engine.disk._write import FsyncPolicy, Writer
from offload_engine.disk.policy import EvictionPolicy, LRUPolicy
from offload_engine.errors import ConfigError, EngineClosedError, TierUnavailableError
from offload_engine.keyed import LayoutDigest
from offload_engine.vocabulary import as_keys

__all__ = [
    "MAX_QUEUE_DEPTH",
    "PACK_BYTES",
    "PAGE",
    "SEGMENT_BYTES",
    "DiskStore",
    "DiskStoreStats",
    "FsyncPolicy",
    "OnForeignLayout",
]

log = logging.getLogger("offload_engine.disk")

MAX_QUEUE_DEPTH = 256
"""The most I/O threads per direction a store starts (``queue_depth``): far more
requests than a drive's queue overlaps, well under what a process may start."""

PACK_BYTES = 2**20
"""The least bytes of objects one record holds, and the most one read request
covers (``DiskStore(pack_bytes=)``)."""


@dataclass(frozen=True)
class DiskStoreStats:
    """Counters of one :class:`DiskStore` since it opened (``objects``/``used_bytes``: now)."""

    objects: int
    used_bytes: int
    capacity_bytes: int
    direct: bool
    queue_depth: int  # I/O threads per direction
    queue_depth_from: str  # how queue_depth was chosen (DiskStore.depth)
    stored: int  # objects written and published
    already_stored: int  # store requests for keys present or being written
    store_failures: int  # objects that failed to store (full, I/O error)
    hits: int  # objects loaded and verified
    misses: int  # load requests for absent keys
    corrupt: int  # objects that failed verification (each also a miss)
    evictions: int
    recovered: int  # objects found at start
    removed_at_start: int  # malformed segment files deleted, stale copies dropped at start


class DiskStore:
    """Objects of ``digest.page_bytes`` payload bytes under ``path``, in records
    appended to preallocated segment files of ``segment_bytes``.

    ``segment_bytes``: ``None`` (default) follows the directory, and gives a new
    one segments of a 16th of ``capacity_bytes`` (at most :data:`SEGMENT_BYTES`,
    at least what one object needs); ``N`` (a multiple of 4096) asks for segments
    of ``N`` bytes, and a directory written with another size raises
    :class:`LayoutMismatchError`. Segments are evicted and reused whole, so the
    cap counts whole segments (:meth:`capacity_for` sizes one).

    ``pack_bytes`` (``None``: :data:`PACK_BYTES`, 1 MiB): a record holds at
    least this many bytes of objects (fewer only when the job stores fewer) and,
    for a job of many objects, one record per I/O thread; a read request covers
    consecutive slots up to this many bytes.

    ``on_foreign_layout``: what to do with a directory written in an older
    on-disk layout (a file per object, pack files): ``"error"`` (default) raises
    :class:`TierUnavailableError`; ``"wipe"`` deletes what that layout left and
    opens the directory as a new one.

    ``direct``: ``None`` probes O_DIRECT, ``False`` forces buffered I/O, ``True``
    requires O_DIRECT (:class:`TierUnavailableError` if the probe fails).
    ``queue_depth`` is the number of I/O threads per direction (requests in
    flight at once, 1 to :data:`MAX_QUEUE_DEPTH`). ``None`` (default) derives it
    from the block device that holds ``path``, as sysfs describes it: 4 for a
    spinning disk; for a solid-state device 8 per hardware queue, at most two
    per usable CPU and the queue's ``nr_requests``, within 4 to 32; 4 when no
    block device can be read (tmpfs, overlay, network filesystems). ``depth``
    (and ``stats().queue_depth_from``, and the repr) say what was chosen and
    why. Close it (``close()`` or ``with``) after the engine that
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
        queue_depth: int | None = None,
        policy: EvictionPolicy | None = None,
        pack_bytes: int | None = None,
        segment_bytes: int | None = None,
        on_foreign_layout: OnForeignLayout = "error",
    ) -> None:
        self._closed = True  # until the pools run
        pack_bytes = self._check_options(
            digest, capacity_bytes, queue_depth, pack_bytes, segment_bytes, fsync, direct,
            on_foreign_layout,
        )  # fmt: skip
        self.path = Path(path)
        self.digest = digest
        self.capacity_bytes = capacity_bytes
        self.fsync: FsyncPolicy = fsync
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.payload_bytes = digest.page_bytes
        self.pack_bytes = pack_bytes
        self._lock_fd = lock_directory(self.path)
        try:
            self.depth = (
                derive_queue_depth(self.path)
                if queue_depth is None
                else DiskDepth(queue_depth, "explicit", None, f"queue_depth={queue_depth}")
            )
            self.queue_depth = self.depth.depth
            self.segment_bytes = open_config(
                self.path,
                digest,
                segment_bytes=segment_bytes,
                capacity_bytes=capacity_bytes,
                on_foreign_layout=on_foreign_layout,
            )
            geometry = Geometry(self.payload_bytes, self.segment_bytes)
            geometry.check(capacity_bytes)
            self.direct = self._probe(direct)
            self._index = Index(
                self.path / "segments",
                segment_bytes=self.segment_bytes,
                slot_bytes=geometry.slot_bytes,
                capacity_bytes=capacity_bytes,
                policy=self.policy,
            )
            self._index.rebuild()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._start_io(geometry)

    @staticmethod
    def _check_options(
        digest: object,
        capacity_bytes: int,
        queue_depth: int | None,
        pack_bytes: int | None,
        segment_bytes: int | None,
        fsync: object,
        direct: object,
        on_foreign_layout: object,
    ) -> int:
        """Type-check the options (:class:`ConfigError`); ``pack_bytes`` resolved."""
        if not isinstance(digest, LayoutDigest):
            raise ConfigError(f"DiskStore takes a LayoutDigest, got {type(digest).__name__}")
        check_int(capacity_bytes, "DiskStore capacity_bytes")
        if queue_depth is not None:
            check_int(queue_depth, "DiskStore queue_depth", maximum=MAX_QUEUE_DEPTH)
        pack_bytes = PACK_BYTES if pack_bytes is None else pack_bytes
        check_int(pack_bytes, "DiskStore pack_bytes", minimum=0)
        if segment_bytes is not None:
            check_int(segment_bytes, "DiskStore segment_bytes")
            # a bad size fails before the directory is touched
            Geometry(digest.page_bytes, segment_bytes).check(capacity_bytes)
        if fsync not in ("never", "data", "always"):
            raise ConfigError(f"DiskStore fsync must be never|data|always, got {fsync!r}")
        if direct not in (None, True, False):
            raise ConfigError(f"DiskStore direct must be None, True or False, got {direct!r}")
        if on_foreign_layout not in ON_FOREIGN_LAYOUT:
            raise ConfigError(
                f"DiskStore on_foreign_layout must be error|wipe, got {on_foreign_layout!r}"
            )
        return pack_bytes

    def _probe(self, direct: bool | None) -> bool:
        """Whether objects can go with O_DIRECT here (``direct=True``: must)."""
        probed = probe_direct(self.path) if direct is not False else False
        if direct and not probed:
            raise TierUnavailableError(f"O_DIRECT was required but does not work in {self.path}")
        # O_DIRECT also needs whole pages; the host memory is checked per handler
        whole = self.payload_bytes % PAGE == 0
        if probed and not whole:
            log.warning(
                "objects of %d bytes are not whole pages; %s uses buffered I/O",
                self.payload_bytes,
                self.path,
            )
        return probed and whole

    def _start_io(self, geometry: Geometry) -> None:
        slot = geometry.slot_bytes
        tail = slot - self.payload_bytes
        per_pack = -(-self.pack_bytes // slot)
        record_max = geometry.record_max
        # a read request stops growing at pack_bytes: at about 1 MiB a request keeps
        # the drive streaming, and a longer one ties up one I/O thread for what
        # several threads' requests would overlap on the drive
        read_slots = min(record_max, max(1, per_pack))
        trailers = max(PAGE, record_max * tail)
        self._readers = Pool(self.queue_depth, "offload-engine-disk-read", trailers)
        self._writers = Pool(
            self.queue_depth,
            "offload-engine-disk-write",
            max_header_bytes(record_max) + trailers,
        )
        self._writer = Writer(
            self._index,
            self._writers,
            fsync=self.fsync,
            queue_depth=self.queue_depth,
            record_min=max(1, per_pack),
            record_max=record_max,
            tail_bytes=tail,
            check_open=self._check_open,
        )
        self._reader = Reader(
            self._index,
            self._readers,
            queue_depth=self.queue_depth,
            read_slots=read_slots,
            tail_bytes=tail,
            check_open=self._check_open,
        )
        self._closed = False

    @staticmethod
    def capacity_for(
        objects: int, payload_bytes: int, *, segment_bytes: int = SEGMENT_BYTES
    ) -> int:
        """The smallest ``capacity_bytes`` that holds ``objects`` objects of
        ``payload_bytes`` at once in segments of ``segment_bytes``, however store
        jobs group them into records (whole segments: each object costs its slot
        and at most a header page, and a segment's rest too small for one more
        object stays empty)."""
        check_int(objects, "objects", minimum=0)
        check_int(payload_bytes, "payload_bytes")
        check_int(segment_bytes, "segment_bytes")
        return Geometry(payload_bytes, segment_bytes).capacity_for(objects)

    # ------------------------------------------------------------ queries

    def location(self, key: bytes) -> tuple[Path, int, int] | None:
        """``(segment file, offset, length)`` of stored ``key``'s slot (payload and
        trailer), or ``None`` if it is not stored (or still being written)."""
        with self._index.lock:
            entry = self._index.entries.get(key)
            if entry is None or entry.state != READY:
                return None
            record = entry.record
            return record.path, record.first + entry.slot * record.slot, record.slot

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored (the longest stored prefix)."""
        keys = as_keys(keys)
        n = 0
        with self._index.lock:
            entries = self._index.entries
            for key in keys:
                entry = entries.get(key)
                if entry is None or entry.state != READY:
                    break
                n += 1
        return n

    def state(self, key: bytes) -> Literal["stored", "writing", "absent"]:
        """Whether ``key`` is stored, being written (ask again later), or absent."""
        with self._index.lock:
            entry = self._index.entries.get(key)
        if entry is None:
            return "absent"
        return "stored" if entry.state == READY else "writing"

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark stored ``keys`` as recently used."""
        with self._index.lock:
            for key in keys:
                self.policy.touched(bytes(key))

    def stats(self) -> DiskStoreStats:
        index = self._index
        with index.lock:
            return DiskStoreStats(
                objects=sum(1 for e in index.entries.values() if e.state == READY),
                used_bytes=index.used,
                capacity_bytes=self.capacity_bytes,
                direct=self.direct,
                queue_depth=self.queue_depth,
                queue_depth_from=str(self.depth),
                **index.counts,
            )

    # ------------------------------------------------------------ transfers

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
        The job's new objects go in job order into records, one write request each.
        """
        self._writer.start(keys, payloads, direct, done)

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
        Keys that follow each other in consecutive slots of one record are read
        with one request.
        """
        self._reader.start(keys, dests, direct, done)

    # ------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"the disk store at {self.path} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish queued I/O, stop the threads, release the directory. Idempotent."""
        if not hasattr(self, "_reader"):
            return
        with self._index.lock:
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
        if not getattr(self, "_closed", True):
            warnings.warn(
                f"DiskStore at {self.path} was never closed", ResourceWarning, stacklevel=2
            )

    def _depth_label(self) -> str:
        depth: DiskDepth | None = getattr(self, "depth", None)
        if depth is None:
            return "-"
        where = f" {depth.device}" if depth.device else ""
        return f"{depth.depth} ({depth.source}{where})"

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        if hasattr(self, "_index"):
            with self._index.lock:
                used, n = self._index.used, len(self._index.entries)
        else:
            used = n = 0
        return (
            f"<DiskStore {self.path} {state} objects={n} used={used}/{self.capacity_bytes} "
            f"direct={self.direct} queue_depth={self._depth_label()}>"
        )
