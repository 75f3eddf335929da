"""kv_connector_extra_config parsing: typed, frozen, and every error names its key."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from offload_engine.connectors.vllm.config import (
    DEFAULT_QUEUE_CAPACITY,
    DEFAULT_STAGING_BYTES,
    ENGINE_CONNECTOR_KEY,
    EngineOffloadingConfig,
    parse_extra_config,
)
from offload_engine.errors import ConfigError

BASE = {"cpu_bytes_to_use": 1 << 30}


def test_defaults() -> None:
    cfg = parse_extra_config(BASE)
    assert cfg == EngineOffloadingConfig(cpu_bytes_to_use=1 << 30)
    assert cfg.blocks_per_chunk == 1
    assert cfg.eviction_policy == "lru"
    assert cfg.strategy == "auto"
    assert cfg.staging_bytes == DEFAULT_STAGING_BYTES
    assert cfg.queue_capacity == DEFAULT_QUEUE_CAPACITY
    assert cfg.job_timeout_s is None
    assert cfg.host_workers == 1
    assert cfg.stats_path is None
    assert cfg.offload_prompt_only is True


def test_every_key_parsed() -> None:
    cfg = parse_extra_config(
        {
            "spec_name": "EngineOffloadingSpec",  # vLLM's own keys are left alone
            "spec_module_path": "offload_engine.connectors.vllm",
            "cpu_bytes_to_use": 4e9,  # JSON numbers may arrive as floats
            "blocks_per_chunk": 4,
            "eviction_policy": "arc",
            "store_threshold": 2,
            "max_tracker_size": 1000,
            "offload_prompt_only": False,
            "strategy": "staged",
            "staging_bytes": "1048576",
            "submitter_launch": True,
            "polled_completion": True,
            "native_launch": "auto",
            "job_timeout_s": 2.5,
            "queue_capacity": 64,
            "host_workers": 2,
            "stats_path": "/tmp/stats-{rank}.json",
        }
    )
    assert cfg == EngineOffloadingConfig(
        cpu_bytes_to_use=4_000_000_000,
        blocks_per_chunk=4,
        eviction_policy="arc",
        store_threshold=2,
        max_tracker_size=1000,
        offload_prompt_only=False,
        strategy="staged",
        staging_bytes=1 << 20,
        submitter_launch=True,
        polled_completion=True,
        native_launch="auto",
        job_timeout_s=2.5,
        queue_capacity=64,
        host_workers=2,
        stats_path="/tmp/stats-{rank}.json",
    )


@pytest.mark.parametrize(
    ("value", "want"), [(None, None), ("auto", "auto"), ([], ()), ([3, 1], (3, 1))]
)
def test_peers_and_their_sizes(value: Any, want: Any) -> None:
    cfg = parse_extra_config(
        {**BASE, "peers": value, "peer_staging_bytes": "33554432", "peer_min_blocks": 32}
    )
    assert (cfg.peers, cfg.peer_staging_bytes, cfg.peer_min_blocks) == (want, 32 << 20, 32)
    unset = parse_extra_config(BASE)
    assert (unset.peers, unset.peer_staging_bytes, unset.peer_min_blocks) == (None, None, None)
    assert unset.peer_ledger is None
    assert parse_extra_config({**BASE, "peer_ledger": True}).peer_ledger is True


def test_peers_refuse_the_native_launch_asked_for() -> None:
    with pytest.raises(ConfigError, match="'peers' needs 'native_launch' false"):
        parse_extra_config({**BASE, "peers": "auto", "native_launch": True})
    assert parse_extra_config({**BASE, "peers": [1], "native_launch": False}).peers == (1,)


def test_frozen() -> None:
    cfg = parse_extra_config(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.queue_capacity = 3  # type: ignore[misc]


def test_vllms_resolved_blocks_per_chunk_wins() -> None:
    # vLLM resolves blocks_per_chunk from 'block_size' (tokens) or 'blocks_per_chunk'
    cfg = parse_extra_config({**BASE, "block_size": 64}, blocks_per_chunk=2)
    assert cfg.blocks_per_chunk == 2


def test_missing_cpu_bytes_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'cpu_bytes_to_use'\] is required"):
        parse_extra_config({"spec_name": "EngineOffloadingSpec"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cpu_bytes_to_use", 0),
        ("cpu_bytes_to_use", -5),
        ("cpu_bytes_to_use", "lots"),
        ("cpu_bytes_to_use", True),
        ("cpu_bytes_to_use", 1.5),
        ("blocks_per_chunk", 0),
        ("block_size", "x"),
        ("eviction_policy", ""),
        ("eviction_policy", 3),
        ("cache_policy_module_path", ["a"]),
        ("store_threshold", -1),
        ("max_tracker_size", 0),
        ("offload_prompt_only", "false"),
        ("canonical_layout", "yes"),
        ("strategy", "fastest"),
        ("strategy", 1),
        ("native_launch", "true"),
        ("native_launch", 1),
        ("staging_bytes", 0),
        ("job_timeout_s", 0),
        ("job_timeout_s", float("inf")),
        ("job_timeout_s", "soon"),
        ("queue_capacity", 0),
        ("queue_capacity", 2.5),
        ("host_workers", 0),
        ("stats_path", 7),
        ("stats_path", "/tmp/{pid}.json"),
        ("load_mode", "eager"),
        ("load_mode", 1),
        ("layers_per_load", 0),
        ("layers_per_load", "all"),
        ("store_mode", "eager"),
        ("store_mode", "async"),
        ("store_mode", 1),
        ("peers", "all"),
        ("peers", 1),
        ("peers", [1, -1]),
        ("peers", [1, 1]),
        ("peers", [True]),
        ("peers", [1.5]),
        ("peer_staging_bytes", 0),
        ("peer_min_blocks", 0),
        ("peer_ledger", "true"),
        ("peer_ledger", 1),
    ],
)
def test_invalid_value_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\['{key}'\]") as info:
        parse_extra_config({**BASE, key: value})
    assert repr(value) in str(info.value)


def test_all_problems_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_extra_config({"queue_capacity": -1, "strategy": "nope", "host_workers": "two"})
    message = str(info.value)
    for key in ("cpu_bytes_to_use", "queue_capacity", "strategy", "host_workers"):
        assert f"'{key}'" in message
    assert message.count("\n") == 4


def test_canonical_layout_refused() -> None:
    with pytest.raises(ConfigError, match="canonical_layout'\\] is not supported"):
        parse_extra_config({**BASE, "canonical_layout": True})
    assert parse_extra_config({**BASE, "canonical_layout": False}) == parse_extra_config(BASE)


def test_block_size_and_blocks_per_chunk_exclusive() -> None:
    with pytest.raises(ConfigError, match="only one of 'blocks_per_chunk' and 'block_size'"):
        parse_extra_config({**BASE, "blocks_per_chunk": 2, "block_size": 64})


def test_none_means_default() -> None:
    cfg = parse_extra_config({**BASE, "job_timeout_s": None, "queue_capacity": None})
    assert cfg.job_timeout_s is None
    assert cfg.queue_capacity == DEFAULT_QUEUE_CAPACITY


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_extra_config(["cpu_bytes_to_use"])  # type: ignore[arg-type]


def test_layerwise_load_mode_needs_engine_connector() -> None:
    with pytest.raises(ConfigError, match=r"\['load_mode'\]='layerwise' needs .*EngineConnector"):
        parse_extra_config({**BASE, "load_mode": "layerwise"})
    cfg = parse_extra_config(
        {**BASE, "load_mode": "layerwise", "layers_per_load": 4, ENGINE_CONNECTOR_KEY: True}
    )
    assert (cfg.load_mode, cfg.layers_per_load) == ("layerwise", 4)
    assert parse_extra_config(BASE).load_mode == "async"


def test_layerwise_store_mode_needs_engine_connector() -> None:
    with pytest.raises(ConfigError, match=r"\['store_mode'\]='layerwise' needs .*EngineConnector"):
        parse_extra_config({**BASE, "store_mode": "layerwise"})
    cfg = parse_extra_config({**BASE, "store_mode": "layerwise", ENGINE_CONNECTOR_KEY: True})
    assert (cfg.store_mode, cfg.load_mode) == ("layerwise", "async")
    assert parse_extra_config(BASE).store_mode == "step"
    assert parse_extra_config({**BASE, "store_mode": "step"}).store_mode == "step"
