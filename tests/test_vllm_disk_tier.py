"""EngineDiskTier through vLLM's SecondaryTierManager API, on a memoryview like vLLM's.

The tier is built the way vLLM's tiering spec builds it (SecondaryTierFactory,
``type`` + ``module_path``), over an mmap-backed ``(chunks, bytes)`` view of the
primary tier, and driven as the scheduler drives it: lookups, non-blocking
submits, polling, drain, shutdown.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from offload_engine import LayoutMismatchError
from offload_engine.connectors.vllm.disk_tier import EngineDiskTier
from tests.test_disk import gated

pytestmark = pytest.mark.vllm

CHUNKS, CHUNK = 12, 8192


def offloading_spec(model: str = "tiny") -> Any:
    config = SimpleNamespace(
        model=SimpleNamespace(name=model, dtype="float32"),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=SimpleNamespace(rank=0, world_size=1),
    )
    return SimpleNamespace(config=config)


def primary_view() -> tuple[memoryview, np.ndarray]:
    """An mmap-backed (chunks, bytes) int8 view, as vLLM's primary tier exposes it."""
    buf = mmap.mmap(-1, CHUNKS * CHUNK)
    array = np.frombuffer(buf, dtype=np.int8).reshape(CHUNKS, CHUNK)
    array[:] = np.random.default_rng(5).integers(-128, 128, array.shape, dtype=np.int8)
    return memoryview(array), array


def make_tier(path: Path, view: memoryview, spec: Any = None, **extra: Any) -> EngineDiskTier:
    config = {
        "type": "EngineDiskTier",
        "module_path": "offload_engine.connectors.vllm",
        "path": str(path),
        "capacity_bytes": 64 * (CHUNK + 4096),
        **extra,
    }
    tier = SecondaryTierFactory.create_secondary_tier(config, view, spec or offloading_spec())
    assert isinstance(tier, EngineDiskTier)
    return tier


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(32, "big") + (0).to_bytes(4, "big"))


def job(job_id: int, keys: list[OffloadKey], chunks: list[int], promotion: bool) -> TransferJob:
    return TransferJob(job_id, keys, np.array(chunks, dtype=np.int64), promotion, ReqContext("r"))


def finish(tier: EngineDiskTier) -> dict[int, JobResult]:
    tier.drain_jobs()
    return {r.job_id: r for r in tier.get_finished_jobs()}


def test_store_lookup_load_restart(tmp_path: Path) -> None:
    view, array = primary_view()
    originals = array[:4].copy()
    ctx = ReqContext("r")
    keys = [key(i) for i in range(4)]
    tier = make_tier(tmp_path, view)
    try:
        assert tier.lookup(keys[0], ctx) is LookupResult.MISS
        tier.submit_store(job(1, keys, [0, 1, 2, 3], False))
        assert tier.has_pending_work()
        results = finish(tier)
        assert results[1].success and results[1].transfer_bytes == 4 * CHUNK
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
        array[8:12] = 0
        tier.submit_load(job(2, keys[::-1], [8, 9, 10, 11], True))
        assert finish(tier)[2].success
        assert np.array_equal(array[8:12], originals[::-1])
        assert tier.get_finished_jobs() == []  # each result once
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()
        tier.shutdown()
    # a fresh tier on the same directory (a restarted vLLM) finds every chunk
    view2, array2 = primary_view()
    tier = make_tier(tmp_path, view2)
    try:
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
        array2[:] = 0
        tier.submit_load(job(3, keys, [4, 5, 6, 7], True))
        assert finish(tier)[3].success
        assert np.array_equal(array2[4:8], originals)
    finally:
        tier.shutdown()
    with pytest.raises(LayoutMismatchError, match="model"):
        make_tier(tmp_path, view2, spec=offloading_spec("another-model"))


def test_a_corrupt_chunk_is_a_partial_failure_with_the_verified_keys(tmp_path: Path) -> None:
    view, array = primary_view()
    keys = [key(i) for i in range(3)]
    tier = make_tier(tmp_path, view)
    try:
        tier.submit_store(job(1, keys, [0, 1, 2], False))
        assert finish(tier)[1].success
        where = tier.store.location(keys[1])  # its slot in a segment
        assert where is not None
        path, offset, _length = where
        with open(path, "r+b") as f:
            f.seek(offset + 7)
            byte = f.read(1)[0]
            f.seek(offset + 7)
            f.write(bytes([byte ^ 0xFF]))
        array[8:11] = 3
        tier.submit_load(job(2, keys, [8, 9, 10], True))
        result = finish(tier)[2]
        assert not result.success
        assert set(result.successful_keys or ()) == {keys[0], keys[2]}
        assert np.array_equal(array[8], array[0]) and np.array_equal(array[10], array[2])
        assert not array[9].any()  # the bad chunk's slot holds no loaded bytes
        assert tier.lookup(keys[1], ReqContext("r")) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_lookup_says_retry_while_the_chunk_is_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    view, _array = primary_view()
    tier = make_tier(tmp_path, view)
    try:
        with gated(monkeypatch, "pwritev") as (entered, release):
            tier.submit_store(job(1, [key(0)], [0], False))
            assert entered.wait(10)
            assert tier.lookup(key(0), ReqContext("r")) is LookupResult.RETRY
            assert tier.get_finished_jobs() == []  # never waits
            release.set()
            assert finish(tier)[1].success
        assert tier.lookup(key(0), ReqContext("r")) is LookupResult.HIT
    finally:
        tier.shutdown()


def test_a_refused_job_is_a_failed_result_and_the_tier_serves_on(tmp_path: Path) -> None:
    view, _array = primary_view()
    tier = make_tier(tmp_path, view)
    try:
        tier.submit_store(job(1, [key(0)], [CHUNKS], False))  # no such chunk
        tier.submit_store(job(2, [key(1)], [1], False))
        results = finish(tier)
        assert not results[1].success and results[2].success
    finally:
        tier.shutdown()
