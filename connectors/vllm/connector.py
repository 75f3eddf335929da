"""``EngineConnector``: vLLM's OffloadingConnector, with loads inside the forward pass.

Load it by module path (no patching)::

    --kv-transfer-config '{"kv_connector": "EngineConnector",
      "kv_connector_module_path": "offload_engine.connectors.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 4000000000, "load_mode": "layerwise"}}'

The scheduler side is vLLM's OffloadingConnector (its policies, its tiering) over
one of this package's specs, ``EngineOffloadingSpec`` by default, and every key of
those specs works as it does under vLLM's connector. ``load_mode`` chooses:

- ``"async"`` (the default): vLLM's own behaviour. A request whose prefix is in
  the tier waits (WAITING_FOR_REMOTE_KVS) until its load is done, and computes in
  a later step.
- ``"layerwise"``: the request is scheduled in the same step. Its load goes to the
  engine part by part in layer order (``layers_per_load`` layers a part), and each
  attention layer's ``wait_for_layer_load`` orders only that layer's part before
  the layer, so loading the next layers overlaps computing this one. A hit in a
  tier below host memory is first promoted by vLLM's tiering, as before. A step
  that vLLM may replay as a full CUDA graph (one token a request, under its default
  compilation) calls no ``wait_for_layer_load``: its loads are ordered whole before
  the replay (:class:`FullGraphStep`). A model with Mamba layers is refused at
  startup: vLLM reads a hit's Mamba state before the forward pass (see
  :func:`_refuse_layerwise_mamba`).

``store_mode`` chooses when the blocks a step computes are stored:

- ``"step"`` (the default): vLLM's own behaviour. The step's stores are submitted
  at the start of the next step, after the forward pass and its sampling.
- ``"layerwise"``: each store goes to the engine in the same parts as layer-wise
  loads (``layers_per_load`` layers a part, one result under vLLM's job id), each
  part submitted from ``save_kv_layer`` once the forward pass has computed all its
  layers, so storing them overlaps computing the rest; its copies wait for that
  compute on the model's stream. ``wait_for_save`` submits the parts no layer
  reached. A rank that does not write stores (a replicated layout's rank other
  than 0) reports them completed and submits nothing, as under vLLM's connector.

This module imports vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from offload_engine import ConfigError

from .compat import scheduler_books
from .config import ENGINE_CONNECTOR_KEY, parse_extra_config
from .layerwise import LayerPlan, LayerwiseLoads, LayerwiseStores, TransferJob
from .scheduling import LayerwiseScheduling, replays_full_graph
from .spec import EngineOffloadingSpec
from .tiering import EngineTieringSpec
from .worker import EngineOffloadingWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

MODULE_PATH = "offload_engine.connectors.vllm"

logger = logging.getLogger(__name__)


def _engine_extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    """The connector's ``kv_connector_extra_config``, with this package's spec as the
    default and the mark that lets a spec accept a layer-wise ``load_mode``. Refuses a
    spec that is not one of this package's (or a subclass) with :class:`ConfigError`."""
    transfer = vllm_config.kv_transfer_config
    extra = transfer.kv_connector_extra_config if transfer is not None else None
    if extra is None:
        raise ConfigError("EngineConnector needs a kv_transfer_config")
    if "spec_name" not in extra:
        extra["spec_name"] = "EngineOffloadingSpec"
    if extra["spec_name"] in ("EngineOffloadingSpec", "EngineTieringSpec"):
        extra.setdefault("spec_module_path", MODULE_PATH)
    try:
        spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    except (ValueError, ImportError, AttributeError) as exc:
        raise ConfigError(
            f"kv_connector_extra_config['spec_name']={extra.get('spec_name')!r} "
            f"(spec_module_path={extra.get('spec_module_path')!r}) does not load: {exc}"
        ) from exc
    if not issubclass(spec_cls, (EngineOffloadingSpec, EngineTieringSpec)):
        raise ConfigError(
            f"kv_connector_extra_config['spec_name']={extra['spec_name']!r}: EngineConnector "
            "moves bytes with offload-engine, so it serves EngineOffloadingSpec or "
            "EngineTieringSpec (or a subclass); use vLLM's OffloadingConnector for others"
        )
    extra[ENGINE_CONNECTOR_KEY] = True
    return extra  # type: ignore[no-any-return]


def _refuse_layerwise_mamba(kv_cache_config: Any) -> None:
    """Layer-wise loads cannot serve a KV cache with a Mamba group: raise :class:`ConfigError`.

    With prefix caching (mamba_cache_mode "align") vLLM's model runner copies a
    prefix hit's Mamba state into the request's running block in
    ``preprocess_mamba``, before the forward pass and so before ``start_load_kv``;
    a state loaded inside the forward pass lands after that copy has read the
    block. Loads in ``async`` mode are complete before the request is scheduled."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    mamba = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    if mamba:
        names = list(mamba[0].layer_names)
        layers = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        raise ConfigError(
            "kv_connector_extra_config['load_mode']='layerwise' cannot serve a model with "
            f"Mamba layers ({layers}): vLLM copies a prefix hit's Mamba state into "
            "the request's running block before the forward pass (preprocess_mamba), so a "
            "state loaded inside it comes too late; use load_mode 'async' for this model"
        )


def _transfer_job(job_id: int, *, cache: Any, tier: Any) -> TransferJob:
    """vLLM's job from its two specs: ``cache`` a ``GPULoadStoreSpec`` (block ids, group
    sizes, block indices), ``tier`` a spec of chunk ids (``CPULoadStoreSpec``)."""
    return TransferJob(
        job_id, cache.block_ids, cache.group_sizes, cache.block_indices, tier.block_ids
    )


class FullGraphStep(OffloadingConnectorMetadata):
    """The metadata of a step with layer-wise loads that vLLM may run as a full CUDA
    graph (:func:`~.scheduling.replays_full_graph`). Replaying one calls no
    ``wait_for_layer_load``, so the worker orders the step's whole loads before the
    forward pass, at ``start_load_kv``: such a step computes one token a request (or a
    few, speculative), so the overlap lost is small, and decode steps keep vLLM's full
    graphs."""


def _offloading_metadata(metadata: Any) -> OffloadingConnectorMetadata:
    if not isinstance(metadata, OffloadingConnectorMetadata):
        raise TypeError(f"expected OffloadingConnectorMetadata, got {type(metadata)}")
    return metadata


def _layer_addresses(kv_caches: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: int(t.data_ptr()) for name, t in kv_caches.items()}


class EngineConnector(OffloadingConnector):
    """vLLM's OffloadingConnector with ``load_mode`` and ``store_mode`` (see the module
    docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        extra = _engine_extra_config(vllm_config)
        # the spec parses again (with vLLM's resolved chunk size) and raises the same
        # errors; this reads the connector's own keys
        self._config = parse_extra_config(extra)
        self._layerwise = self._config.load_mode == "layerwise"
        if self._layerwise:
            _refuse_layerwise_mamba(kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._loads: LayerwiseLoads | None = None
        # the step metadata whose layer-wise loads handle_preemptions started
        self._loads_started: Any = None
        self._stores: LayerwiseStores | None = None
        # the scheduler side's per-request state for layer-wise loads
        self._scheduling = LayerwiseScheduling()
        self._graph_mode = vllm_config.compilation_config.cudagraph_mode
        self._decode_query_len = 1 + vllm_config.num_speculative_tokens
        if self._layerwise and self._graph_mode.mixed_mode() == type(self._graph_mode).FULL:
            logger.warning(
                "offload-engine: load_mode 'layerwise' under cudagraph_mode %s: every step "
                "may replay a full CUDA graph, so each step's loads complete before its "
                "forward pass (no overlap with compute); FULL_AND_PIECEWISE, vLLM's "
                "default, keeps it",
                self._graph_mode.name,
            )

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hit, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self._layerwise and hit:
            # the hit is in host memory (vLLM's tiering answers None until a promotion
            # from a lower tier is done): load it inside this step's forward pass
            self._scheduling.hit(request.request_id, num_computed_tokens)
            return hit, False
        return hit, load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        blocks = self._scheduling.allocated(
            request.request_id,
            blocks,
            num_external_tokens,
            self.scheduler.config.kv_group_configs,
        )
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        if not self._layerwise:
            return super().build_connector_meta(scheduler_output)
        # every load of a layer-wise connector ends inside its step: the stores the
        # scheduler builds beside it (this step's new blocks, later prefill chunks)
        # must not find it pending, or vLLM's scheduler asserts
        with self._scheduling.building(*scheduler_books(self.scheduler)):
            metadata = _offloading_metadata(super().build_connector_meta(scheduler_output))
        if metadata.load_jobs and replays_full_graph(
            self._graph_mode,
            self._decode_query_len,
            scheduler_output.num_scheduled_tokens.values(),
        ):
            fields = dataclasses.fields(metadata)
            return FullGraphStep(**{f.name: getattr(metadata, f.name) for f in fields})
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        self._scheduling.finished(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        self._scheduling.finished(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        layerwise_stores = self._config.store_mode == "layerwise"
        if not (self._layerwise or layerwise_stores):
            return
        worker = self.connector_worker.worker if self.connector_worker else None
        layout = worker.bridge.layout if isinstance(worker, EngineOffloadingWorker) else None
        if not isinstance(worker, EngineOffloadingWorker) or layout is None:
            key = "load_mode" if self._layerwise else "store_mode"
            raise ConfigError(
                f"kv_connector_extra_config[{key!r}]='layerwise' needs the worker of "
                "EngineOffloadingSpec or EngineTieringSpec"
            )
        bridge = worker.bridge
        plan = LayerPlan.build(layout, _layer_addresses(kv_caches), self._config.layers_per_load)
        if layerwise_stores:
            self._stores = LayerwiseStores(bridge, plan)
        if self._layerwise:
            self._loads = LayerwiseLoads(bridge, plan, timeout=self._config.job_timeout_s)
            worker.serve_layerwise(self._loads, self._record_load)

    def _record_load(self, nbytes: int, seconds: float) -> None:
        # vLLM's worker gathers the step's transfer stats here (a fresh object each step)
        meta = self.connector_worker._connector_worker_meta  # type: ignore[union-attr]
        meta.transfer_stats.load.record(nbytes, seconds)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        super().handle_preemptions(kv_connector_metadata)
        if self._loads is not None:
            # the step's first connector call: vLLM's V1 model runner makes it before
            # it updates its batch and prepares the step's inputs (milliseconds for a
            # long prefix), its V2 runner just before start_load_kv. A layer-wise
            # step's loads start here. Its cache blocks are this step's new ones, which
            # no earlier work on the model's stream still reads, and the deferred and
            # flushed stores were submitted first, as at start_load_kv.
            self._start_loads(self._loads, kv_connector_metadata)
            self._loads_started = kv_connector_metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        loads = self._loads
        if loads is None:
            super().start_load_kv(forward_context, **kwargs)
            return
        metadata = self._connector_metadata
        # the stores deferred from the last step go first, as under vLLM's connector
        self.connector_worker.start_kv_transfers(  # type: ignore[union-attr]
            dataclasses.replace(_offloading_metadata(metadata), load_jobs={})
        )
        if self._loads_started is metadata:
            self._loads_started = None
        else:
            self._start_loads(loads, metadata)
        if isinstance(metadata, FullGraphStep):
            # vLLM calls start_load_kv right before a step with such loads, on the
            # forward pass's stream
            loads.wait_all()

    def _start_loads(self, loads: LayerwiseLoads, metadata: Any) -> None:
        """Submit the step's layer-wise loads."""
        load_jobs = _offloading_metadata(metadata).load_jobs
        loads.start(
            _transfer_job(job_id, cache=entry.dst_spec, tier=entry.src_spec)
            for job_id, entry in load_jobs.items()
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._loads is not None:
            self._loads.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._stores is not None:
            self._store_step(self._stores).saved(layer_name)

    def wait_for_save(self) -> None:
        if self._loads is not None:
            self._loads.finish_step()
        if self._stores is None:
            super().wait_for_save()  # type: ignore[no-untyped-call]
            return
        # every store of the step is submitted here at the latest; vLLM's
        # prepare_store_kv, which would defer them to the next step, is not called
        self._store_step(self._stores).finish_step()

    def _store_step(self, stores: LayerwiseStores) -> LayerwiseStores:
        """The step's layer-wise stores, opened from its metadata at the step's first
        ``save_kv_layer`` (or at ``wait_for_save``). Jobs that vLLM flushed for a
        preemption were popped out of ``store_jobs`` (``handle_preemptions``, before
        the forward pass) and submitted whole; they are not among these."""
        if stores.open:
            return stores
        metadata = _offloading_metadata(self._connector_metadata)
        worker = self.connector_worker
        jobs: list[TransferJob] = []
        for job_id, entry in metadata.store_jobs.items():
            if not worker._is_store_writer:  # type: ignore[union-attr]
                # vLLM's gate: a non-writer rank's jobs count as done, nothing is moved
                worker._connector_worker_meta.mark_completed(job_id)  # type: ignore[union-attr]
                continue
            jobs.append(_transfer_job(job_id, cache=entry.src_spec, tier=entry.dst_spec))
        stores.start(jobs)
        return stores

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._loads is None:
            return set()
        return self._loads.take_invalid()
