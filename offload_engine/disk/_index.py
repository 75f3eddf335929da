"""What the disk tier holds: its segments, the records in them, and the key index,
with the accounting and eviction they share, and their rebuild at restart.

Every method named ``*_locked`` runs under :attr:`Index.lock`; the I/O threads
change an entry's state only under it, so a reader of the index never sees a
record half-accounted.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

from offload_engine.disk._record import PAGE, SegmentHead, header_bytes, read_header
from offload_engine.disk.policy import EvictionPolicy
from offload_engine.errors import TrailerError

READY, WRITING = 0, 1

COUNTS = (
    "stored", "already_stored", "store_failures", "hits", "misses",
    "corrupt", "evictions", "recovered", "removed_at_start",
)  # fmt: skip


class Record:
    """One record in a segment: its objects' keys in slot order and how many are
    still indexed. ``pins`` counts loads in flight of its objects; ``writing`` is
    true until its header is on disk."""

    __slots__ = ("base", "first", "keys", "live", "pins", "seg", "size", "slot", "writing")

    def __init__(
        self, seg: Segment, keys: list[bytes], base: int, first: int, slot: int, size: int
    ) -> None:
        self.seg = seg
        self.keys = keys
        self.base = base  # where its header starts in the segment file
        self.first = first  # the file offset of slot 0 (after the header)
        self.slot = slot
        self.size = size
        self.live = len(keys)
        self.pins = 0
        self.writing = True

    @property
    def path(self) -> Path:
        return self.seg.path


class Segment:
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
        self.records: list[Record] = []
        self.live = 0  # indexed objects (stored or being written)
        self.writing = 0  # records being written
        self.prep = threading.Lock()
        # records that failed before the head of their generation was written:
        # (base, bytes, generation), marked as holes once it is
        self.holes: list[tuple[int, int, int]] = []


class Entry:
    __slots__ = ("readers", "record", "slot", "state")

    def __init__(self, state: int, record: Record, slot: int) -> None:
        self.state = state
        self.readers = 0
        self.record = record
        self.slot = slot


class Index:
    """The keys, records and segments of one store directory, and their bytes."""

    def __init__(
        self,
        root: Path,
        *,
        segment_bytes: int,
        slot_bytes: int,
        capacity_bytes: int,
        policy: EvictionPolicy,
    ) -> None:
        self.root = root  # the directory's segments/
        self.segment_bytes = segment_bytes
        self.slot_bytes = slot_bytes
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.lock = threading.Lock()
        # loads go first: a store thread waits on this while any load is in flight
        self.loads_idle = threading.Condition(self.lock)
        self.loads_active = 0
        self.entries: dict[bytes, Entry] = {}
        self.segments: dict[int, Segment] = {}
        self.free: list[Segment] = []  # emptied segments, reused before new ones
        self.active: Segment | None = None  # where new records go
        self.used = 0
        self.counts = dict.fromkeys(COUNTS, 0)

    def segment_file(self, number: int) -> Path:
        return self.root / f"{number:08x}.seg"

    # ------------------------------------------------------------ dropping

    def forget_locked(self, key: bytes, entry: Entry) -> None:
        """Drop ``key`` from the index; its segment is reused once it holds no object."""
        del self.entries[key]
        self.policy.removed(key)
        record = entry.record
        record.live -= 1
        record.seg.live -= 1
        self.release_if_empty_locked(record.seg)

    def release_if_empty_locked(self, seg: Segment) -> None:
        """Put ``seg`` on the free list once nothing in it is indexed or written."""
        if seg.live or seg.writing or seg is self.active or not seg.generation:
            return
        seg.generation = 0
        seg.records = []
        self.free.append(seg)

    def _drop_record_locked(self, record: Record) -> None:
        """Drop every object of ``record`` still indexed (counted as evictions)."""
        entries = self.entries
        for k in record.keys:
            e = entries.get(k)
            if e is not None and e.record is record:
                del entries[k]
                self.policy.removed(k)
                self.counts["evictions"] += 1
        record.live = 0

    def evict_segment_locked(self) -> Segment | None:
        """Empty the segment of the policy's first victim whose segment is idle (no
        record read or written, not the one being appended to); ``None`` if none is."""
        entries = self.entries
        for key in self.policy.victims():
            entry = entries.get(key)
            if entry is None or entry.state != READY:
                continue
            seg = entry.record.seg
            if seg is self.active or seg.writing or any(r.pins for r in seg.records):
                continue
            for record in seg.records:
                self._drop_record_locked(record)
            seg.live = 0
            seg.generation = 0
            seg.records = []
            return seg
        return None

    # ------------------------------------------------------------ placing records

    def _next_segment_locked(self) -> Segment | None:
        """A segment for new records: a free one, a new one if the cap allows one
        more, or an evicted one; ``None`` if none can be had."""
        if self.free:
            return self.free.pop()
        if (len(self.segments) + 1) * self.segment_bytes <= self.capacity_bytes:
            number = next(i for i in range(len(self.segments) + 1) if i not in self.segments)
            seg = Segment(number, self.segment_file(number), fresh=True)
            self.segments[number] = seg
            self.used += self.segment_bytes
            return seg
        return self.evict_segment_locked()

    def _reserve_locked(self, size: int) -> tuple[Segment, int] | None:
        """Room for a record of ``size`` bytes: (segment, offset), opening another
        segment when the active one is full; ``None`` if none can be had."""
        seg = self.active
        if seg is None or seg.cursor + size > self.segment_bytes:
            self.active = None
            if seg is not None:
                self.release_if_empty_locked(seg)
            seg = self._next_segment_locked()
            if seg is None:
                return None
            seg.generation = secrets.randbits(64) | 1  # never 0, never a likely earlier one
            seg.cursor = PAGE
            self.active = seg
        at = seg.cursor
        seg.cursor += size
        seg.writing += 1
        return seg, at

    def fit_active_locked(self, keys: list[bytes]) -> list[bytes]:
        """The longest head of ``keys`` whose record fits the rest of the active
        segment; all of them if none fits (the record then opens another segment)."""
        seg = self.active
        if seg is None:
            return keys
        rest = self.segment_bytes - seg.cursor
        for k in range(len(keys), 0, -1):
            if header_bytes(keys[:k]) + k * self.slot_bytes <= rest:
                return keys[:k]
        return keys

    def add_record_locked(self, keys: list[bytes]) -> Record | None:
        """Place a record of ``keys`` and index them as being written; ``None`` if
        the cap leaves no room for it."""
        first = header_bytes(keys)
        size = first + len(keys) * self.slot_bytes
        room = self._reserve_locked(size)
        if room is None:
            return None
        seg, at = room
        record = Record(seg, keys, at, at + first, self.slot_bytes, size)
        seg.records.append(record)
        seg.live += len(keys)
        for slot, key in enumerate(keys):
            self.entries[key] = Entry(WRITING, record, slot)
            self.policy.inserted(key)  # in job order; eviction skips it while writing
        return record

    def record_written_locked(self, record: Record) -> None:
        """``record``'s header is on disk: its objects are loadable."""
        for key in record.keys:
            entry = self.entries.get(key)
            if entry is not None and entry.record is record:
                entry.state = READY
        record.writing = False
        record.seg.writing -= 1
        self.release_if_empty_locked(record.seg)
        self.counts["stored"] += len(record.keys)

    def record_failed_locked(self, record: Record) -> None:
        """``record`` was not written: its bytes stay in the segment, never indexed."""
        for key in record.keys:
            entry = self.entries.get(key)
            if entry is not None and entry.record is record:
                del self.entries[key]
                self.policy.removed(key)
        seg = record.seg
        seg.live -= record.live
        record.live = 0
        seg.writing -= 1
        self.release_if_empty_locked(seg)
        self.counts["store_failures"] += len(record.keys)

    # ------------------------------------------------------------ restart

    def rebuild(self) -> None:
        """Index every segment's records by walking their headers from page 1 (no
        payload is read): a record counts if its header is whole and carries the
        generation of the segment's head; the walk stops at the first that does
        not (never written, torn, or left from an earlier use). Every segment that
        holds records is closed to new ones (it is reused once emptied); one that
        holds none is free."""
        found: list[tuple[float, int, int, Record]] = []
        removed = 0
        names = sorted(os.listdir(self.root)) if self.root.is_dir() else []
        for name in names:
            file = self.root / name
            seg = self._open_segment(file, name)
            if seg is None:
                file.unlink(missing_ok=True)  # not ours, or preallocation never finished
                removed += 1
                continue
            mtime = file.stat().st_mtime
            found += [(mtime, seg.number, r.base, r) for r in self._walk(seg)]
            if not seg.records:
                self.free.append(seg)
            else:
                # closed: appending after a torn record could revive stale ones
                seg.cursor = self.segment_bytes
        found.sort(key=lambda f: f[:3])  # oldest first; a later copy wins
        for *_, record in found:
            for slot, key in enumerate(record.keys):
                old = self.entries.get(key)
                if old is not None:
                    self.forget_locked(key, old)
                    removed += 1
                self.entries[key] = Entry(READY, record, slot)
                self.policy.inserted(key)
        self.counts["recovered"] = len(self.entries)
        self.counts["removed_at_start"] = removed
        self._shrink_to_cap()

    def _open_segment(self, file: Path, name: str) -> Segment | None:
        number = _hex_stem(name, ".seg")
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            return None
        if number is None or size != self.segment_bytes or file != self.segment_file(number):
            return None
        seg = Segment(number, file, fresh=False)
        self.segments[number] = seg
        self.used += self.segment_bytes
        return seg

    def _shrink_to_cap(self) -> None:
        """Delete segments (free ones first) until the cap, which may have shrunk
        since the directory was written, holds the rest."""
        while self.used > self.capacity_bytes:
            gone = self.free.pop() if self.free else self.evict_segment_locked()
            if gone is None:
                break
            del self.segments[gone.number]
            self.used -= self.segment_bytes
            gone.path.unlink(missing_ok=True)

    def _walk(self, seg: Segment) -> list[Record]:
        """The whole records of ``seg``'s current use (sets its generation)."""
        try:
            fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            try:
                head = SegmentHead.decode(os.pread(fd, PAGE, 0))
            except (OSError, TrailerError):
                return []
            if head.segment_bytes != self.segment_bytes:
                return []
            seg.generation = seg.ready = head.generation
            self._walk_records(fd, seg)
            return seg.records
        finally:
            os.close(fd)

    def _walk_records(self, fd: int, seg: Segment) -> None:
        at = PAGE
        sb = self.segment_bytes
        while at + PAGE <= sb:
            try:
                header = read_header(fd, at)
            except (OSError, TrailerError):
                return
            size = header.record_bytes()
            if not header.keys:  # a hole left by a failed record: step over it
                size += header.slot_bytes
            if header.generation != seg.generation or at + size > sb:
                return
            if header.keys:
                if header.slot_bytes != self.slot_bytes:
                    return
                first = at + header.size()
                record = Record(seg, list(header.keys), at, first, self.slot_bytes, size)
                record.writing = False
                seg.records.append(record)
                seg.live += len(record.keys)
            at += size


def _hex_stem(name: str, suffix: str) -> int | None:
    """The number a ``<hex><suffix>`` file name carries, or ``None``."""
    if not name.endswith(suffix):
        return None
    try:
        return int(name[: -len(suffix)], 16)
    except ValueError:
        return None
