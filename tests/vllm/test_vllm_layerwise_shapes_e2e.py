"""End to end: layer-wise loads and stores under the prompt shapes a server sees.

Each prompt of the second round is the first round's prompt (now evicted from
vLLM's small cache, so a hit in the tier) with 48 new words after it: the step that
loads the hit also computes new tokens that fill a block, so vLLM's scheduler
builds a store for the request beside its load. vLLM 0.32's scheduler asserts that
no load is pending when it builds a store; a layer-wise load ends inside that very
step, and the connector keeps the books square (``connectors/vllm/scheduling.py``).
The shapes add what servers do on top: prefill chunks of 64 tokens (the 148-token
prompts take three steps), async scheduling (vLLM's default on CUDA; the next step
is scheduled before the last one's report), batches that mix hits and misses,
preemption, and a round aborted with its loads in flight.

Every run's greedy tokens equal plain vLLM's on the same prompts and batching, its
hits came from the tier, and nothing failed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_vllm_e2e import (  # tests/vllm/ on sys.path
    LAYERWISE,
    PREEMPTING,
    SLOW_STORES,
    engine_counters,
    run_vllm,
)

pytest.importorskip("vllm.v1.kv_offload.base")

pytestmark = pytest.mark.vllm

#: the second round asks again with 48 more words (one more block and a half)
FILLS_BLOCKS = ["--suffix-words", "48"]
#: ... in prefill chunks of 64 tokens, every third prompt one never seen
CHUNKED_MIXED = [*FILLS_BLOCKS, "--max-num-batched-tokens", "64", "--fresh-prompts", "3"]
ASYNC = ["--async-scheduling"]


def engine_connector(**extra: Any) -> list[str]:
    return ["--connector", "EngineConnector", "--extra", json.dumps(extra)]


LAYERWISE_BOTH = engine_connector(load_mode="layerwise", store_mode="layerwise", layers_per_load=1)

#: name -> (the shape: the plain run's arguments too, the connector's arguments)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "fills-blocks": (FILLS_BLOCKS, LAYERWISE),
    "fills-blocks-async-layerwise-stores": ([*FILLS_BLOCKS, *ASYNC], LAYERWISE_BOTH),
    "chunked-mixed": (CHUNKED_MIXED, LAYERWISE),
    "chunked-mixed-async-layerwise-stores": ([*CHUNKED_MIXED, *ASYNC], LAYERWISE_BOTH),
    # async loads are vLLM's own bookkeeping: the same shape, for comparison
    "chunked-mixed-async-load-mode-async": (
        [*CHUNKED_MIXED, *ASYNC],
        engine_connector(load_mode="async", store_mode="layerwise"),
    ),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-shapes")


@pytest.fixture(scope="module")
def plain_run(workdir: Path) -> Callable[[list[str]], dict[str, Any]]:
    """Plain vLLM on a shape: one run per shape, shared by the cases."""
    runs: dict[tuple[str, ...], dict[str, Any]] = {}

    def run(shape: list[str]) -> dict[str, Any]:
        key = tuple(shape)
        if key not in runs:
            runs[key] = run_vllm(workdir, f"plain-{len(runs)}", workdir / "model", *shape)
        return runs[key]

    return run


def check_served(plain: dict[str, Any], run: dict[str, Any], stats_path: Path) -> dict[str, Any]:
    """``run``'s tokens are ``plain``'s, its hits came from the tier, nothing failed;
    returns the adapter's counters."""
    assert run["rounds"] == plain["rounds"]
    assert plain["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert run["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert run["metrics"]["vllm:kv_offload_load_bytes"] > 0
    engine, adapter = engine_counters(stats_path, run)
    assert engine["stores_succeeded"] > 0
    return adapter


@pytest.mark.parametrize("case", list(CASES))
def test_layerwise_hits_beside_new_blocks_match_plain_vllm(
    workdir: Path, plain_run: Callable[[list[str]], dict[str, Any]], case: str
) -> None:
    shape, connector = CASES[case]
    plain = plain_run(shape)
    stats_path = workdir / f"{case}-stats.json"
    run = run_vllm(
        workdir,
        case,
        workdir / "model",
        *shape,
        "--offload",
        *connector,
        "--stats-path",
        str(stats_path),
    )
    adapter = check_served(plain, run, stats_path)
    if "layerwise-stores" in case:
        assert adapter["store_parts_at_layer"] > 0


def test_layerwise_hits_beside_new_blocks_under_preemption_and_aborts(
    workdir: Path, plain_run: Callable[[list[str]], dict[str, Any]]
) -> None:
    """Requests outgrow the cache and are preempted (their stores flushed, their hits
    loaded again), async scheduling on, and the last round is aborted once after its
    first computed batch: every round's tokens still equal plain vLLM's."""
    shape = [*FILLS_BLOCKS, *PREEMPTING, *ASYNC]
    plain = plain_run(shape)
    stats_path = workdir / "preempt-abort-stats.json"
    run = run_vllm(
        workdir,
        "preempt-abort",
        workdir / "model",
        *shape,
        "--offload",
        *LAYERWISE_BOTH,
        *SLOW_STORES,
        "--abort-round",
        "--stats-path",
        str(stats_path),
    )
    assert plain["metrics"]["vllm:num_preemptions"] > 0
    assert run["metrics"]["vllm:num_preemptions"] > 0
    assert run["aborted"] == 12
    check_served(plain, run, stats_path)
