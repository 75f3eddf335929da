"""A job's mapping between a KV layout's cache blocks and a host tier's slots, made at
submit (:func:`map_transfer`), checked, and kept for the job's copies.

Block-id arithmetic follows vLLM's ``blocks_per_chunk`` rule: a job moving
``n`` cache blocks of a group whose first block has logical index ``i`` starts
``i % factor`` slots into its first tier block and spans
``ceil((n + i % factor) / factor)`` tier blocks. Stores and loads alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from offload_engine.errors import (
    BlockCountMismatchError,
    InvalidBlockIdsError,
    InvalidTransferError,
    LayoutError,
)
from offload_engine.host.layout import KVLayout
from offload_engine.host.tier import HostTier
from offload_engine.vocabulary import BlockIds, CacheBlocks, Direction, TierBlocks, TransferSpec


@dataclass(frozen=True)
class GroupMapping:
    """Cache block ids and the tier slots they pair with, for one KV group."""

    group: int
    cache_ids: BlockIds
    slots: BlockIds


def expand_tier_slots(tier_ids: BlockIds, factor: int, skip: int, count: int) -> BlockIds:
    """The ``count`` slots that start ``skip`` slots into ``tier_ids[0]``."""
    if factor == 1:
        return tier_ids[:count]
    slots = (tier_ids[:, None] * factor + np.arange(factor, dtype=np.int64)[None, :]).ravel()
    return slots[skip : skip + count]


def _first_repeat(ids: BlockIds) -> int | None:
    if ids.size < 2:
        return None
    if ids.size <= 64 and len(set(ids.tolist())) == ids.size:
        return None  # the common case, and a set is cheaper than a sort at this size
    ordered = np.sort(ids)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[same[0]]) if same.size else None


def check_destinations(
    mapping: Sequence[GroupMapping],
    *,
    direction: Direction,
    aliases: Sequence[int],
    factor: int = 1,
) -> None:
    """Refuse a job that writes one destination twice, with :class:`InvalidBlockIdsError`.

    Two writes to one place in one job have no defined order (workers or a device may
    run them at once and tear the block), so they are refused at submit. A store writes
    tier slots, which every KV group shares; a load writes cache blocks, which groups
    that share a tensor (``aliases``, :attr:`KVLayout.group_aliases`) share too. Sources
    may repeat: reading a block twice is harmless.
    """
    if direction is Direction.STORE:
        parts = [m.slots for m in mapping]
        if sum(p.size for p in parts) < 2:
            return
        slot = _first_repeat(np.concatenate(parts) if len(parts) > 1 else parts[0])
        if slot is not None:
            where = f"tier block {slot // factor}"
            if factor > 1:
                where += f" (slot {slot % factor})"
            raise InvalidBlockIdsError(
                f"the store writes {where} twice; destinations must be distinct within a job"
            )
        return
    by_class: dict[int, list[BlockIds]] = {}
    for m in mapping:
        by_class.setdefault(aliases[m.group], []).append(m.cache_ids)
    for parts in by_class.values():
        block = _first_repeat(np.concatenate(parts) if len(parts) > 1 else parts[0])
        if block is not None:
            raise InvalidBlockIdsError(
                f"the load writes cache block {block} twice; destinations must be distinct "
                "within a job (KV groups that share a tensor share their blocks)"
            )


def map_blocks(
    cache: CacheBlocks,
    tier: TierBlocks,
    *,
    factor: int,
    num_cache_blocks: int,
    num_tier_blocks: int,
    num_groups: int,
) -> list[GroupMapping]:
    """Pair each cache block of ``cache`` with its tier slot, per group.

    Raises :class:`BlockCountMismatchError` when the tier ids do not cover the
    cache ids exactly, and :class:`InvalidBlockIdsError` for ids outside either
    pool. Vectorised: no per-block Python loop.
    """
    if len(cache.group_sizes) != num_groups:
        raise BlockCountMismatchError(
            f"the cache spec has {len(cache.group_sizes)} KV groups, the layout {num_groups}"
        )
    cache_ids, tier_ids = cache.block_ids, tier.block_ids
    n = cache_ids.size
    if factor == 1 and num_groups == 1 and 0 < n == tier_ids.size:
        # the common job (one group, one slot per tier block): two range checks and no
        # slicing; below 64 ids a Python max is cheaper than numpy's
        small = n <= 64
        top_cache = max(cache_ids.tolist()) if small else int(cache_ids.max())
        top_tier = max(tier_ids.tolist()) if small else int(tier_ids.max())
        if top_cache < num_cache_blocks and top_tier < num_tier_blocks:
            return [GroupMapping(0, cache_ids, tier_ids)]
    if cache_ids.size and int(cache_ids.max()) >= num_cache_blocks:
        raise InvalidBlockIdsError(
            f"cache block id {int(cache_ids.max())} is out of range (the cache has "
            f"{num_cache_blocks} blocks)"
        )
    if tier_ids.size and int(tier_ids.max()) >= num_tier_blocks:
        raise InvalidBlockIdsError(
            f"tier block id {int(tier_ids.max())} is out of range (the tier has "
            f"{num_tier_blocks} blocks)"
        )
    out: list[GroupMapping] = []
    c0 = t0 = 0
    for g, (n, index) in enumerate(zip(cache.group_sizes, cache.block_indices, strict=True)):
        skip = index % factor
        m = -(-(n + skip) // factor) if n else 0
        if t0 + m > tier_ids.size:
            break
        if n:
            out.append(
                GroupMapping(
                    g,
                    cache_ids[c0 : c0 + n],
                    expand_tier_slots(tier_ids[t0 : t0 + m], factor, skip, n),
                )
            )
        c0 += n
        t0 += m
    else:
        if t0 == tier_ids.size:
            return out
    expected = sum(
        -(-(n + i % factor) // factor) if n else 0
        for n, i in zip(cache.group_sizes, cache.block_indices, strict=True)
    )
    raise BlockCountMismatchError(
        f"{len(cache_ids)} cache blocks (groups {cache.group_sizes}, first indices "
        f"{cache.block_indices}) need {expected} tier blocks at factor {factor}, "
        f"got {tier_ids.size}"
    )


@dataclass(frozen=True)
class TierTransfer:
    """A job between a KV layout and a host tier, mapped at submit."""

    direction: Direction
    groups: list[GroupMapping]
    nbytes: int
    #: with ``TransferSpec.tensors``: per KV group, the indices of the regions moved
    #: (:meth:`KVLayout.regions_in`); None moves every region
    regions: tuple[tuple[int, ...], ...] | None = None


#: ``check(cache_ids, tier_ids, num_cache_blocks, num_tier_blocks, store)``: whether
#: the common job passes (:class:`offload_engine.device.runtimes._native.PairCheck`)
PairChecker: TypeAlias = Callable[[BlockIds, BlockIds, int, int, bool], bool]

#: up to this many ids the common job's checks run on Python lists
_LIST_CHECK_IDS = 64


def _common_job_passes(
    cache_ids: BlockIds,
    tier_ids: BlockIds,
    num_cache: int,
    num_tier: int,
    store: bool,
    check: PairChecker | None,
) -> bool:
    """Whether a job of one KV group at factor 1 (``cache_ids[i]`` pairs with
    ``tier_ids[i]``, equal lengths) has every id in range and distinct destinations.
    ``False`` also means "not decided here": the general path then checks again and
    raises what it finds. Small jobs are checked on lists, larger ones by ``check``
    (one foreign call) where given; a numpy call costs tens of microseconds in a
    thread that has been idle, so the general path's five are avoided."""
    n = cache_ids.shape[0]
    if n <= _LIST_CHECK_IDS:
        cache: list[int] = cache_ids.tolist()
        blocks: list[int] = tier_ids.tolist()
        dst = blocks if store else cache
        return max(cache) < num_cache and max(blocks) < num_tier and len(set(dst)) == n
    if check is None:
        return False
    return check(cache_ids, tier_ids, num_cache, num_tier, store)


class LastMapping:
    """The last whole-block pairing :func:`map_transfer` made for one handler, by the
    identity of its spec's two sides. The parts of a layer-wise load (one spec per
    group of layers over the same :class:`CacheBlocks` and :class:`TierBlocks`, whose
    ids are read-only) then check and pair their blocks once. Any thread: one tuple
    is read or replaced at a time."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[CacheBlocks, TierBlocks, TierTransfer] | None = None

    def get(self, cache: CacheBlocks, blocks: TierBlocks) -> TierTransfer | None:
        last = self._last
        if last is not None and last[0] is cache and last[1] is blocks:
            return last[2]
        return None

    def put(self, cache: CacheBlocks, blocks: TierBlocks, job: TierTransfer) -> None:
        self._last = (cache, blocks, job)


def map_transfer(
    spec: TransferSpec,
    layout: KVLayout,
    tier: HostTier,
    *,
    who: str,
    expect: Direction | None = None,
    check: PairChecker | None = None,
    last: LastMapping | None = None,
) -> TierTransfer:
    """Check that ``spec`` moves blocks between the KV cache and the tier (the
    ``expect``-ed way, if given), and pair every cache block with its tier slot.
    A job that writes one destination twice is refused (:func:`check_destinations`).
    ``check`` checks the common job of more than 64 blocks in one call (the native
    library's); without it, numpy does. With ``last``, a spec over the very block
    objects of the previous one reuses its pairing.

    Raises :class:`InvalidTransferError`, :class:`BlockCountMismatchError`,
    :class:`InvalidBlockIdsError` or, for a released tier, :class:`LayoutError`.
    """
    direction = spec.direction
    if direction is Direction.COPY or (expect is not None and direction is not expect):
        want = f"a {expect.value}" if expect is not None else "a store or a load"
        raise InvalidTransferError(
            f"{who} needs {want} between a KV cache and a tier, got "
            f"{type(spec.src).__name__} -> {type(spec.dst).__name__}"
        )
    cache, blocks = (spec.src, spec.dst) if direction is Direction.STORE else (spec.dst, spec.src)
    if not isinstance(cache, CacheBlocks) or not isinstance(blocks, TierBlocks):
        raise InvalidTransferError(f"{who} needs CacheBlocks and TierBlocks, got {spec!r}")
    if tier.released:
        raise LayoutError(f"{who}: the host tier has been released")
    job = None if last is None else last.get(cache, blocks)
    if job is None:
        job = _map_whole(spec, cache, blocks, layout, tier, check)
        if last is not None:
            last.put(cache, blocks, job)
    if spec.tensors is None:
        return job
    return _select_tensors(job, layout, spec.tensors)


def _select_tensors(job: TierTransfer, layout: KVLayout, tensors: tuple[int, ...]) -> TierTransfer:
    """``job`` narrowed to the regions in ``tensors``; groups with none are dropped."""
    regions = layout.regions_in(tensors)
    if job.groups and not any(regions[m.group] for m in job.groups):
        raise InvalidTransferError(
            f"TransferSpec.tensors {tensors} holds no region of the job's KV groups "
            f"in layout {layout.name}"
        )
    groups = [m for m in job.groups if regions[m.group]]
    nbytes = sum(
        int(m.cache_ids.size) * sum(layout.groups[m.group][i].size for i in regions[m.group])
        for m in groups
    )
    return TierTransfer(job.direction, groups, nbytes, regions)


def _map_whole(
    spec: TransferSpec,
    cache: CacheBlocks,
    blocks: TierBlocks,
    layout: KVLayout,
    tier: HostTier,
    check: PairChecker | None,
) -> TierTransfer:
    direction = spec.direction
    cache_ids, tier_ids = cache.block_ids, blocks.block_ids
    n = cache_ids.shape[0]
    if (
        tier.factor == 1
        and len(cache.group_sizes) == 1 == len(layout.groups)
        and 0 < n == tier_ids.shape[0]
        and _common_job_passes(
            cache_ids,
            tier_ids,
            layout.num_blocks,
            tier.num_blocks,
            direction is Direction.STORE,
            check,
        )
    ):
        return TierTransfer(
            direction, [GroupMapping(0, cache_ids, tier_ids)], n * layout.group_bytes[0]
        )
    groups = map_blocks(
        cache,
        blocks,
        factor=tier.factor,
        num_cache_blocks=layout.num_blocks,
        num_tier_blocks=tier.num_blocks,
        num_groups=len(layout.groups),
    )
    check_destinations(
        groups,
        direction=direction,
        aliases=layout.group_aliases,
        factor=tier.factor,
    )
    nbytes = sum(int(m.cache_ids.size) * layout.group_bytes[m.group] for m in groups)
    return TierTransfer(direction, groups, nbytes)
