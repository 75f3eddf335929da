"""Value objects every layer shares: media, block specs, transfer specs, results.

A **medium** names the memory a block lives in. A transfer moves blocks between
two kinds of block store:

* the serving engine's own **KV cache** (:class:`CacheBlocks`), the cache the
  model computes on. It lives on a GPU, an NPU, or in host memory (vLLM's CPU
  backend). Its spec carries the KV-group structure and the logical index of
  each group's first block, which decides how a partial tier block is skipped.
* an **offload tier** (:class:`TierBlocks`): host memory. One tier block holds
  ``factor`` cache blocks (the block-size factor, vLLM's ``blocks_per_chunk``).
* a **keyed tier** (:class:`KeyedBlocks`): local disk or a remote store, where
  a block is named by a ``bytes`` key (vLLM's ``OffloadKey``: block hash plus
  group index), not by a slot index. Keyed tiers move whole host-tier blocks:
  a job pairs host-tier blocks (:class:`TierBlocks` on ``Medium.CPU``) with keys.

The engine routes a job by ``(src.medium, dst.medium)``; the handler for that
pair decides from the spec classes whether it is a store (cache -> tier) or a
load (tier -> cache).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from offload_engine.errors import InvalidBlockIdsError, InvalidKeyError, InvalidTransferError
from offload_engine.fence import JobFence

BlockIds: TypeAlias = npt.NDArray[np.int64]
BlockIdsLike: TypeAlias = "Sequence[int] | npt.NDArray[np.integer]"

_INT64_MAX = np.iinfo(np.int64).max
_FAST_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


class Medium(enum.Enum):
    """Where a block lives."""

    GPU = "GPU"
    NPU = "NPU"
    CPU = "CPU"
    DISK = "DISK"
    REMOTE = "REMOTE"

    def __str__(self) -> str:
        return self.value


class Direction(enum.Enum):
    """Which way a job moves bytes relative to the serving engine's KV cache."""

    STORE = "store"  # KV cache -> tier
    LOAD = "load"  # tier -> KV cache
    COPY = "copy"  # tier -> tier


def as_block_ids(values: object, *, what: str = "block_ids") -> BlockIds:
    """Validate ``values`` and return them as a read-only 1-D int64 array.

    Accepts a sequence of Python ints or an integer array (numpy, torch,
    ``array.array``, ``memoryview``). Refuses floats (even integral ones),
    bools, other dimensions and negative ids with :class:`InvalidBlockIdsError`.
    The result is always a copy: it never aliases the caller's memory, so a
    caller may rewrite its id buffer as soon as this returns.
    """
    if isinstance(values, np.ndarray):
        if values.ndim == 1 and values.dtype in _FAST_DTYPES:  # the common case, made cheap
            out = values.astype(np.int64)  # always a fresh array
            if out.size and out.min() < 0:
                raise InvalidBlockIdsError(f"{what} must be non-negative, got min {int(out.min())}")
            out.flags.writeable = False
            return out
        arr = values
        fresh = False
    else:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise InvalidBlockIdsError(
                f"{what} must be a sequence of ints or an integer numpy array, "
                f"got {type(values).__name__}"
            )
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError) as exc:
            raise InvalidBlockIdsError(f"{what} is not an array of integers: {exc}") from exc
        if arr.size == 0:
            arr = np.empty(0, dtype=np.int64)
        # np.asarray builds a new array from a list, tuple or range; from anything else
        # (a torch tensor, array.array, memoryview, an object with __array__) it may
        # return a view of the caller's memory, which the caller may rewrite later.
        fresh = isinstance(values, (list, tuple, range)) or arr.size == 0
    if arr.ndim != 1:
        raise InvalidBlockIdsError(f"{what} must be 1-D, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind not in "iu":
        raise InvalidBlockIdsError(
            f"{what} must hold integers, got dtype {arr.dtype} "
            f"(bools and floats are refused, even integral floats)"
        )
    if arr.size:
        if kind == "i" and int(arr.min()) < 0:
            raise InvalidBlockIdsError(f"{what} must be non-negative, got min {int(arr.min())}")
        if kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
            raise InvalidBlockIdsError(f"{what} holds ids beyond int64")
    out = arr if fresh and arr.dtype == np.int64 else np.array(arr, dtype=np.int64, copy=True)
    out.flags.writeable = False
    return out


def _as_count_tuple(values: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        items = tuple(operator.index(v) for v in values)
    except TypeError as exc:
        raise InvalidTransferError(f"{what} must be a sequence of ints: {exc}") from exc
    if any(v < 0 for v in items):
        raise InvalidTransferError(f"{what} must be non-negative, got {items}")
    return items


@dataclass(frozen=True, eq=False)
class BlockSpec:
    """Block ids on one medium. ``block_ids`` is a read-only int64 array."""

    medium: Medium
    block_ids: BlockIds

    def __post_init__(self) -> None:
        if not isinstance(self.medium, Medium):
            raise InvalidTransferError(f"medium must be a Medium, got {self.medium!r}")
        object.__setattr__(self, "block_ids", as_block_ids(self.block_ids))

    def __len__(self) -> int:
        return int(self.block_ids.shape[0])

    def __repr__(self) -> str:
        ids = self.block_ids
        shown = ids.tolist() if ids.size <= 8 else f"{ids[:4].tolist()}...({ids.size} ids)"
        return f"{type(self).__name__}({self.medium.value}, {shown})"


@dataclass(frozen=True, eq=False, repr=False)
class CacheBlocks(BlockSpec):
    """Blocks of the serving engine's KV cache.

    With several KV groups (hybrid models) the ids are ordered by group and
    ``group_sizes[g]`` counts group ``g``'s ids. ``block_indices[g]`` is the
    logical index, within its request, of group ``g``'s first block; with a
    block factor ``k`` it makes the transfer start ``block_indices[g] % k``
    sub-blocks into the first tier block (vLLM's ``blocks_per_chunk`` rule).
    Defaults: one group holding every id, starting at index 0.
    """

    group_sizes: tuple[int, ...] = field(default=())
    block_indices: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self)
        sizes = _as_count_tuple(self.group_sizes, "group_sizes") if self.group_sizes else (n,)
        indices = (
            _as_count_tuple(self.block_indices, "block_indices")
            if self.block_indices
            else (0,) * len(sizes)
        )
        if sum(sizes) != n:
            raise InvalidTransferError(
                f"group_sizes {sizes} sum to {sum(sizes)}, but there are {n} block ids"
            )
        if len(indices) != len(sizes):
            raise InvalidTransferError(
                f"block_indices has {len(indices)} entries for {len(sizes)} groups"
            )
        object.__setattr__(self, "group_sizes", sizes)
        object.__setattr__(self, "block_indices", indices)


@dataclass(frozen=True, eq=False, repr=False)
class TierBlocks(BlockSpec):
    """Blocks of an offload tier; each holds ``factor`` KV-cache blocks."""


KEYED_MEDIA = frozenset({Medium.DISK, Medium.REMOTE})
"""The media whose blocks are named by key (:class:`KeyedBlocks`)."""

MAX_KEY_BYTES = 120
"""The longest key a keyed tier takes. A disk tier names each file by its key in
hex, and 240 hex digits plus a suffix stay within a file name's 255 bytes."""


def as_keys(values: object, *, what: str = "keys") -> tuple[bytes, ...]:
    """Validate ``values`` and return them as a tuple of ``bytes``.

    Accepts a sequence (or other iterable with a length) of ``bytes``,
    ``bytearray`` or ``memoryview`` items; each becomes its own immutable copy,
    so the result never aliases caller memory. Refuses a bare ``bytes``/``str``,
    non-bytes items, an empty key, a key over :data:`MAX_KEY_BYTES` bytes and a
    key named twice, with :class:`InvalidKeyError`.
    """
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not hasattr(values, "__len__"):
        raise InvalidKeyError(
            f"{what} must be a sequence of bytes keys, got {type(values).__name__}"
        )
    out: list[bytes] = []
    items: Iterable[object] = values  # type: ignore[assignment]
    for i, key in enumerate(items):
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise InvalidKeyError(f"{what}[{i}] must be bytes, got {type(key).__name__}")
        data = bytes(key)
        if not data:
            raise InvalidKeyError(f"{what}[{i}] is empty")
        if len(data) > MAX_KEY_BYTES:
            raise InvalidKeyError(
                f"{what}[{i}] has {len(data)} bytes; keys hold at most {MAX_KEY_BYTES}"
            )
        out.append(data)
    keys = tuple(out)
    if len(set(keys)) != len(keys):
        seen: set[bytes] = set()
        for key in keys:
            if key in seen:
                raise InvalidKeyError(f"{what} names key {key.hex()} twice")
            seen.add(key)
    return keys


@dataclass(frozen=True, eq=False)
class KeyedBlocks:
    """Blocks of a keyed tier (disk, remote store), named by ``bytes`` keys.

    ``keys`` is validated at construction (:func:`as_keys`) and held as a tuple
    of immutable ``bytes`` copies. ``medium`` must be a keyed medium
    (:data:`KEYED_MEDIA`).
    """

    medium: Medium
    keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.medium, Medium):
            raise InvalidTransferError(f"medium must be a Medium, got {self.medium!r}")
        if self.medium not in KEYED_MEDIA:
            raise InvalidTransferError(
                f"KeyedBlocks live on a keyed medium (DISK, REMOTE), got {self.medium.value}"
            )
        object.__setattr__(self, "keys", as_keys(self.keys))

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        keys = self.keys
        shown = [k.hex()[:12] for k in keys[:4]]
        more = f"...({len(keys)} keys)" if len(keys) > 4 else ""
        return f"KeyedBlocks({self.medium.value}, {shown}{more})"


def disk_blocks(keys: Collection[bytes]) -> KeyedBlocks:
    """Blocks of the local-disk tier, named by key."""
    return KeyedBlocks(Medium.DISK, keys)  # type: ignore[arg-type]


def remote_blocks(keys: Collection[bytes]) -> KeyedBlocks:
    """Blocks of a remote store, named by key."""
    return KeyedBlocks(Medium.REMOTE, keys)  # type: ignore[arg-type]


def gpu_blocks(
    block_ids: BlockIdsLike,
    *,
    group_sizes: Sequence[int] = (),
    block_indices: Sequence[int] = (),
) -> CacheBlocks:
    """KV-cache blocks on a GPU."""
    return CacheBlocks(Medium.GPU, block_ids, tuple(group_sizes), tuple(block_indices))  # type: ignore[arg-type]


def npu_blocks(
    block_ids: BlockIdsLike,
    *,
    group_sizes: Sequence[int] = (),
    block_indices: Sequence[int] = (),
) -> CacheBlocks:
    """KV-cache blocks on an Ascend NPU."""
    return CacheBlocks(Medium.NPU, block_ids, tuple(group_sizes), tuple(block_indices))  # type: ignore[arg-type]


def host_cache_blocks(
    block_ids: BlockIdsLike,
    *,
    group_sizes: Sequence[int] = (),
    block_indices: Sequence[int] = (),
) -> CacheBlocks:
    """KV-cache blocks that live in host memory (a serving engine on CPU)."""
    return CacheBlocks(Medium.CPU, block_ids, tuple(group_sizes), tuple(block_indices))  # type: ignore[arg-type]


def cpu_blocks(block_ids: BlockIdsLike) -> TierBlocks:
    """Blocks of the host-memory offload tier."""
    return TierBlocks(Medium.CPU, block_ids)  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class TransferSpec:
    """Move the blocks of ``src`` into the blocks of ``dst``.

    ``tensors`` (a store or load only) moves just the parts of each block that lie
    in those KV tensors, by index into the layout's ``tensors``: in the per-layer
    layouts one tensor is one layer, so a load can go layer by layer. The tier
    keeps each block whole; the other tensors' bytes are left as they are.
    ``fence`` (a :class:`~offload_engine.JobFence`, one per job) signals this job's
    completion to a host thread or a device stream.
    """

    src: BlockSpec | KeyedBlocks
    dst: BlockSpec | KeyedBlocks
    tensors: tuple[int, ...] | None = None
    fence: JobFence | None = None

    def __post_init__(self) -> None:
        for side in ("src", "dst"):
            value = getattr(self, side)
            if not isinstance(value, (BlockSpec, KeyedBlocks)):
                raise InvalidTransferError(
                    f"TransferSpec.{side} must be a BlockSpec or KeyedBlocks, "
                    f"got {type(value).__name__}"
                )
        if self.fence is not None and not isinstance(self.fence, JobFence):
            raise InvalidTransferError(
                f"TransferSpec.fence must be a JobFence, got {type(self.fence).__name__}"
            )
        if self.tensors is not None:
            object.__setattr__(self, "tensors", self._check_tensors(self.tensors))

    def _check_tensors(self, tensors: object) -> tuple[int, ...]:
        if not (isinstance(self.src, CacheBlocks) or isinstance(self.dst, CacheBlocks)):
            raise InvalidTransferError(
                "TransferSpec.tensors selects parts of KV-cache blocks: only a store or a "
                "load (one side CacheBlocks) takes it"
            )
        if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
            raise InvalidTransferError(
                f"TransferSpec.tensors must be a sequence of tensor indices, got "
                f"{type(tensors).__name__}"
            )
        try:
            items = tuple(operator.index(t) for t in tensors)
        except TypeError as exc:
            raise InvalidTransferError(
                f"TransferSpec.tensors must hold ints, got {tensors!r}"
            ) from exc
        if not items:
            raise InvalidTransferError("TransferSpec.tensors is empty: it would move nothing")
        if min(items) < 0:
            raise InvalidTransferError(f"TransferSpec.tensors must be non-negative, got {items}")
        if len(set(items)) != len(items):
            raise InvalidTransferError(f"TransferSpec.tensors names a tensor twice: {items}")
        return tuple(sorted(items))

    @property
    def pair(self) -> tuple[Medium, Medium]:
        """The (source, destination) medium pair the engine routes on."""
        return (self.src.medium, self.dst.medium)

    @property
    def direction(self) -> Direction:
        if isinstance(self.src, CacheBlocks) and not isinstance(self.dst, CacheBlocks):
            return Direction.STORE
        if isinstance(self.dst, CacheBlocks) and not isinstance(self.src, CacheBlocks):
            return Direction.LOAD
        if isinstance(self.src, CacheBlocks):
            raise InvalidTransferError("a transfer from KV cache to KV cache is not supported")
        return Direction.COPY


@dataclass(frozen=True, slots=True)
class TransferResult:
    """The one terminal result of a job.

    ``seconds`` is the transfer's own duration (launch to completion, or the
    handler's measurement); ``latency`` is submit to result. ``error`` is
    ``None`` on success and a :class:`~offload_engine.errors.JobFailedError`
    otherwise. ``strategy`` is how the handler moved a successful job's bytes,
    where it says: a device handler's copy strategy (``"dma"``, ``"staged"``,
    ``"kernel"``; the one ``auto`` chose for this job); ``None`` otherwise.
    """

    job_id: int
    success: bool
    bytes_moved: int
    seconds: float
    error: BaseException | None = None
    latency: float = 0.0
    strategy: str | None = None
