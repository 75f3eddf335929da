"""EngineConnector's checks at startup: which spec it serves, with vLLM's spec factory."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from offload_engine import ConfigError
from offload_engine.connectors.vllm.config import ENGINE_CONNECTOR_KEY

pytestmark = [
    pytest.mark.vllm,
    # importing vLLM's platform layer imports torch modules that warn at import time
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def _engine_extra_config(vllm_config: Any) -> dict[str, Any]:
    from offload_engine.connectors.vllm.connector import _engine_extra_config as check

    return check(vllm_config)


def config(extra: dict[str, Any]) -> Any:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_the_default_spec_is_engine_offloading_spec() -> None:
    extra = _engine_extra_config(config({"cpu_bytes_to_use": 1 << 20}))
    assert extra["spec_name"] == "EngineOffloadingSpec"
    assert extra["spec_module_path"] == "offload_engine.connectors.vllm"
    assert extra[ENGINE_CONNECTOR_KEY] is True


def test_the_tiering_spec_is_served() -> None:
    extra = _engine_extra_config(config({"spec_name": "EngineTieringSpec"}))
    assert extra["spec_module_path"] == "offload_engine.connectors.vllm"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"spec_name": "CPUOffloadingSpec"}, "serves EngineOffloadingSpec or EngineTieringSpec"),
        ({"spec_name": "Nope", "spec_module_path": "offload_engine"}, "does not load"),
        ({"spec_name": "Nope"}, "does not load"),
    ],
)
def test_a_spec_it_cannot_serve_is_one_config_error(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=rf"\['spec_name'\].*{match}"):
        _engine_extra_config(config(extra))


def test_it_is_vllms_offloading_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from offload_engine.connectors.vllm import EngineConnector

    assert issubclass(EngineConnector, OffloadingConnector)
    # the hooks vLLM's attention layers call (kv_transfer_utils.maybe_transfer_kv_layer)
    for hook in ("wait_for_layer_load", "save_kv_layer", "start_load_kv", "wait_for_save"):
        assert callable(getattr(EngineConnector, hook))


@pytest.mark.parametrize(("key", "value"), [("store_mode", "eager"), ("load_mode", "eager")])
def test_an_unknown_mode_is_one_config_error_at_startup(key: str, value: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from offload_engine.connectors.vllm import EngineConnector

    extra = {"cpu_bytes_to_use": 1 << 20, key: value}
    with pytest.raises(ConfigError, match=rf"\['{key}'\] must be one of") as info:
        EngineConnector(config(extra), KVConnectorRole.WORKER, None)  # type: ignore[arg-type]
    assert str(info.value).count("\n") == 1  # that key alone


def test_layerwise_stores_on_a_worker_that_cannot_serve_them_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from offload_engine.connectors.vllm import EngineConnector
    from offload_engine.connectors.vllm.config import parse_extra_config

    monkeypatch.setattr(OffloadingConnector, "register_kv_caches", lambda self, caches: None)
    connector = EngineConnector.__new__(EngineConnector)
    connector._config = parse_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "store_mode": "layerwise", ENGINE_CONNECTOR_KEY: True}
    )
    connector._layerwise = False
    # a worker of another spec (vLLM's own CPU worker, say)
    connector.connector_worker = SimpleNamespace(worker=object())  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"\['store_mode'\]='layerwise' needs the worker"):
        connector.register_kv_caches({})


def _kv_cache_config(*specs: Any) -> Any:
    groups = [
        SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.mixer"])
        for i, spec in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def test_layerwise_loads_refuse_a_mamba_model_at_startup() -> None:
    """vLLM copies a hit's Mamba state before the forward pass: one ConfigError, at once."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from offload_engine.connectors.vllm import EngineConnector

    attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    extra = {"cpu_bytes_to_use": 1 << 20, "load_mode": "layerwise"}
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"\['load_mode'\]='layerwise'.*Mamba layers"):
            EngineConnector(config(dict(extra)), role, _kv_cache_config(mamba, attention))
    # attention groups alone (sliding window, MLA, ...) are served
    from offload_engine.connectors.vllm.connector import _refuse_layerwise_mamba

    _refuse_layerwise_mamba(_kv_cache_config(attention, attention))


def _load_step(job_id: int) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )

    cache = SimpleNamespace(block_ids=[4, 5], group_sizes=[2], block_indices=[0])
    tier = SimpleNamespace(block_ids=[7, 9])
    job = TransferJob(req_id="r", src_spec=tier, dst_spec=cache)  # type: ignore[arg-type]
    return OffloadingConnectorMetadata(load_jobs={job_id: job}, store_jobs={})


def test_a_layerwise_steps_loads_start_in_handle_preemptions_once() -> None:
    """vLLM's execute_model calls handle_preemptions before it prepares the step: a
    layer-wise connector submits the step's loads there, after vLLM's worker has
    submitted (and for reused blocks waited for) the stores, and start_load_kv of the
    same step submits the stores left but no load again. A step whose
    handle_preemptions did not run still loads at start_load_kv."""
    from offload_engine.connectors.vllm.connector import EngineConnector

    step = _load_step
    calls: list[tuple[str, Any]] = []

    class Loads:
        def start(self, jobs: Any) -> None:
            calls.append(("loads", [(j.job_id, list(j.cache_ids), list(j.tier_ids)) for j in jobs]))

    class Worker:
        def handle_preemptions(self, metadata: Any) -> None:
            calls.append(("preemptions", sorted(metadata.load_jobs)))

        def start_kv_transfers(self, metadata: Any) -> None:
            calls.append(("transfers", sorted(metadata.load_jobs)))

    connector = object.__new__(EngineConnector)
    connector._loads = Loads()  # type: ignore[assignment]
    connector._loads_started = None
    connector.connector_worker = Worker()  # type: ignore[assignment]
    first = step(1)
    connector.handle_preemptions(first)
    connector._connector_metadata = first
    connector.start_load_kv(None)
    assert calls == [
        ("preemptions", [1]),
        ("loads", [(1, [4, 5], [7, 9])]),
        ("transfers", []),
    ]
    calls.clear()
    second = step(2)
    connector._connector_metadata = second
    connector.start_load_kv(None)
    assert calls == [("transfers", []), ("loads", [(2, [4, 5], [7, 9])])]


def test_which_steps_vllm_may_replay_as_a_full_cuda_graph() -> None:
    """A full CUDA graph replays the attention without ``wait_for_layer_load``. Under
    vLLM's default (full graphs for decode batches, piecewise for the rest) that is a
    step whose every request has one token (1 + speculative ones): a hit followed by a
    single new token among decodes. ``FULL`` may replay any step; eager and piecewise
    graphs none."""
    from vllm.config.compilation import CUDAGraphMode as M

    from offload_engine.connectors.vllm.scheduling import replays_full_graph

    for mode in (M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY):
        assert replays_full_graph(mode, 1, [1])
        assert replays_full_graph(mode, 1, [1, 1, 1])
        assert not replays_full_graph(mode, 1, [1, 64])
        assert not replays_full_graph(mode, 1, [2048])
        assert not replays_full_graph(mode, 1, [])
        # three speculative tokens: four a request, and fewer counts too
        assert replays_full_graph(mode, 4, [4, 4, 1])
        assert not replays_full_graph(mode, 4, [4, 5])
    for tokens in ([1], [1, 64], [2048]):
        assert replays_full_graph(M.FULL, 1, tokens)
        assert not replays_full_graph(M.PIECEWISE, 1, tokens)
        assert not replays_full_graph(M.NONE, 1, tokens)


def test_a_step_that_may_replay_a_full_graph_orders_its_whole_loads_before_it() -> None:
    """The scheduler side marks a layer-wise step that vLLM may run as a full CUDA
    graph (a hit and one new token); the worker then orders every part of its loads on
    the model's stream at ``start_load_kv``, before the replay. Any other step, and a
    step without loads, is vLLM's metadata as it is, and its parts wait layer by layer."""
    from vllm.config.compilation import CUDAGraphMode

    from offload_engine.connectors.vllm.connector import EngineConnector, FullGraphStep
    from offload_engine.connectors.vllm.scheduling import LayerwiseScheduling

    built: list[Any] = []

    class Scheduler:
        def __init__(self) -> None:
            self._req_status: dict[str, Any] = {}
            self._jobs: dict[int, Any] = {}
            self._current_batch_load_jobs: dict[int, Any] = {}

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return built.pop()

    connector = object.__new__(EngineConnector)
    connector._layerwise = True
    connector._scheduling = LayerwiseScheduling()
    connector.connector_scheduler = Scheduler()  # type: ignore[assignment]
    connector._graph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    connector._decode_query_len = 1

    def meta(tokens: dict[str, int], job_id: int | None = 1) -> Any:
        built.append(
            _load_step(job_id)
            if job_id is not None
            else dataclasses.replace(_load_step(0), load_jobs={})
        )
        out = connector.build_connector_meta(SimpleNamespace(num_scheduled_tokens=tokens))
        assert not built
        return out

    one = meta({"hit": 1, "decode": 1})
    assert isinstance(one, FullGraphStep)
    assert sorted(one.load_jobs) == [1] and one.store_jobs == {}
    assert not isinstance(meta({"hit": 64, "decode": 1}), FullGraphStep)
    assert not isinstance(meta({"decode": 1}, job_id=None), FullGraphStep)
    connector._graph_mode = CUDAGraphMode.PIECEWISE
    assert not isinstance(meta({"hit": 1}), FullGraphStep)

    calls: list[str] = []

    class Loads:
        def start(self, jobs: Any) -> None:
            calls.append(f"loads {[j.job_id for j in jobs]}")

        def wait_all(self) -> None:
            calls.append("wait all")

    class Worker:
        def handle_preemptions(self, metadata: Any) -> None:
            pass

        def start_kv_transfers(self, metadata: Any) -> None:
            calls.append("stores")

    connector._loads = Loads()  # type: ignore[assignment]
    connector._loads_started = None
    connector.connector_worker = Worker()  # type: ignore[assignment]
    connector.handle_preemptions(one)  # the loads start here ...
    connector._connector_metadata = one
    connector.start_load_kv(None)  # ... and are ordered whole here
    assert calls == ["loads [1]", "stores", "wait all"]
    calls.clear()
    connector.start_load_kv(None)  # no handle_preemptions before it
    assert calls == ["stores", "loads [1]", "wait all"]
    calls.clear()
    connector._connector_metadata = _load_step(2)
    connector.start_load_kv(None)
    assert calls == ["stores", "loads [2]"]
