"""EngineTieringSpec inside real vLLM classes (in-process, no model run): vLLM's
tiering manager and its real ``fs`` tier on the scheduler side, offload-engine on
the worker side, one shared offload region between them."""

from __future__ import annotations

import os
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

import vllm_configs

from offload_engine import ConfigError, LayoutError
from offload_engine.connectors.vllm import platform
from offload_engine.connectors.vllm.testing import (
    FakeCanonicalKVCaches,
    fake_canonical_kv_caches,
    page_bytes,
)
from offload_engine.testing import FakeAscend, FakeRuntime, engine_threads

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SPEC_KEYS = {"spec_name": "EngineTieringSpec", "spec_module_path": "offload_engine.connectors.vllm"}
GROUPS = (((0, 240), (1, 240)), ((2, 160),))
PADDED = 256 + 256 + 192  # the fake caches' padded pages: vLLM's bytes per block


ENGINE_IDS: list[str] = []


@pytest.fixture(autouse=True)
def no_region_left_behind() -> Iterator[None]:
    """Each test's shared offload regions are gone when it ends (removed, if a failed
    test left one, so /dev/shm does not fill up)."""
    yield
    left = [p for e in ENGINE_IDS for p in Path("/dev/shm").glob(f"vllm_offload_{e}.mmap*")]
    ENGINE_IDS.clear()
    for p in left:
        p.unlink()
    assert not left, f"shared offload regions left behind: {left}"


def offloading_config(extra: dict[str, Any], **kwargs: Any) -> Any:
    # the region is /dev/shm/vllm_offload_<engine_id>.mmap: unique per test
    engine_id = f"oe-test-{uuid.uuid4().hex}"
    ENGINE_IDS.append(engine_id)
    kwargs.setdefault("bytes_per_block", PADDED)
    return vllm_configs.offloading_config(extra, spec_keys=SPEC_KEYS, engine_id=engine_id, **kwargs)


@pytest.fixture(scope="module")
def spec_cls() -> Any:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    # exactly how vLLM's OffloadingConnector finds it: by name, from the module path
    return OffloadingSpecFactory.get_spec_cls(SPEC_KEYS)


def fs_extra(root: Path, **more: Any) -> dict[str, Any]:
    tier = {"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}
    return {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier], **more}


def fs_round_trip(manager: Any, src_chunk: int, dst_chunk: int) -> None:
    """vLLM's fs tier writes primary chunk ``src_chunk`` to a file, then promotes the
    file into chunk ``dst_chunk`` (its own I/O threads, through the region's view)."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    [fs] = manager.secondary_tiers
    key = make_offload_key(bytes([src_chunk]) * 32, 0)  # one file per source chunk
    ctx = ReqContext("req-0")
    fs.submit_store(TransferJob(1, [key], np.array([src_chunk]), False, ctx))
    fs.drain_jobs()
    fs.submit_load(TransferJob(2, [key], np.array([dst_chunk]), True, ctx))
    fs.drain_jobs()
    results = {r.job_id: r.success for r in fs.get_finished_jobs()}
    assert results == {1: True, 2: True}


def store_and_load(worker: Any, kv: FakeCanonicalKVCaches, manager: Any, factor: int) -> None:
    """The worker stores blocks into chunks, vLLM's fs tier moves those chunks through
    a file into other chunks, the worker loads them back: bit for bit."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    n = factor  # one chunk per group
    src0, src1 = list(range(1, 1 + n)), list(range(5, 5 + n))
    want = [page_bytes(kv, 0, b) for b in src0] + [page_bytes(kv, 1, b) for b in src1]
    store = GPULoadStoreSpec(src0 + src1, group_sizes=[n, n], block_indices=[0, 0])
    assert worker.submit_store(0, store, CPULoadStoreSpec([2, 3]))
    worker.wait({0})
    fs_round_trip(manager, 2, 7)
    fs_round_trip(manager, 3, 8)
    dst0, dst1 = list(range(9, 9 + n)), list(range(13, 13 + n))
    load = GPULoadStoreSpec(dst0 + dst1, group_sizes=[n, n], block_indices=[0, 0])
    assert worker.submit_load(1, CPULoadStoreSpec([7, 8]), load, expedited=True)
    worker.wait({1})
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(0, True), (1, True)]
    got = [page_bytes(kv, 0, b) for b in dst0] + [page_bytes(kv, 1, b) for b in dst1]
    assert got == want


def shut_down_like_vllm(worker: Any, manager: Any) -> None:
    """OffloadingConnector.shutdown(): the connector worker (its OffloadingWorker's
    shutdown), then the connector scheduler (the manager's shutdown)."""
    worker.shutdown()
    manager.shutdown()


def test_vllm_finds_the_spec_by_name(spec_cls: Any) -> None:
    from offload_engine.connectors.vllm import EngineTieringSpec

    assert spec_cls is EngineTieringSpec


@pytest.mark.parametrize("factor", [1, 2])
def test_cpu_platform_worker_and_fs_tier_share_the_region(
    spec_cls: Any, tmp_path: Path, factor: int
) -> None:
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    spec = spec_cls(offloading_config(fs_extra(tmp_path), blocks_per_chunk=factor))
    manager = spec.get_manager()  # the scheduler side, vLLM's own
    assert isinstance(manager, TieringOffloadingManager)
    [fs] = manager.secondary_tiers
    assert isinstance(fs, FileSystemTierManager)
    kv = fake_canonical_kv_caches(num_blocks=24, groups=GROUPS)
    before = set(engine_threads())
    worker = spec.get_worker(kv)
    assert spec.get_worker(kv) is worker
    region = worker.region
    mapping = region.mmap_obj
    path = region.mmap_path
    tier = worker.bridge._tier
    # the tier is this rank's page of every chunk row, not a copy
    assert tier.span.data_ptr() == region.base_tensor.data_ptr()
    assert (tier.page_bytes, tier.block_stride) == (
        spec.cpu_page_size_per_worker,
        spec.kv_bytes_per_chunk,
    )
    store_and_load(worker, kv, manager, factor)
    assert set(engine_threads()) - before
    shut_down_like_vllm(worker, manager)
    assert set(engine_threads()) <= before  # no engine thread left behind
    assert mapping.closed  # unmapped: nothing of ours still held the region's memory
    assert tier.released
    assert not os.path.exists(path)
    worker.shutdown()  # idempotent


def test_npu_platform_registers_the_region_and_unregisters_it_at_shutdown(
    spec_cls: Any, tmp_path: Path, ascend: FakeAscend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from offload_engine.connectors.vllm import spec as spec_module

    monkeypatch.setattr(spec_module, "current_platform", types.SimpleNamespace(device_type="npu"))
    spec = spec_cls(offloading_config(fs_extra(tmp_path, strategy="dma"), blocks_per_chunk=2))
    manager = spec.get_manager()
    kv = fake_canonical_kv_caches(num_blocks=24, groups=GROUPS, empty=ascend.empty)
    worker = spec.get_worker(kv)
    base = worker.region.base_tensor.data_ptr()
    assert any(start <= base < start + size for start, size in ascend.registrations.items()), (
        "the region was not registered with the NPU runtime"
    )
    store_and_load(worker, kv, manager, 2)
    mapping = worker.region.mmap_obj
    shut_down_like_vllm(worker, manager)
    assert ascend.registrations == {}
    assert mapping.closed


@pytest.mark.parametrize("strategy", ["dma", "staged", "kernel"])
def test_cuda_platform_on_the_fake_runtime(
    spec_cls: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    from offload_engine.connectors.vllm import spec as spec_module

    fake = FakeRuntime()
    try:
        module = types.ModuleType("fake_cuda_runtime_module")
        module.Runtime = lambda: fake  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "fake_cuda_runtime_module", module)
        monkeypatch.setattr(platform, "CUDA_RUNTIME", "fake_cuda_runtime_module:Runtime")
        monkeypatch.setattr(
            spec_module, "current_platform", types.SimpleNamespace(device_type="cuda")
        )
        extra = fs_extra(tmp_path, strategy=strategy, staging_bytes=1 << 14)
        spec = spec_cls(offloading_config(extra))
        manager = spec.get_manager()
        kv = fake_canonical_kv_caches(num_blocks=24, groups=GROUPS, empty=fake.empty)
        worker = spec.get_worker(kv)
        assert fake.pin_calls[0][0] == worker.region.base_tensor.data_ptr()
        store_and_load(worker, kv, manager, 1)
        shut_down_like_vllm(worker, manager)
        assert sorted(fake.unpin_calls) == sorted(s for s, _ in fake.pin_calls)
    finally:
        fake.close()


@pytest.mark.parametrize(("rank", "replicated", "page_index"), [(1, False, 1), (1, True, 0)])
def test_each_rank_gets_its_page_and_mla_replication_shares_rank_zeros(
    spec_cls: Any, tmp_path: Path, rank: int, replicated: bool, page_index: int
) -> None:
    config = offloading_config(fs_extra(tmp_path), world_size=2, rank=rank, replicated=replicated)
    spec = spec_cls(config)
    worker = spec.get_worker(fake_canonical_kv_caches(num_blocks=8, groups=GROUPS))
    try:
        tier = worker.bridge._tier
        offset = tier.span.data_ptr() - worker.region.base_tensor.data_ptr()
        assert offset == page_index * spec.cpu_page_size_per_worker
        # several writers' pages are not one portable block: their own namespace
        assert spec.config.parallel.is_parallelism_agnostic is replicated
    finally:
        worker.shutdown()


def test_a_page_that_cannot_hold_a_block_names_both_sides(spec_cls: Any, tmp_path: Path) -> None:
    # vLLM thinks a block is 400 bytes per worker; the engine's slot needs 480
    spec = spec_cls(offloading_config(fs_extra(tmp_path), bytes_per_block=400))
    region_files = set(Path("/dev/shm").glob(f"vllm_offload_{spec.config.engine_id}*"))
    with pytest.raises(LayoutError, match=r"cpu_page_size_per_worker=400.*needs 480 bytes"):
        spec.get_worker(fake_canonical_kv_caches(num_blocks=8, groups=GROUPS))
    assert set(Path("/dev/shm").glob(f"vllm_offload_{spec.config.engine_id}*")) == region_files


def test_keyed_tiers_get_a_namespace_of_their_own(spec_cls: Any, tmp_path: Path) -> None:
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from offload_engine.connectors.vllm.tiering import PAGE_FORMAT

    config = offloading_config(fs_extra(tmp_path))
    ours = spec_cls(config)
    stock = TieringOffloadingSpec(config)
    assert ours.config.model.dtype == f"float32;{PAGE_FORMAT}"
    mine = FileMapper.from_offloading_spec(str(tmp_path), ours).base_path
    theirs = FileMapper.from_offloading_spec(str(tmp_path), stock).base_path
    assert mine != theirs  # stock vLLM's files (another byte format) are never read


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"secondary_tiers": []}, r"\['cpu_bytes_to_use'\] is required"),
        (
            {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "floppy"}]},
            r"\['secondary_tiers'\]\[0\]\['type'\]='floppy'.*Unknown secondary tier",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "secondary_tiers": [
                    {"type": "NoSuchTier", "module_path": "offload_engine.connectors.vllm"}
                ],
            },
            r"\['secondary_tiers'\]\[0\]\['type'\]='NoSuchTier'",
        ),
        (
            {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "fs"}]},
            r"\['root_dir'\] is required",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "secondary_tiers": [{"type": "fs", "root_dir": "/x", "rootdir": 1}],
            },
            r"\[0\]\['rootdir'\] is not a parameter of secondary tier 'fs'",
        ),
        (
            {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": {"type": "fs"}},
            r"\['secondary_tiers'\] must be a list",
        ),
        (
            {"cpu_bytes_to_use": 100, "secondary_tiers": []},
            r"\['cpu_bytes_to_use'\]=100 holds no offload chunk",
        ),
        ({"cpu_bytes_to_use": 1 << 20, "store_threshold": 2}, r"\['store_threshold'\]=2"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(
    spec_cls: Any, extra: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        spec_cls(offloading_config(extra))


def test_metrics_are_asked_for_first_and_fail_typed_too(spec_cls: Any) -> None:
    with pytest.raises(ConfigError, match=r"\['secondary_tiers'\]\[0\]\['type'\]='floppy'"):
        spec_cls.build_metric_definitions(
            {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "floppy"}]}
        )
    names = spec_cls.build_metric_definitions({"cpu_bytes_to_use": 1, "secondary_tiers": []})
    assert "vllm:kv_offload_tiering_chunk_hits" in names


def test_engine_offloading_spec_stays_private(tmp_path: Path) -> None:
    from offload_engine.connectors.vllm import EngineOffloadingSpec

    config = offloading_config({"cpu_bytes_to_use": 1 << 20})
    spec = EngineOffloadingSpec(config)
    assert not spec._uses_shared_region() and spec.replicated_layout is False
    worker = spec.get_worker(fake_canonical_kv_caches(num_blocks=8, groups=GROUPS))
    try:
        assert not hasattr(worker, "region")
        assert worker.bridge._tier.contiguous
    finally:
        worker.shutdown()
    assert not any(t.name.startswith("offload-engine") for t in threading.enumerate())
