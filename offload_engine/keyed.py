"""What every keyed tier (local disk, remote store) shares: keys, trailers, layout digests.

A keyed tier names a block by ``bytes`` (:class:`~offload_engine.KeyedBlocks`),
and moves whole host-tier blocks: a store copies host-tier block ``b`` to key
``k``, a load copies key ``k`` into host-tier block ``b``. Three pieces are the
same for every such tier:

* **the job mapping** (:func:`map_keyed`): a ``TierBlocks(CPU) <-> KeyedBlocks``
  spec checked against the host tier and turned into (key, host block) pairs;
* **the object trailer** (:class:`Trailer`): every stored object is
  ``payload || trailer``, and the trailer names the format version, the key, the
  payload length and an xxh3-64 checksum. A load verifies all four; any mismatch is
  a miss (:class:`~offload_engine.TrailerError`), never data;
* **the layout digest** (:class:`LayoutDigest`): the model, dtype, block and
  chunk size, parallel rank, page bytes and format version that decide what the
  bytes mean. A tier refuses bytes written under another digest.

The checksum is xxh3-64 (the maintained ``xxhash`` package): it hashed 8 MiB
buffers at 22.6 GB/s on one core of the 2-core CI machine, where xxh64 (format
version 1) reached 5.3 GB/s in the same run and became the disk tier's write
bottleneck; it releases the GIL on large buffers, and its 64 bits make an
undetected corruption far less likely than a 32-bit CRC would.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import xxhash

from offload_engine._checks import check_int
from offload_engine.errors import (
    BlockCountMismatchError,
    ConfigError,
    InvalidBlockIdsError,
    InvalidTransferError,
    LayoutError,
    LayoutMismatchError,
    TrailerError,
)
from offload_engine.host import HostTier
from offload_engine.vocabulary import BlockIds, KeyedBlocks, Medium, TierBlocks, TransferSpec

__all__ = [
    "FORMAT_VERSION",
    "KeyedTransfer",
    "LayoutDigest",
    "Trailer",
    "checksum",
    "map_keyed",
]

FORMAT_VERSION = 2
"""The object format (trailer and payload layout) this code writes and reads.

1 checksummed with xxh64; 2 with xxh3-64. Objects of another version are misses."""

_MAGIC = b"OEKV"
# magic, format version, key length, flags (0), payload length, checksum
_HEAD = struct.Struct("<4sHHIQQ")


def checksum(payload: memoryview | bytes, key: bytes, length: int, version: int) -> int:
    """xxh3-64 over the payload, then the trailer's fields: a payload moved under
    another key, length or version does not verify."""
    h = xxhash.xxh3_64()
    h.update(payload)
    h.update(_HEAD.pack(_MAGIC, version, len(key), 0, length, 0))
    h.update(key)
    return int(h.intdigest())


@dataclass(frozen=True)
class Trailer:
    """The bytes after an object's payload: ``magic | version | key length | flags |
    payload length | checksum | key``, little-endian, then zero padding.

    ``size(key_len, align)`` is the trailer's length on the medium: a disk tier
    pads it to the page size so the whole object stays O_DIRECT-aligned; a
    remote tier uses ``align=1``.
    """

    key: bytes
    length: int
    checksum: int
    version: int = FORMAT_VERSION

    @staticmethod
    def size(key_len: int, align: int = 1) -> int:
        raw = _HEAD.size + key_len
        return -(-raw // align) * align

    @classmethod
    def for_payload(cls, key: bytes, payload: memoryview | bytes) -> Trailer:
        """The trailer of ``payload`` stored under ``key`` (hashes the payload)."""
        length = memoryview(payload).nbytes
        return cls(key, length, checksum(payload, key, length, FORMAT_VERSION))

    def encode(self, align: int = 1) -> bytes:
        raw = _HEAD.pack(_MAGIC, self.version, len(self.key), 0, self.length, self.checksum)
        raw += self.key
        return raw + bytes(self.size(len(self.key), align) - len(raw))

    @classmethod
    def decode(cls, data: memoryview | bytes, *, key: bytes, length: int) -> Trailer:
        """Parse a trailer that must name ``key`` and a ``length``-byte payload.

        Raises :class:`TrailerError` (``reason``: ``truncated``, ``magic``,
        ``version``, ``key`` or ``length``).
        """
        view = memoryview(data)
        if view.nbytes < _HEAD.size + len(key):
            raise TrailerError("truncated", f"trailer of {view.nbytes} bytes is truncated")
        magic, version, key_len, _flags, got_len, digest = _HEAD.unpack_from(view)
        if magic != _MAGIC:
            raise TrailerError("magic", f"no object trailer (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise TrailerError(
                "version", f"object format {version}, this code reads {FORMAT_VERSION}"
            )
        got_key = bytes(view[_HEAD.size : _HEAD.size + key_len])
        if got_key != key:
            raise TrailerError("key", f"object holds key {got_key.hex()}, expected {key.hex()}")
        if got_len != length:
            raise TrailerError("length", f"object holds {got_len} payload bytes, expected {length}")
        return cls(got_key, got_len, digest, version)

    def verify(self, payload: memoryview | bytes) -> None:
        """Check ``payload`` against this trailer; :class:`TrailerError` (``length``
        or ``checksum``) if it does not match."""
        n = memoryview(payload).nbytes
        if n != self.length:
            raise TrailerError("length", f"payload has {n} bytes, the trailer says {self.length}")
        if checksum(payload, self.key, self.length, self.version) != self.checksum:
            raise TrailerError("checksum", f"checksum mismatch for key {self.key.hex()}")


@dataclass(frozen=True)
class LayoutDigest:
    """What the stored bytes mean. Two writers share objects only if every field agrees.

    ``block_size`` is tokens per KV-cache block, ``chunk_blocks`` cache blocks per
    stored object (vLLM's ``blocks_per_chunk``), ``page_bytes`` the bytes of one
    stored object's payload. ``rank``/``world_size`` name the parallel layout
    (e.g. the TP x PP rank) whose shard of the KV cache the bytes hold.
    """

    model: str
    dtype: str
    block_size: int
    chunk_blocks: int
    page_bytes: int
    rank: int = 0
    world_size: int = 1
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("model", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"LayoutDigest {name} must be a non-empty str, got {value!r}")
        for name in ("block_size", "chunk_blocks", "page_bytes", "world_size", "format_version"):
            check_int(getattr(self, name), f"LayoutDigest {name}")
        check_int(self.rank, "LayoutDigest rank", minimum=0)
        if self.rank >= self.world_size:
            raise ConfigError(
                f"LayoutDigest rank {self.rank} is not below world_size {self.world_size}"
            )

    @property
    def hexdigest(self) -> str:
        """16 hex digits naming this layout (a stable hash of its canonical JSON)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> LayoutDigest:
        """Parse :meth:`to_json` output; :class:`LayoutMismatchError` if it is not one."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise LayoutMismatchError(f"layout digest is not JSON: {exc}") from exc
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise LayoutMismatchError(f"layout digest fields differ from {sorted(names)}: {data!r}")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise LayoutMismatchError(f"invalid layout digest: {exc}") from exc

    def check_same(self, other: LayoutDigest, *, where: str) -> None:
        """Raise :class:`LayoutMismatchError` naming the fields that differ."""
        if other == self:
            return
        diff = [
            f"{f.name}: {getattr(other, f.name)!r} != {getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(other, f.name) != getattr(self, f.name)
        ]
        raise LayoutMismatchError(
            f"{where} was written under another layout ({'; '.join(diff)}); it is never read"
        )


class KeyedTransfer(NamedTuple):
    """A keyed job mapped at submit: ``keys[i]`` pairs with host-tier block ``blocks[i]``.

    A named tuple (immutable, like a frozen dataclass): one is built in the
    submitting thread for every keyed job, and a tuple is the cheapest record."""

    store: bool  # host tier -> keyed tier
    medium: Medium
    keys: tuple[bytes, ...]
    blocks: BlockIds
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_bytes


def map_keyed(spec: TransferSpec, tier: HostTier, *, medium: Medium, who: str) -> KeyedTransfer:
    """Check that ``spec`` moves whole host-tier blocks to or from ``medium`` keys
    and pair each key with its block.

    A store is ``TierBlocks(CPU) -> KeyedBlocks(medium)``, a load the reverse. The
    counts must agree, the ids must lie in the tier, and a load may not write one
    host block twice. Raises :class:`InvalidTransferError` (and its subclasses)
    or, for a released tier, :class:`LayoutError`.
    """
    src, dst = spec.src, spec.dst
    if isinstance(src, TierBlocks) and isinstance(dst, KeyedBlocks):
        store, host, keyed = True, src, dst
    elif isinstance(src, KeyedBlocks) and isinstance(dst, TierBlocks):
        store, host, keyed = False, dst, src
    else:
        raise InvalidTransferError(
            f"{who} moves TierBlocks <-> KeyedBlocks, got "
            f"{type(src).__name__} -> {type(dst).__name__}"
        )
    if host.medium is not Medium.CPU or keyed.medium is not medium:
        raise InvalidTransferError(
            f"{who} moves CPU tier blocks <-> {medium.value} keys, got {spec.pair[0].value} -> "
            f"{spec.pair[1].value}"
        )
    if tier.released:
        raise LayoutError(f"{who}: the host tier has been released")
    # this runs in the submitting thread for every job: plain lists and attributes
    # (numpy's reductions and Python-level __len__ cost most of a cold submit of a
    # few ids; numpy's max wins above about 64, as in mapping.map_blocks)
    ids = host.block_ids
    listed = ids.tolist()
    keys = keyed.keys
    n = len(listed)
    if n != len(keys):
        raise BlockCountMismatchError(
            f"{who}: {n} host-tier blocks for {len(keys)} keys; a keyed tier moves "
            f"whole tier blocks, one per key"
        )
    if n:
        top = max(listed) if n <= 64 else int(ids.max())
        if top >= tier.num_blocks:
            raise InvalidBlockIdsError(
                f"{who}: host-tier block {top} is outside the tier's {tier.num_blocks} blocks"
            )
        if not store and len(set(listed)) != n:
            raise InvalidBlockIdsError(f"{who}: a load writes one host-tier block twice")
    return KeyedTransfer(store, medium, keys, ids, tier.factor * tier.slot_bytes)
