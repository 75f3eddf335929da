"""map_transfer's common-job checks (lists, or one native call) decide as the general path does.

A job of one KV group at factor 1 is checked by ``_common_job_passes`` (Python
lists up to 64 ids, else the native library's ``oe_check_pairs``); anything it
refuses goes to the general path (``map_blocks`` and ``check_destinations``),
which names the fault. So on any job the outcome (the mapping, or the error's
type and message) is the general path's.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_engine import KVLayout, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device.runtimes import _native
from offload_engine.errors import InvalidBlockIdsError, OffloadError
from offload_engine.host import mapping as mapping_module
from offload_engine.host.mapping import LastMapping, check_destinations, map_blocks, map_transfer
from offload_engine.host.tier import HostTier
from offload_engine.vocabulary import Direction

NC, NT = 300, 200  # cache blocks, tier blocks

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler ($CC or cc) to build the native library",
)


@pytest.fixture(scope="module")
def pools() -> tuple[KVLayout, HostTier]:
    layout = KVLayout.flash_attention([torch.zeros(2, NC, 1, 1, 2) for _ in range(2)])
    return layout, HostTier.for_layout(layout, NT)


def _native_check() -> _native.PairCheck:
    found = _native.native_library()
    assert not isinstance(found, str), found
    return _native.PairCheck(found[3])


def _general(spec: TransferSpec, layout: KVLayout, tier: HostTier) -> object:
    """The general path's verdict: the pairs, or the error (type, message)."""
    direction = spec.direction
    cache, blocks = (spec.src, spec.dst) if direction is Direction.STORE else (spec.dst, spec.src)
    try:
        groups = map_blocks(
            cache,  # type: ignore[arg-type]
            blocks,  # type: ignore[arg-type]
            factor=1,
            num_cache_blocks=layout.num_blocks,
            num_tier_blocks=tier.num_blocks,
            num_groups=1,
        )
        check_destinations(groups, direction=direction, aliases=layout.group_aliases)
    except OffloadError as exc:
        return (type(exc), str(exc))
    return [(m.group, m.cache_ids.tolist(), m.slots.tolist()) for m in groups]


def _fast(spec: TransferSpec, layout: KVLayout, tier: HostTier, check: object) -> object:
    try:
        job = map_transfer(spec, layout, tier, who="t", check=check)  # type: ignore[arg-type]
    except OffloadError as exc:
        return (type(exc), str(exc))
    assert job.nbytes == len(spec.src) * layout.group_bytes[0]
    return [(m.group, m.cache_ids.tolist(), m.slots.tolist()) for m in job.groups]


@st.composite
def jobs(draw: st.DrawFn) -> tuple[list[int], list[int], bool]:
    """A job near the 64-id boundary or larger; sometimes an id out of range, a
    repeated destination or source, or one tier id too many."""
    n = draw(st.sampled_from([1, 2, 8, 63, 64, 65, 130, 200]))
    cache = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(NC)[:n].tolist()
    tier = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(NT)[:n].tolist()
    fault = draw(st.sampled_from(["none", "cache range", "tier range", "dup cache", "dup tier"]))
    at = draw(st.integers(0, n - 1))
    if fault == "cache range":
        cache[at] = NC + draw(st.integers(0, 5))
    elif fault == "tier range":
        tier[at] = NT + draw(st.integers(0, 5))
    elif fault == "dup cache" and n > 1:
        cache[at] = cache[(at + 1) % n]
    elif fault == "dup tier" and n > 1:
        tier[at] = tier[(at + 1) % n]
    if draw(st.booleans()) and draw(st.booleans()):
        tier.append(tier[0])  # a count the general path refuses
    return cache, tier, draw(st.booleans())


@needs_cc
@settings(max_examples=300, deadline=None)
@given(jobs())
def test_the_common_jobs_checks_match_the_general_path(
    pools: tuple[KVLayout, HostTier], job: tuple[list[int], list[int], bool]
) -> None:
    layout, tier = pools
    cache, slots, store = job
    c, t = gpu_blocks(cache), cpu_blocks(slots)
    spec = TransferSpec(c, t) if store else TransferSpec(t, c)
    want = _general(spec, layout, tier)
    assert _fast(spec, layout, tier, None) == want
    assert _fast(spec, layout, tier, _native_check()) == want


@needs_cc
@pytest.mark.parametrize("n", [65, 1024, 1025, 5000])
def test_the_native_check_finds_a_repeat_anywhere(n: int) -> None:
    check = _native_check()
    rng = np.random.default_rng(n)
    cache = rng.permutation(2 * n)[:n].astype(np.int64)
    tier = rng.permutation(2 * n)[:n].astype(np.int64)
    assert check(cache, tier, 2 * n, 2 * n, True)
    assert check(cache, tier, 2 * n, 2 * n, False)
    for i, j in ((0, n - 1), (n - 1, n - 2), (n // 2, 3)):
        dup = tier.copy()
        dup[i] = dup[j]
        assert not check(cache, dup, 2 * n, 2 * n, True)  # a store writes tier slots
        assert check(cache, dup, 2 * n, 2 * n, False)  # a load only reads them
    assert not check(cache, tier, int(cache.max()), 2 * n, True)
    assert not check(cache, tier, 2 * n, int(tier.max()), False)


def test_the_parts_of_one_load_pair_their_blocks_once(
    pools: tuple[KVLayout, HostTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a LastMapping, specs over the very same block objects (a layer-wise
    load's parts) reuse the first one's pairing; new objects are checked again, so
    a bad job on new objects is still refused, whatever came before."""
    layout, tier = pools
    calls: list[int] = []
    whole = mapping_module._map_whole

    def counted(*args: object) -> object:
        calls.append(1)
        return whole(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(mapping_module, "_map_whole", counted)
    last = LastMapping()
    src, dst = cpu_blocks(range(70)), gpu_blocks(range(100, 170))
    jobs = [
        map_transfer(TransferSpec(src, dst, tensors=(t,)), layout, tier, who="t", last=last)
        for t in range(2)
    ]
    assert len(calls) == 1
    assert [j.regions for j in jobs] == [layout.regions_in((0,)), layout.regions_in((1,))]
    assert jobs[0].groups[0] is jobs[1].groups[0]
    assert np.array_equal(jobs[0].groups[0].cache_ids, np.arange(100, 170))
    same_ids = TransferSpec(cpu_blocks(range(70)), gpu_blocks(range(100, 170)))
    map_transfer(same_ids, layout, tier, who="t", last=last)
    assert len(calls) == 2  # equal ids in new objects: checked again
    repeat = TransferSpec(cpu_blocks([1, 2]), gpu_blocks([5, 5]))
    for _ in range(2):
        with pytest.raises(InvalidBlockIdsError, match="twice"):
            map_transfer(repeat, layout, tier, who="t", last=last)
