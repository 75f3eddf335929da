"""The on-disk format of the disk tier: a segment file's head page and the records
appended after it.

A segment file starts with a one-page :class:`SegmentHead`::

    magic "OESG" | version u16 | pad u16 | segment bytes u64 | generation u64 |
    xxh3-64 of the fields before it

A **record** is ``header || slot 0 || slot 1 || ...`` at an offset inside a
segment. The header names the keys in slot order, so a restart indexes a record
with one read of its header, never of its payloads. Each slot is
``payload || trailer`` (:class:`~offload_engine.keyed.Trailer`), padded so every
slot starts on a page: each object is verified alone, and a bad one is a miss
alone.

Record header (little-endian)::

    magic "OESR" | version u16 | count u16 | slot bytes u32 | keys bytes u32 |
    generation u64 | xxh3-64 of the header with this field zero, and the keys area |
    keys area

The keys area is ``count`` times ``key length u8 | key``; the header is
zero-padded to whole pages. A header with no keys marks a **hole**: the bytes of
a record that failed, which a restart steps over.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import xxhash

from offload_engine.errors import TrailerError
from offload_engine.vocabulary import MAX_KEY_BYTES

PAGE = 4096
"""Records and slots are laid out in units of this many bytes (the O_DIRECT alignment)."""

RECORD_VERSION = 1
MAX_RECORD_SLOTS = 255
"""At most this many objects per record (a record write is one ``pwritev`` of
``2 * slots`` buffers, well under the kernel's 1024)."""

_REC_MAGIC = b"OESR"
_REC_HEAD = struct.Struct("<4sHHIIQQ")
_SEG_MAGIC = b"OESG"
_SEG_HEAD = struct.Struct("<4sHHQQ")
SEGMENT_VERSION = 1


def round_up(n: int, page: int = PAGE) -> int:
    return -(-n // page) * page


def slot_bytes(payload_bytes: int, page: int = PAGE) -> int:
    """Bytes of one slot: the payload, its page of trailer, padding to a page."""
    return round_up(payload_bytes + page, page)


def header_bytes(keys: list[bytes], page: int = PAGE) -> int:
    """Bytes of a record header naming ``keys``, padded to whole pages."""
    return round_up(_REC_HEAD.size + sum(1 + len(k) for k in keys), page)


def max_header_bytes(slots: int, page: int = PAGE) -> int:
    """The longest header of ``slots`` keys (each of the longest length)."""
    return round_up(_REC_HEAD.size + slots * (1 + MAX_KEY_BYTES), page)


@dataclass(frozen=True)
class RecordHeader:
    """A record's header: its keys in slot order, its slot size, its segment's generation."""

    keys: tuple[bytes, ...]
    slot_bytes: int
    generation: int

    def size(self, page: int = PAGE) -> int:
        return header_bytes(list(self.keys), page)

    def record_bytes(self, page: int = PAGE) -> int:
        """The header and the slots: the record's bytes in its segment."""
        return self.size(page) + len(self.keys) * self.slot_bytes

    def encode(self, page: int = PAGE) -> bytes:
        area = b"".join(len(k).to_bytes(1, "little") + k for k in self.keys)
        fields = (
            _REC_MAGIC,
            RECORD_VERSION,
            len(self.keys),
            self.slot_bytes,
            len(area),
            self.generation,
        )
        digest = xxhash.xxh3_64_intdigest(_REC_HEAD.pack(*fields, 0) + area)
        raw = _REC_HEAD.pack(*fields, digest) + area
        return raw + bytes(self.size(page) - len(raw))

    @staticmethod
    def needed(first: bytes | memoryview) -> int:
        """How many header bytes to read, given (at least) its fixed fields."""
        view = memoryview(first)
        if view.nbytes < _REC_HEAD.size:
            raise TrailerError("truncated", f"record header of {view.nbytes} bytes is truncated")
        magic = bytes(view[:4])
        if magic != _REC_MAGIC:
            raise TrailerError("magic", f"no record header (magic {magic!r})")
        keys_len = _REC_HEAD.unpack_from(view)[4]
        return _REC_HEAD.size + int(keys_len)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> RecordHeader:
        """Parse and check a header; :class:`TrailerError` if it is not a whole, valid one."""
        view = memoryview(data)
        need = cls.needed(view)
        if view.nbytes < need:
            raise TrailerError("truncated", f"record header needs {need} bytes, has {view.nbytes}")
        magic, version, count, slot, keys_len, generation, digest = _REC_HEAD.unpack_from(view)
        if version != RECORD_VERSION:
            raise TrailerError(
                "version", f"record format {version}, this code reads {RECORD_VERSION}"
            )
        fields = (magic, version, count, slot, keys_len, generation)
        area = bytes(view[_REC_HEAD.size : need])
        if xxhash.xxh3_64_intdigest(_REC_HEAD.pack(*fields, 0) + area) != digest:
            raise TrailerError("checksum", "record header checksum mismatch")
        return cls(_parse_keys(area, count), int(slot), int(generation))


def _parse_keys(area: bytes, count: int) -> tuple[bytes, ...]:
    keys: list[bytes] = []
    at = 0
    for _ in range(count):
        n = area[at] if at < len(area) else 0
        key = area[at + 1 : at + 1 + n]
        if not 0 < n <= MAX_KEY_BYTES or len(key) != n:
            raise TrailerError("key", "record header holds a malformed key")
        keys.append(key)
        at += 1 + n
    if at != len(area) or len(set(keys)) != len(keys):
        raise TrailerError("key", "record header's keys area is malformed")
    return tuple(keys)


def read_header(fd: int, at: int) -> RecordHeader:
    """The record header at ``at``: one ``pread``, two if it is longer than a page."""
    raw = os.pread(fd, PAGE, at)
    need = RecordHeader.needed(raw)
    if need > len(raw):
        raw = os.pread(fd, need, at)
    return RecordHeader.decode(raw)


@dataclass(frozen=True)
class SegmentHead:
    """The first page of a segment file: its size and the generation of its current use."""

    segment_bytes: int
    generation: int

    def encode(self, page: int = PAGE) -> bytes:
        fields = (_SEG_MAGIC, SEGMENT_VERSION, 0, self.segment_bytes, self.generation)
        raw = _SEG_HEAD.pack(*fields)
        raw += xxhash.xxh3_64_intdigest(raw).to_bytes(8, "little")
        return raw + bytes(page - len(raw))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> SegmentHead:
        view = memoryview(data)
        end = _SEG_HEAD.size + 8
        if view.nbytes < end:
            raise TrailerError("truncated", "segment head is truncated")
        magic, version, _pad, size, generation = _SEG_HEAD.unpack_from(view)
        if magic != _SEG_MAGIC:
            raise TrailerError("magic", f"no segment head (magic {magic!r})")
        if version != SEGMENT_VERSION:
            raise TrailerError(
                "version", f"segment format {version}, this code reads {SEGMENT_VERSION}"
            )
        digest = int.from_bytes(view[_SEG_HEAD.size : end], "little")
        if xxhash.xxh3_64_intdigest(bytes(view[: _SEG_HEAD.size])) != digest:
            raise TrailerError("checksum", "segment head checksum mismatch")
        return cls(int(size), int(generation))
