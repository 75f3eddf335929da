"""End to end: layer-wise loads under real vLLM (CPU backend) for other attention kinds.

The reference is plain vLLM whose own KV cache is large enough that the second
round's prefixes are hits in it; the layer-wise run has a small cache, so its
second round loads the same prefixes from the engine's tier, layer by layer.
Both compute the new tokens over a cached prefix, one request at a time, so
with the same KV bytes they take the same kernels on the same batches: their
greedy tokens must be equal even in bf16, where a recomputed prefix (or another
batch) would round differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_vllm_e2e import LAYERWISE, run_vllm  # tests/vllm/ is on sys.path
from tiny_model import build_tiny_mla

pytest.importorskip("vllm.v1.kv_offload.base")

pytestmark = pytest.mark.vllm

#: one request at a time, so both runs compute the same batches
ONE_AT_A_TIME = ["--max-num-seqs", "1"]


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mla(tmp_path_factory.mktemp("vllm-mla") / "model")


def _hits_from(run: dict[str, Any]) -> tuple[int, int]:
    metrics = run["metrics"]
    return metrics["vllm:prefix_cache_hits"], metrics["vllm:external_prefix_cache_hits"]


def test_mla_layerwise_loads_match_vllms_own_prefix_hits(mla_model: Path, tmp_path: Path) -> None:
    """DeepSeek-V2's MLA cache (one latent tensor per layer) through EngineConnector
    with ``load_mode: layerwise``: the tokens equal plain vLLM's with its own prefix
    hits, and every hit of the second round came from the tier."""
    common = ["--dtype", "bfloat16", *ONE_AT_A_TIME]
    plain = run_vllm(tmp_path, "mla-plain", mla_model, *common, "--gpu-blocks", "64")
    stats_path = tmp_path / "mla-layerwise-stats.json"
    run = run_vllm(
        tmp_path,
        "mla-layerwise",
        mla_model,
        *common,
        "--gpu-blocks",
        "16",
        "--offload",
        *LAYERWISE,
        "--stats-path",
        str(stats_path),
    )
    local_hits, _ = _hits_from(plain)
    assert local_hits > 0, "the reference's second round found no prefix in its own cache"
    own, external = _hits_from(run)
    assert own == 0 and external == local_hits
    assert run["rounds"] == plain["rounds"]

    stats = json.loads(stats_path.read_text())
    engine, adapter = stats["engine"], stats["adapter"]
    assert engine["loads_succeeded"] > 0 and engine["bytes_loaded"] > 0
    assert all(h["failed"] == 0 for h in engine["handlers"])
    assert adapter["failures_delivered"] == 0 and adapter["live_jobs"] == 0
    assert run["metrics"]["vllm:kv_offload_load_bytes"] == engine["bytes_loaded"]
