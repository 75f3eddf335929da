"""End to end: vLLM with EngineTieringSpec and two secondary tiers, EngineDiskTier then
EngineRemoteTier (Redis), in two processes.

Run A serves the prompts with its own disk directory; the chunks cascade to disk
and to Redis. Run B is a fresh process with an empty host tier and an empty disk
directory of its own: its external hits can only come from Redis. Greedy ids
equal plain vLLM's in both runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

import connectors.vllm

if not {"EngineTieringSpec", "EngineDiskTier"} <= set(connectors.vllm.__all__):
    pytest.skip("needs EngineTieringSpec and EngineDiskTier", allow_module_level=True)
if shutil.which("redis-server") is None:
    pytest.skip("needs redis-server (apt-get install redis-server)", allow_module_level=True)

from test_vllm_e2e import run_vllm  # tests/vllm is on sys.path (no __init__.py)

from offload_engine.stores import RedisServer

pytestmark = pytest.mark.vllm

PROMPTS = ["--num-prompts", "12", "--prompt-words", "100", "--max-tokens", "8"]
CPU_BYTES = 8 * 32 * 1024


def tiers_args(kv_dir: Path, server: RedisServer) -> list[str]:
    disk = {
        "type": "EngineDiskTier",
        "module_path": "connectors.vllm",
        "path": str(kv_dir),
        "capacity_bytes": 200_000_000,
    }
    remote = {
        "type": "EngineRemoteTier",
        "module_path": "connectors.vllm",
        "backend": "redis",
        "url": server.url,
        "workers": 2,
    }
    return [
        "--offload", "--spec-name", "EngineTieringSpec", "--spec-module", "connectors.vllm",
        "--cpu-bytes", str(CPU_BYTES), "--extra", json.dumps({"secondary_tiers": [disk, remote]}),
        *PROMPTS, "--rounds", "1",
    ]  # fmt: skip


def test_disk_then_remote_second_instance_hits_come_from_redis(tmp_path: Path) -> None:
    model = tmp_path / "model"
    plain: dict[str, Any] = run_vllm(tmp_path, "plain", model, *PROMPTS, "--rounds", "1")
    dir_a, dir_b = tmp_path / "kv-a", tmp_path / "kv-b"
    dir_a.mkdir()
    dir_b.mkdir()
    with RedisServer() as server:
        first = run_vllm(tmp_path, "tiers-a", model, *tiers_args(dir_a, server))
        second = run_vllm(tmp_path, "tiers-b", model, *tiers_args(dir_b, server))
    want = plain["rounds"][0]
    assert first["rounds"] == [want] and second["rounds"] == [want]
    assert list(dir_a.joinpath("objects").rglob("*.kv")), "run A wrote nothing to disk"
    assert second["metrics"]["vllm:external_prefix_cache_hits"] > 0, second["log"]
    assert second["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0
