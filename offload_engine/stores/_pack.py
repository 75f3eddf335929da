"""The pack file of the disk tier: several small objects written with one request.

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


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def slot_bytes(payload_bytes: int, page: int) -> int:
    """Bytes of one slot: the payload, its page of trailer, padding to a page."""
    return _round_up(payload_bytes + page, page)


def header_bytes(keys: list[bytes], page: int) -> int:
    return _round_up(_HEAD.size + sum(1 + len(k) for k in keys), page)


def max_header_bytes(slots: int, page: int) -> int:
    return _round_up(_HEAD.size + slots * (1 + MAX_KEY_BYTES), page)


@dataclass(frozen=True)
class PackHeader:
    keys: tuple[bytes, ...]
    slot_bytes: int

    def size(self, page: int) -> int:
        return header_bytes(list(self.keys), page)

    def file_bytes(self, page: int) -> int:
        return self.size(page) + len(self.keys) * self.slot_bytes

    def encode(self, page: int) -> bytes:
        area = b"".join(len(k).to_bytes(1, "little") + k for k in self.keys)
        fields = (_MAGIC, PACK_VERSION, len(self.keys), self.slot_bytes, len(area))
        digest = xxhash.xxh3_64_intdigest(_HEAD.pack(*fields, 0) + area)
        raw = _HEAD.pack(*fields, digest) + area
        return raw + bytes(self.size(page) - len(raw))

    @staticmethod
    def needed(first: bytes | memoryview) -> int:
        """How many header bytes to read, given (at least) its first ``_HEAD.size`` bytes."""
        view = memoryview(first)
        if view.nbytes < _HEAD.size:
            raise TrailerError("truncated", f"pack header of {view.nbytes} bytes is truncated")
        magic, _v, _n, _slot, keys_len, _d = _HEAD.unpack_from(view)
        if magic != _MAGIC:
            raise TrailerError("magic", f"no pack header (magic {magic!r})")
        return _HEAD.size + int(keys_len)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> PackHeader:
        """Parse and check a header; :class:`TrailerError` if it is not a whole, valid one."""
        view = memoryview(data)
        need = cls.needed(view)
        if view.nbytes < need:
            raise TrailerError("truncated", f"pack header needs {need} bytes, has {view.nbytes}")
        _m, version, count, slot, keys_len, digest = _HEAD.unpack_from(view)
        if version != PACK_VERSION:
            raise TrailerError("version", f"pack format {version}, this code reads {PACK_VERSION}")
        area = bytes(view[_HEAD.size : need])
        fields = (_MAGIC, version, count, slot, keys_len, 0)
        if xxhash.xxh3_64_intdigest(_HEAD.pack(*fields) + area) != digest:
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
        return cls(tuple(keys), int(slot))
