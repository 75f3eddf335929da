"""End to end: real vLLM (CPU) with EngineTieringSpec + EngineDiskTier, across processes.

Run A serves the prompts twice with the disk tier under vLLM's tiering: the
chunks cascade from the host tier to disk. Run B is a fresh process on the same
directory, with an empty host tier: its prefix hits can only come from disk.
Run C is B again under EngineConnector with layer-wise loads of what vLLM promotes
from disk. Greedy token ids must equal plain vLLM's in every round of every run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

import offload_engine.connectors.vllm

if "EngineTieringSpec" not in offload_engine.connectors.vllm.__all__:
    pytest.skip("needs EngineTieringSpec (issue [tiering])", allow_module_level=True)

from test_vllm_e2e import run_vllm  # tests/vllm is on sys.path (no __init__.py)

pytestmark = pytest.mark.vllm

#: what vLLM logs when a view of its shared offload region outlives our tier's shutdown
REGION_NOT_CLOSED = "Failed to close mmap_obj"


def closed_cleanly(run: dict[str, Any]) -> bool:
    return REGION_NOT_CLOSED not in Path(run["log"]).read_text()


PROMPTS = ["--num-prompts", "12", "--prompt-words", "100", "--max-tokens", "8"]


def tiering_args(
    kv_dir: Path, rounds: int, load_mode: str = "async", store_mode: str = "step"
) -> list[str]:
    tier = {
        "type": "EngineDiskTier",
        "module_path": "offload_engine.connectors.vllm",
        "path": str(kv_dir),
        "capacity_bytes": 200_000_000,
    }
    return [
        "--offload",
        "--spec-name",
        "EngineTieringSpec",
        "--spec-module",
        "offload_engine.connectors.vllm",
        *(
            ["--connector", "EngineConnector"]
            if (load_mode, store_mode) != ("async", "step")
            else []
        ),
        "--extra",
        json.dumps({"secondary_tiers": [tier], "load_mode": load_mode, "store_mode": store_mode}),
        *PROMPTS,
        "--rounds",
        str(rounds),
    ]


def test_hits_come_from_disk_in_a_fresh_process_with_identical_tokens(tmp_path: Path) -> None:
    model = tmp_path / "model"
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    plain: dict[str, Any] = run_vllm(tmp_path, "plain", model, *PROMPTS, "--rounds", "1")
    first = run_vllm(tmp_path, "disk-a", model, *tiering_args(kv_dir, 2))
    second = run_vllm(tmp_path, "disk-b", model, *tiering_args(kv_dir, 1))
    # a fresh process again, loading layer by layer what vLLM promotes from disk
    third = run_vllm(tmp_path, "disk-c", model, *tiering_args(kv_dir, 1, "layerwise"))
    want = plain["rounds"][0]
    assert len(want) == 12
    assert first["rounds"] == [want, want]
    assert second["rounds"] == [want]
    assert plain["metrics"]["vllm:external_prefix_cache_hits"] == 0
    # run A wrote chunks to disk ...
    assert first["metrics"]["vllm:kv_offload_tiering_write_bytes"] > 0
    # (a new directory: the segment layout, records in preallocated segment files)
    assert list(kv_dir.joinpath("segments").glob("*.seg"))
    # ... which run B, with a fresh host tier, read back as external prefix hits
    assert second["metrics"]["vllm:prefix_cache_hits"] == 0
    assert second["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0
    assert second["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert third["rounds"] == [want]
    assert third["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0
    assert third["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert third["metrics"]["vllm:kv_offload_load_bytes"] > 0
    # the scheduler process closed vLLM's shared offload region at each exit
    assert closed_cleanly(first), first["log"]
    assert closed_cleanly(second), second["log"]
    assert closed_cleanly(third), third["log"]


def test_layerwise_stores_reach_disk_and_come_back_in_a_fresh_process(tmp_path: Path) -> None:
    """Stores sent layer by layer (from ``save_kv_layer``) land in the host tier, from
    which vLLM's tiering writes them to disk: the second round hits the host tier, and
    a fresh process hits the files."""
    model = tmp_path / "model"
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    plain: dict[str, Any] = run_vllm(tmp_path, "plain", model, *PROMPTS, "--rounds", "1")
    first = run_vllm(
        tmp_path, "lw-a", model, *tiering_args(kv_dir, 2, "layerwise", store_mode="layerwise")
    )
    second = run_vllm(tmp_path, "lw-b", model, *tiering_args(kv_dir, 1, "layerwise"))
    want = plain["rounds"][0]
    assert first["rounds"] == [want, want]
    assert first["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert first["metrics"]["vllm:kv_offload_tiering_write_bytes"] > 0
    assert second["rounds"] == [want]
    assert second["metrics"]["vllm:prefix_cache_hits"] == 0
    assert second["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0
    assert second["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert closed_cleanly(first), first["log"]
    assert closed_cleanly(second), second["log"]
