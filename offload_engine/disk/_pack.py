"""The pack file and the segment record of the disk tier: several objects written
with one request.

A pack is ``header || slot 0 || slot 1 || ...``. The header names the keys in
slot order, so a restart indexes a pack with one read of its header, never of
its payloads. Each slot is ``payload || trailer`` (the object format of a
single-object file, :class:`~offload_engine.keyed.Trailer`), padded so every
slot starts on a page: each object is verified alone, and a bad one is a miss
alone.

Header (little-endian)::

    magic "OEPK" | pack version u16 | count u16 | slot bytes u32 | keys bytes u32 |
    xxh3-64 of the header with this field zero, and the keys area | keys area

The keys area is ``count`` times ``key length u8 | key``; the header is
zero-padded to whole pages.

A **segment record** (the same ``header || slots``, at an offset inside a
segment file) has magic "OESR" and one more field, the segment's generation
(u64), after ``keys bytes``. A segment file starts with a one-page
:class:`SegmentHead`: magic "OESG" | version u16 | pad u16 | segment bytes u64 |
generation u64 | xxh3-64 of the fields before it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from offload_engine.errors import TrailerError
from offload_engine.vocabulary import MAX_KEY_BYTES

PACK_VERSION = 1
MAX_PACK_SLOTS = 255
"""At most this many objects per pack (a pack write is one ``pwritev`` of
``1 + 2 * slots`` buffers, well under the kernel's 1024)."""

_MAGIC = b"OEPK"
_HEAD = struct.Struct("<4sHHIIQ")
_REC_MAGIC = b"OESR"
_REC_HEAD = struct.Struct("<4sHHIIQQ")
_SEG_MAGIC = b"OESG"
_SEG_HEAD = struct.Struct("<4sHHQQ")
SEGMENT_VERSION = 1


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def slot_bytes(payload_bytes: int, page: int) -> int:
    """Bytes of one slot: the payload, its page of trailer, padding to a page."""
    return _round_up(payload_bytes + page, page)


def header_bytes(keys: list[bytes], page: int, *, record: bool = False) -> int:
    """Bytes of a pack's header (``record``: a segment record's, 8 bytes longer
    before padding) naming ``keys``, padded to whole pages."""
    head = _REC_HEAD if record else _HEAD
    return _round_up(head.size + sum(1 + len(k) for k in keys), page)


def max_header_bytes(slots: int, page: int) -> int:
    return _round_up(_REC_HEAD.size + slots * (1 + MAX_KEY_BYTES), page)


def _struct(generation: int | None) -> tuple[bytes, struct.Struct]:
    return (_MAGIC, _HEAD) if generation is None else (_REC_MAGIC, _REC_HEAD)


@dataclass(frozen=True)
class PackHeader:
    """A pack's header (``generation`` ``None``) or a segment record's."""

    keys: tuple[bytes, ...]
    slot_bytes: int
    generation: int | None = None

    def size(self, page: int) -> int:
        return header_bytes(list(self.keys), page, record=self.generation is not None)

    def file_bytes(self, page: int) -> int:
        return self.size(page) + len(self.keys) * self.slot_bytes

    def encode(self, page: int) -> bytes:
        area = b"".join(len(k).to_bytes(1, "little") + k for k in self.keys)
        magic, head = _struct(self.generation)
        fields: tuple[object, ...] = (
            magic,
            PACK_VERSION,
            len(self.keys),
            self.slot_bytes,
            len(area),
        )
        if self.generation is not None:
            fields += (self.generation,)
        digest = xxhash.xxh3_64_intdigest(head.pack(*fields, 0) + area)
        raw = head.pack(*fields, digest) + area
        return raw + bytes(self.size(page) - len(raw))

    @staticmethod
    def needed(first: bytes | memoryview) -> int:
        """How many header bytes to read, given (at least) its first ``_HEAD.size`` bytes."""
        view = memoryview(first)
        if view.nbytes < _REC_HEAD.size:
            raise TrailerError("truncated", f"pack header of {view.nbytes} bytes is truncated")
        magic = bytes(view[:4])
        if magic == _MAGIC:
            head = _HEAD
        elif magic == _REC_MAGIC:
            head = _REC_HEAD
        else:
            raise TrailerError("magic", f"no pack or record header (magic {magic!r})")
        keys_len = head.unpack_from(view)[4]
        return head.size + int(keys_len)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> PackHeader:
        """Parse and check a header; :class:`TrailerError` if it is not a whole, valid one."""
        view = memoryview(data)
        need = cls.needed(view)
        if view.nbytes < need:
            raise TrailerError("truncated", f"pack header needs {need} bytes, has {view.nbytes}")
        generation: int | None = None
        if bytes(view[:4]) == _MAGIC:
            magic, version, count, slot, keys_len, digest = _HEAD.unpack_from(view)
            fields: tuple[object, ...] = (magic, version, count, slot, keys_len)
            head = _HEAD
        else:
            magic, version, count, slot, keys_len, generation, digest = _REC_HEAD.unpack_from(view)
            fields = (magic, version, count, slot, keys_len, generation)
            head = _REC_HEAD
        if version != PACK_VERSION:
            raise TrailerError("version", f"pack format {version}, this code reads {PACK_VERSION}")
        area = bytes(view[head.size : need])
        if xxhash.xxh3_64_intdigest(head.pack(*fields, 0) + area) != digest:
            raise TrailerError("checksum", "pack header checksum mismatch")
        keys: list[bytes] = []
        at = 0
        for _ in range(count):
            n = area[at] if at < len(area) else 0
            key = area[at + 1 : at + 1 + n]
            if not 0 < n <= MAX_KEY_BYTES or len(key) != n:
                raise TrailerError("key", "pack header holds a malformed key")
            keys.append(key)
            at += 1 + n
        if at != len(area) or len(set(keys)) != len(keys):
            raise TrailerError("key", "pack header's keys area is malformed")
        return cls(tuple(keys), int(slot), None if generation is None else int(generation))


@dataclass(frozen=True)
class SegmentHead:
    """The first page of a segment file: its size and the generation of its current use."""

    segment_bytes: int
    generation: int

    def encode(self, page: int) -> bytes:
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
