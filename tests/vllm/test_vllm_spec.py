"""EngineOffloadingSpec inside real vLLM classes (in-process, no model run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import vllm_configs

from offload_engine import ConfigError, LayoutError
from offload_engine.connectors.vllm.testing import fake_canonical_kv_caches, page_bytes

pytestmark = [
    pytest.mark.vllm,
    # importing vLLM's platform layer imports torch modules that warn at import time
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SPEC_KEYS = {
    "spec_name": "EngineOffloadingSpec",
    "spec_module_path": "offload_engine.connectors.vllm",
}


def offloading_config(extra: dict[str, Any], **kwargs: Any) -> Any:
    return vllm_configs.offloading_config(extra, spec_keys=SPEC_KEYS, **kwargs)


@pytest.fixture(scope="module")
def spec_cls() -> Any:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    # exactly how vLLM's OffloadingConnector finds it: by name, from the module path
    return OffloadingSpecFactory.get_spec_cls(SPEC_KEYS)


def test_vllm_finds_the_spec_by_name(spec_cls: Any) -> None:
    from offload_engine.connectors.vllm import EngineOffloadingSpec

    assert spec_cls is EngineOffloadingSpec


def test_scheduler_side_is_vllms_manager_and_policy(spec_cls: Any) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy

    spec = spec_cls(offloading_config({"cpu_bytes_to_use": 1 << 22, "eviction_policy": "arc"}))
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert isinstance(manager._policy, ARCCachePolicy)
    assert spec.num_chunks > 0
    assert spec.engine_config.eviction_policy == "arc"
    assert spec.replicated_layout is False


@pytest.mark.parametrize(
    ("extra", "kwargs", "match"),
    [
        ({}, {}, r"\['cpu_bytes_to_use'\] is required"),
        ({"cpu_bytes_to_use": 1 << 22, "queue_capacity": 0}, {}, r"\['queue_capacity'\]"),
        ({"cpu_bytes_to_use": 1 << 22, "eviction_policy": "mru"}, {}, r"\['eviction_policy'\]"),
        ({"cpu_bytes_to_use": 100}, {}, r"\['cpu_bytes_to_use'\]=100 holds no offload chunk"),
        (
            {"cpu_bytes_to_use": 1 << 22, "stats_path": "/tmp/s.json"},
            {"world_size": 2},
            r"\['stats_path'\].*must contain '\{rank\}'",
        ),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(
    spec_cls: Any, extra: dict[str, Any], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        spec_cls(offloading_config(extra, **kwargs))


def test_vllms_cpu_spec_refuses_this_platform_and_ours_does_not(spec_cls: Any) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    config = offloading_config({"cpu_bytes_to_use": 1 << 22})
    kv = fake_canonical_kv_caches(num_blocks=16)
    with pytest.raises(Exception, match="only supported on CUDA-alike"):
        CPUOffloadingSpec(config).get_worker(kv)
    spec = spec_cls(config)
    worker = spec.get_worker(kv)
    try:
        assert spec.get_worker(kv) is worker
    finally:
        worker.shutdown()


def test_worker_round_trip_through_vllm_specs(spec_cls: Any, tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    stats = tmp_path / "stats.json"
    spec = spec_cls(
        offloading_config(
            {"cpu_bytes_to_use": 1 << 22, "stats_path": str(stats)}, blocks_per_chunk=2
        )
    )
    kv = fake_canonical_kv_caches(num_blocks=16, groups=(((0, 240), (1, 240)), ((2, 160),)))
    worker = spec.get_worker(kv)
    want = [page_bytes(kv, 0, b) for b in (1, 2, 3)] + [page_bytes(kv, 1, b) for b in (4, 5)]
    # group 0: blocks 1-3 at logical 1..3 (2 chunks); group 1: blocks 4-5 at 0..1 (1 chunk)
    store = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[3, 2], block_indices=[1, 0])
    assert worker.submit_store(0, store, CPULoadStoreSpec([5, 6, 7]))
    worker.wait({0, 12345})
    load = GPULoadStoreSpec([9, 10, 11, 12, 13], group_sizes=[3, 2], block_indices=[1, 0])
    assert worker.submit_load(1, CPULoadStoreSpec([5, 6, 7]), load)
    worker.wait({1})
    results = worker.get_finished()
    assert [r.job_id for r in results] == [0, 1]
    assert all(isinstance(r, VllmTransferResult) and r.success for r in results)
    assert results[0].transfer_size == results[1].transfer_size == 3 * 480 + 2 * 160
    assert worker.get_finished() == []
    got = [page_bytes(kv, 0, b) for b in (9, 10, 11)] + [page_bytes(kv, 1, b) for b in (12, 13)]
    assert got == want
    # a spec that does not fit is refused (False) with the typed error logged
    bad = GPULoadStoreSpec([1], group_sizes=[1, 0], block_indices=[0, 0])
    assert not worker.submit_store(2, bad, CPULoadStoreSpec([10**6]))
    worker.shutdown()
    data = json.loads(stats.read_text())
    assert data["engine"]["loads_succeeded"] == 1
    assert data["engine"]["bytes_loaded"] == 3 * 480 + 2 * 160
    assert data["adapter"]["submits_refused"] == 1


def test_layout_refused_at_registration(spec_cls: Any) -> None:
    import torch

    from offload_engine.connectors.vllm.testing import FakeCanonicalKVCacheTensor

    spec = spec_cls(offloading_config({"cpu_bytes_to_use": 1 << 22}))
    kv = fake_canonical_kv_caches(num_blocks=8, padded_pages=(64, 64), groups=(((0, 64), (1, 64)),))
    kv.tensors[1] = FakeCanonicalKVCacheTensor(torch.zeros(5, 64, dtype=torch.int8), 64)
    with pytest.raises(LayoutError, match=r"shape \(5, 64\)"):
        spec.get_worker(kv)
