"""End to end: layer-wise loads under real vLLM (CPU backend) for other attention kinds.

The reference is plain vLLM whose own KV cache is large enough that the second
round's prefixes are hits in it; the layer-wise run has a small cache, so its
second round loads the same prefixes from the engine's tier, layer by layer.
Both compute the new tokens over a cached prefix, one request at a time, so
with the same KV bytes they take the same kernels on the same batches: their
greedy tokens must be equal even in bf16, where a recomputed prefix (or another
batch) would round differently.

vLLM's CPU MLA backend turns prefix caching off on a CPU without AMX (its
reference kernels then also make blocks of 16 tokens). There the reference is
the same model loading the same prefixes from the tier before the forward pass
(``load_mode: async``): the same KV bytes under the same kernels and batches.

A Mamba hybrid is refused by layer-wise loads (vLLM reads a hit's Mamba state
before the forward pass; see ``EngineConnector``): its state and attention blocks
come back through ``async`` loads, and go out through layer-wise stores.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_vllm_e2e import engine_counters, run_vllm  # tests/vllm/ is on sys.path
from tiny_model import build_tiny_mamba_hybrid, build_tiny_mla, build_tiny_sliding

pytest.importorskip("vllm.v1.kv_offload.base")

pytestmark = pytest.mark.vllm

#: one part per layer (these models have 2 and 4 layers; the default part is 4 layers)
LAYER_BY_LAYER = [
    "--connector",
    "EngineConnector",
    "--extra",
    '{"load_mode": "layerwise", "layers_per_load": 1}',
]
#: one request at a time, so both runs compute the same batches
ONE_AT_A_TIME = ["--max-num-seqs", "1"]

#: name -> (builder, the layer-wise run's arguments, the plain run's KV cache in blocks)
MODELS: dict[str, tuple[Callable[[Path], Path], list[str], int]] = {
    # DeepSeek-V2's MLA cache: one latent tensor per layer, bf16. 32 blocks: room for
    # one request of the model's 256 tokens also where vLLM's CPU MLA backend makes
    # blocks of 16 tokens (16 such blocks hold 240, less the block vLLM keeps back as
    # its null block), too few to keep the first round's prefixes
    "mla": (build_tiny_mla, ["--dtype", "bfloat16", "--gpu-blocks", "32"], 128),
    # Gemma-2: sliding-window and full layers, two KV cache groups sharing the blocks
    # (24 blocks: 12 a group, room for one request of the model's 256 tokens)
    "sliding-window": (build_tiny_sliding, ["--gpu-blocks", "24"], 64),
}

#: the connector loading each hit before the forward pass, as vLLM's own offloading does
ASYNC_LOADS = ["--connector", "EngineConnector", "--extra", '{"load_mode": "async"}']


def _hits(run: dict[str, Any]) -> tuple[int, int]:
    metrics = run["metrics"]
    return metrics["vllm:prefix_cache_hits"], metrics["vllm:external_prefix_cache_hits"]


@pytest.mark.parametrize("kind", list(MODELS))
def test_layerwise_loads_match_vllms_own_prefix_hits(kind: str, tmp_path: Path) -> None:
    """EngineConnector with ``load_mode: layerwise``: the tokens equal plain vLLM's
    with its own prefix hits (or, where vLLM has no prefix caching for the model, those
    of the same prefixes loaded before the forward pass), and every hit of the second
    round came from the tier."""
    build, args, plain_blocks = MODELS[kind]
    model = build(tmp_path / "model")
    dtype = args[:2] if args[0] == "--dtype" else []
    reference = run_vllm(
        tmp_path, f"{kind}-plain", model, *dtype, *ONE_AT_A_TIME, "--gpu-blocks", str(plain_blocks)
    )
    if reference["metrics"]["vllm:prefix_cache_queries"] == 0:  # no prefix caching here
        reference = run_vllm(
            tmp_path, f"{kind}-async", model, *args, *ONE_AT_A_TIME, "--offload", *ASYNC_LOADS
        )
    stats_path = tmp_path / f"{kind}-layerwise-stats.json"
    run = run_vllm(
        tmp_path,
        f"{kind}-layerwise",
        model,
        *args,
        *ONE_AT_A_TIME,
        "--offload",
        *LAYER_BY_LAYER,
        "--stats-path",
        str(stats_path),
    )
    engine, adapter = _served_from_the_tier(reference, run, stats_path)
    # each of vLLM's loads went to the engine as parts, one per KV tensor: two at least
    # (MLA: 2 layers; Gemma-2: its groups' layers share two tensors)
    assert engine["loads_succeeded"] >= 2 * adapter["loads_submitted"]


def _served_from_the_tier(
    reference: dict[str, Any], run: dict[str, Any], stats_path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check that ``run``'s tokens equal ``reference``'s, that every prefix hit
    ``reference`` found (in its own cache, or in the tier) came from the tier in ``run``,
    and that nothing failed; the engine's and the adapter's stats."""
    hits = sum(_hits(reference))
    assert hits > 0, "the reference's second round found no prefix"
    assert _hits(run) == (0, hits)
    assert run["rounds"] == reference["rounds"]
    engine, adapter = engine_counters(stats_path, run)
    assert adapter["loads_submitted"] > 0
    return engine, adapter


#: vLLM's CPU Mamba-2 scan returns no state from inside a prefill, which prefix
#: caching asks for when a prefill crosses a block boundary: prefills go in chunks of
#: one block (32 tokens), whose states are the chunks' final states
ONE_BLOCK_A_STEP = ["--max-num-batched-tokens", "32"]


def test_a_mamba_hybrids_state_comes_back_with_identical_tokens(tmp_path: Path) -> None:
    """NemotronH (Mamba-2 and attention layers, two KV groups of different kinds) under
    EngineConnector, loads ``async`` and stores ``layerwise``: the tokens equal plain
    vLLM's with its own prefix hits, and every hit of the second round came from the tier."""
    model = build_tiny_mamba_hybrid(tmp_path / "model")
    plain = run_vllm(
        tmp_path, "hybrid-plain", model, *ONE_AT_A_TIME, *ONE_BLOCK_A_STEP, "--gpu-blocks", "64"
    )
    stats_path = tmp_path / "hybrid-stats.json"
    run = run_vllm(
        tmp_path,
        "hybrid-offload",
        model,
        *ONE_AT_A_TIME,
        *ONE_BLOCK_A_STEP,
        # 24 blocks: 12 a group, too few to keep the first round's prefixes
        "--gpu-blocks",
        "24",
        "--offload",
        "--connector",
        "EngineConnector",
        "--extra",
        '{"store_mode": "layerwise", "layers_per_load": 1}',
        "--stats-path",
        str(stats_path),
    )
    _, adapter = _served_from_the_tier(plain, run, stats_path)
    # each store in two parts (one a tensor; each tensor holds a Mamba layer, which
    # vLLM does not hook, so every part goes out when the forward pass is over)
    assert adapter["store_parts_at_step_end"] == 2 * adapter["stores_submitted"] > 0
