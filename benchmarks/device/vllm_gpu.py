"""offload-engine under a real CUDA vLLM: the end-to-end check of every mode, and the
time-to-first-token and decode bench beside vLLM's own offloading.

Each command runs one vLLM engine in this process and writes a JSON result::

    python benchmarks/device/vllm_gpu.py model --out /tmp/m            # a random 4-layer Llama
    python benchmarks/device/vllm_gpu.py check --mode lw-lw --model /tmp/m --out r.json [--eager]
    python benchmarks/device/vllm_gpu.py bench --mode engine-spec --out b.json [--eager]
    python benchmarks/device/vllm_gpu.py report DIR                    # tables of DIR/*.json

``benchmarks/device/vllm_gpu.sh`` installs vLLM's CUDA build from a wheel folder and
runs these (several checks at once on one GPU). The modes (``MODES``): plain vLLM, vLLM's
``OffloadingConnector`` with its ``CPUOffloadingSpec``, with ``EngineOffloadingSpec``
and with ``EngineTieringSpec`` + ``EngineDiskTier``, and ``EngineConnector`` with each
``load_mode`` x ``store_mode``; and LMCache's ``LMCacheConnectorV1`` (``lmcache``, where
LMCache is installed: its CPU tier of the same size, 256-token chunks). Two modes take a
decode loss apart: ``null`` (``null_connector.py``: vLLM's connector path, nothing behind
it) and ``async-nostore`` (``EngineConnector`` storing nothing).

**check**: a Llama-shaped model with random weights drawn as Hugging Face draws them
(greedy ids that depend on every KV byte, unlike vLLM's dummy weights), 16-token
blocks, prefill chunks of 1,024 tokens, vLLM's default async scheduling. Six prompts
of 2,048 tokens are prefilled one at a time; the GPU cache is reset (its prefix cache
only); then each is asked again, one at a time, with new tokens after it (64, or
1,500: a hit followed by two prefill chunks, or 1: a one-token step, a full CUDA graph
under vLLM's default compilation), 8 tokens greedy with the top-5
logprobs of each. ``plain`` keeps the prefixes in its own GPU cache, so both compute
the new tokens over the same cached prefix in the same batches: the ids and logprobs
must be equal.

**bench**: Llama-3-8B's shape with vLLM's dummy weights, bf16, 16-token blocks, a GPU
cache of 3,072 blocks (1.5 prompts of 32k), a 24 GiB CPU tier. For H in 2k, 8k, 32k:
four prompts of H tokens prefilled, the GPU's prefix cache reset, then each asked again
with a new suffix of S tokens (64, 512): the time to first token (one output token,
wall time of the call), and right after, the same prefix with another suffix, now a
GPU hit: the suffix's compute C. L, the copy alone: the prefix's KV bytes over the
host-to-device rate of a pinned 1 GiB copy measured in the same process. Decode: 32
requests of 1,024 prompt tokens, 128 output tokens each, against the same with one
output token; tokens/s and the inter-token latency of the difference, and from vLLM's
own histograms (which leave the prefill out) the mean inter-token latency and the
tokens/s of the mean decode phase; the decode rounds' table uses the latter, with the CPU
that the engine process's threads other than its main one took per second of the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MODULE = "offload_engine.connectors.vllm"

#: mode -> (kv_connector, kv_connector_extra_config); None: plain vLLM
MODES: dict[str, tuple[str, dict[str, Any]] | None] = {
    "plain": None,
    "vllm-cpu-spec": ("OffloadingConnector", {"spec_name": "CPUOffloadingSpec"}),
    "engine-spec": (
        "OffloadingConnector",
        {"spec_name": "EngineOffloadingSpec", "spec_module_path": MODULE},
    ),
    "tiering-disk": (
        "OffloadingConnector",
        {"spec_name": "EngineTieringSpec", "spec_module_path": MODULE},
    ),
    "async-step": ("EngineConnector", {"load_mode": "async", "store_mode": "step"}),
    # the same, its small jobs launched by vLLM's thread and found done by its poll
    # (no engine thread woken per job)
    "async-polled": (
        "EngineConnector",
        {
            "load_mode": "async",
            "store_mode": "step",
            "submitter_launch": True,
            "polled_completion": True,
        },
    ),
    # the same, storing nothing (a block must be offered 10^9 times): its bookkeeping alone
    "async-nostore": (
        "EngineConnector",
        {"load_mode": "async", "store_mode": "step", "store_threshold": 10**9},
    ),
    "async-lw": ("EngineConnector", {"load_mode": "async", "store_mode": "layerwise"}),
    "lw-step": ("EngineConnector", {"load_mode": "layerwise", "store_mode": "step"}),
    "lw-lw": ("EngineConnector", {"load_mode": "layerwise", "store_mode": "layerwise"}),
    # LMCache's own connector in vLLM, its CPU tier sized by environment variables
    "lmcache": ("LMCacheConnectorV1", {}),
    # vLLM's connector path with nothing behind it (null_connector.py): vLLM's own cost
    "null": ("NullConnector", {}),
}

BLOCK = 16

#: modes without this project's engine, so without its stats file
NO_STATS = ("plain", "vllm-cpu-spec", "lmcache", "null")

#: top-5 logprobs after a hit agree with plain vLLM's within a bf16 step of the logits
#: (the same KV bytes, yet runs of one engine differ by up to 1.6e-2 on vLLM's CPU build)
LOGPROB_TOLERANCE = 0.05


def transfer_config(mode: str, cpu_bytes: int, workdir: Path) -> dict[str, Any] | None:
    entry = MODES[mode]
    if entry is None:
        return None
    connector, extra = entry
    if connector == "LMCacheConnectorV1":
        os.environ.update(
            LMCACHE_CHUNK_SIZE="256",
            LMCACHE_LOCAL_CPU="True",
            LMCACHE_MAX_LOCAL_CPU_SIZE=str(cpu_bytes / (1 << 30)),
        )
        return {"kv_connector": connector, "kv_role": "kv_both"}
    if connector == "NullConnector":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        return {
            "kv_connector": connector,
            "kv_connector_module_path": "null_connector",
            "kv_role": "kv_both",
        }
    extra = dict(extra, cpu_bytes_to_use=cpu_bytes)
    if mode == "tiering-disk":
        (workdir / "disk-tier").mkdir(parents=True, exist_ok=True)
        extra["secondary_tiers"] = [
            {
                "type": "EngineDiskTier",
                "module_path": MODULE,
                "path": str(workdir / "disk-tier"),
                "capacity_bytes": 4 * cpu_bytes,
            }
        ]
    config: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if connector == "EngineConnector":
        config["kv_connector_module_path"] = MODULE
    return config


def build_model(out: Path, *, seed: int = 0) -> Path:
    """A 4-layer Llama with Llama-3-8B's attention geometry (8 KV heads of 128) and
    seeded random weights, saved in bf16 with no tokenizer (prompts go as ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=8192,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def llama8b_config(out: Path) -> Path:
    """Llama-3-8B's config.json (no weights: vLLM's dummy loader draws them)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def ids(rng: Any, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def prompt(token_ids: list[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=token_ids)


def metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        out[m.name] = getattr(m, "count", None) if value is None else value
    return out


#: vLLM's own decode clocks, which leave the prefill out: the gap between a
#: request's tokens, and its decode phase (first token to last)
DECODE_CLOCKS = ("vllm:inter_token_latency_seconds", "vllm:request_decode_time_seconds")


#: vLLM's clocks of a request's first token: arrival to first token, arrival to first
#: scheduled, first scheduled to first token (an asynchronous load's wait included)
TTFT_CLOCKS = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
)


def clocks(llm: Any, names: tuple[str, ...]) -> tuple[tuple[float, int], ...]:
    """Each named histogram's (sum, count) so far, (0, 0) where vLLM has none."""
    found = {m.name: (float(m.sum), int(m.count)) for m in llm.get_metrics() if hasattr(m, "sum")}
    return tuple(found.get(name, (0.0, 0)) for name in names)


def decode_clocks(llm: Any) -> tuple[tuple[float, int], ...]:
    return clocks(llm, DECODE_CLOCKS)


def timed_clocks(llm: Any, prompts: list[Any], params: Any) -> tuple[float, list[float]]:
    """The call's wall time, and vLLM's :data:`TTFT_CLOCKS` for its one request (ms)."""
    before = clocks(llm, TTFT_CLOCKS)
    wall = timed(llm, prompts, params)
    after = clocks(llm, TTFT_CLOCKS)
    return wall, [1e3 * (a[0] - b[0]) for a, b in zip(after, before, strict=True)]


def engine_cpu() -> tuple[float, float]:
    """CPU seconds so far of this process's descendants (vLLM's engine core and its
    workers): their main threads', and every other thread's (where an offloading
    engine's threads run)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    mine, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, ppid in parent.items() if ppid in mine} - mine
        mine |= found
        grew = bool(found)
    tick = os.sysconf("SC_CLK_TCK")
    main = other = 0
    for pid in mine - {os.getpid()}:
        try:
            # the process's total counts its ended threads too
            with open(f"/proc/{pid}/stat") as f:
                total = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{pid}/stat") as f:
                first = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks = int(first[11]) + int(first[12])
        main += ticks
        other += int(total[11]) + int(total[12]) - ticks
    return main / tick, other / tick


def start(model: str, mode: str, eager: bool, workdir: Path, **kw: Any) -> Any:
    from vllm import LLM

    config = transfer_config(mode, kw.pop("cpu_bytes"), workdir)
    if config is not None and mode not in NO_STATS:
        config["kv_connector_extra_config"]["stats_path"] = str(workdir / f"{mode}-stats.json")
    blocks = kw["num_gpu_blocks_override"]
    return LLM(
        model=model,
        dtype="bfloat16",
        block_size=kw.pop("block_size", BLOCK),
        # the cache's size given, not measured: several engines share one GPU in the checks
        kv_cache_memory_bytes=blocks * kw.pop("page_bytes"),
        enforce_eager=eager,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=config,
        **kw,
    )


def reset(llm: Any) -> None:
    """Drop the GPU's prefix cache (not the connector's); vLLM refuses while blocks of
    finished requests are still held, so step a little and ask again."""
    from vllm import SamplingParams

    for _ in range(20):
        if llm.reset_prefix_cache():
            return
        llm.generate([prompt([11, 12, 13])], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.2)
    raise RuntimeError("vLLM did not reset its prefix cache")


def shut(llm: Any, result: dict[str, Any] | None = None, out: str | None = None) -> None:
    """Write ``result`` to ``out`` (where given), then shut the engine down: a run whose
    shutdown hangs past the caller's time limit keeps what it measured (``main`` writes
    the final result over it)."""
    if result is not None and out is not None:
        Path(out).write_text(json.dumps(result, indent=1))
    llm.llm_engine.engine_core.shutdown(timeout=60)


# ------------------------------------------------------------------ check


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from vllm import SamplingParams

    workdir = Path(args.out).parent / f"work-{Path(args.out).stem}"
    workdir.mkdir(parents=True, exist_ok=True)
    plain = args.mode == "plain"
    llm = start(
        args.model,
        args.mode,
        args.eager,
        workdir,
        cpu_bytes=2 << 30,
        block_size=args.block_size,
        page_bytes=args.block_size * 4 * 2 * 8 * 128 * 2,
        # plain keeps every prefix; the others hold about three prompts of 2,048
        num_gpu_blocks_override=(4096 if plain else 400) * BLOCK // args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=4096,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
    )
    rng = random.Random(1)
    prompts = [ids(rng, 2048, 8192) for _ in range(6)]
    # 64 new tokens, 1,500 (a hit, then two prefill chunks), and 1: a step of one token,
    # which vLLM's default compilation runs as a full CUDA graph
    suffixes = [ids(rng, (64, 1500, 1)[i % 3], 8192) for i in range(6)]
    first = SamplingParams(temperature=0.0, max_tokens=1)
    for p in prompts:
        llm.generate([prompt(p)], first, use_tqdm=False)
    if not plain:
        reset(llm)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    tokens: list[list[int]] = []
    steps: list[list[dict[str, float]]] = []
    for p, s in zip(prompts, suffixes, strict=True):
        [out] = llm.generate([prompt(p + s)], params, use_tqdm=False)
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        steps.append(
            [{str(k): float(v.logprob) for k, v in at.items()} for at in completion.logprobs]
        )
    result = {
        "mode": args.mode,
        "eager": args.eager,
        "tokens": tokens,
        "top5": [s[0] for s in steps],
        # every generated token's top 5: where the ids part, was plain's pick a near tie
        "top5_steps": steps,
        "metrics": metrics(llm),
    }
    shut(llm, result, args.out)
    result["engine_stats"] = final_stats(workdir / f"{args.mode}-stats.json")
    return result


def final_stats(path: Path, wait_s: float = 30.0) -> dict[str, Any] | None:
    """The adapter's counters as its worker wrote them at shutdown (``"final": true``),
    waiting up to ``wait_s`` for that write; else the last periodic snapshot, if any."""
    deadline = time.monotonic() + wait_s
    data = None
    while time.monotonic() < deadline:
        if path.exists():
            data = json.loads(path.read_text())
            if data.get("final"):
                break
        time.sleep(0.5)
    return data


def near_tie(ref: dict[str, Any], run: dict[str, Any], i: int) -> bool:
    """Whether prompt ``i``'s ids part where plain vLLM's own logprobs of the two
    tokens were within :data:`LOGPROB_TOLERANCE` (a bf16 step of the logits picks
    either), the ids before it equal."""
    steps = ref.get("top5_steps")
    a, b = ref["tokens"][i], run["tokens"][i]
    if not steps or a == b:
        return False
    j = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if j is None:
        return False
    top = steps[i][j]
    return str(b[j]) in top and abs(top[str(a[j])] - top[str(b[j])]) <= LOGPROB_TOLERANCE


def compare(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """How ``run``'s answers after the hits compare with plain vLLM's: the ids must be
    equal except where they part at a near tie of plain's (:func:`near_tie`)."""
    ties = [i for i in range(len(ref["tokens"])) if near_tie(ref, run, i)]
    same_tokens = all(
        a == b or i in ties
        for i, (a, b) in enumerate(zip(ref["tokens"], run["tokens"], strict=True))
    )
    same_top = [set(a) == set(b) for a, b in zip(ref["top5"], run["top5"], strict=True)]
    diff = max(
        (
            abs(a[k] - b[k])
            for a, b in zip(ref["top5"], run["top5"], strict=True)
            for k in a
            if k in b
        ),
        default=float("inf"),
    )
    m = run["metrics"]
    stats = run.get("engine_stats") or {}
    adapter = stats.get("adapter", {})
    return {
        "tokens_equal": same_tokens,
        "near_ties": ties,
        "top5_ids_equal": all(same_top),
        "max_logprob_diff": diff,
        "external_hits": m.get("vllm:external_prefix_cache_hits", 0),
        "failures": adapter.get("failures_delivered", 0),
        "ok": same_tokens
        and all(same_top)
        and diff <= LOGPROB_TOLERANCE
        and m.get("vllm:external_prefix_cache_hits", 0) > 0
        and adapter.get("failures_delivered", 0) == 0,
    }


# ------------------------------------------------------------------ bench


def link_rate() -> float:
    """Host-to-device bytes/s of a pinned 1 GiB copy, median of 5."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return n / statistics.median(times[1:])


def timed(llm: Any, prompts: list[Any], params: Any) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


#: the host phases of a call that ``--phases`` times: (label, owner, method; a label's
#: methods add up, and a method the instance lacks is left out). Owners:
#: the engine core, its scheduler, the scheduler's connector, the model runner, the
#: worker's connector (one process: vLLM's engine runs in the caller's)
PHASES = (
    ("request", "core", "preprocess_add_request"),
    ("schedule", "scheduler", "schedule"),
    ("lookup", "scheduler_connector", "get_num_new_matched_tokens"),
    ("meta", "scheduler_connector", "build_connector_meta"),
    ("execute", "runner", "execute_model"),
    # vLLM's V1 model runner (its CPU build), then its V2 runner (the default on CUDA)
    ("update", "runner", "_update_states"),
    ("prepare", "runner", "_prepare_inputs"),
    ("update", "runner", "add_requests"),
    ("update", "runner", "update_requests"),
    ("prepare", "runner", "prepare_inputs"),
    ("prepare", "runner", "prepare_attn"),
    ("load_submit", "worker_connector", "start_load_kv"),
    ("sample", "runner", "sample_tokens"),
)


class PhaseClock:
    """Wall time of :data:`PHASES` per call, on the instances of an in-process vLLM
    engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so every phase runs on the caller's
    thread): per phase its total ms and count, and when the call's first ``execute``
    and ``load_submit`` began (ms from the call's start)."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        owners = {
            "core": core,
            "scheduler": core.scheduler,
            "scheduler_connector": getattr(core.scheduler, "connector", None),
            "runner": runner,
            "worker_connector": get_kv_transfer_group() if has_kv_transfer_group() else None,
        }
        self.events: list[tuple[str, float, float]] = []
        self.t0 = time.perf_counter()
        for label, owner, method in PHASES:
            obj = owners[owner]
            if obj is not None and hasattr(obj, method):
                setattr(obj, method, self._timed(label, getattr(obj, method)))

    def _timed(self, label: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append((label, began, time.perf_counter()))

        return timed

    def call(self, llm: Any, prompts: list[Any], params: Any) -> tuple[float, dict[str, float]]:
        """One timed call: its wall time (s) and its phases (ms)."""
        self.events.clear()
        self.t0 = time.perf_counter()
        wall = timed(llm, prompts, params)
        out: dict[str, float] = {"wall": 1e3 * wall}
        for label, began, ended in self.events:
            out[label] = out.get(label, 0.0) + 1e3 * (ended - began)
            out[f"{label}_n"] = out.get(f"{label}_n", 0) + 1
            if label in ("execute", "load_submit") and f"{label}_at" not in out:
                out[f"{label}_at"] = 1e3 * (began - self.t0)
        return wall, out


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from vllm import SamplingParams

    workdir = Path(args.out).parent / f"work-{Path(args.out).stem}"
    workdir.mkdir(parents=True, exist_ok=True)
    model = llama8b_config(workdir / "llama8b")
    rate = link_rate()
    trace_dir = workdir / "trace"
    if args.profile:
        # vLLM's own ranges (the scheduler's and the model runner's phases) into the trace
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    if args.phases:
        # the engine in this process, so each phase can be timed on its instance
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    profiling = (
        {
            "profiler_config": {
                "profiler": "torch",
                "torch_profiler_dir": str(trace_dir),
                # the Python tracer too: what the host ran before the first copy
                "torch_profiler_with_stack": True,
                "ignore_frontend": True,
            }
        }
        if args.profile
        else {}
    )
    llm = start(
        str(model),
        args.mode,
        args.eager,
        workdir,
        **profiling,
        cpu_bytes=24 << 30,
        page_bytes=BLOCK * 32 * 2 * 8 * 128 * 2,
        load_format="dummy",
        num_gpu_blocks_override=3072,
        gpu_memory_utilization=0.5,
        max_model_len=34 * 1024,
    )
    clock = PhaseClock(llm) if args.phases else None
    vocab = 128256
    kv_bytes_per_token = 2 * 32 * 8 * 128 * 2
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(7)
    ttft: list[dict[str, Any]] = []
    for h in args.heads:
        prompts = [ids(rng, h, vocab) for _ in range(args.prompts)]
        for p in prompts:
            timed(llm, [prompt(p)], one)
        # steps that carry the last prefill's stores (submitted at the next step)
        for _ in range(3):
            timed(llm, [prompt(ids(rng, 16, vocab))], one)
        time.sleep(1.0)
        for s in args.suffixes:
            reset(llm)
            hits: list[float] = []
            computes: list[float] = []
            hit_clocks: list[list[float]] = []
            compute_clocks: list[list[float]] = []
            phases: dict[str, list[dict[str, float]]] = {"hit": [], "compute": []}
            for p in prompts:
                for walls, seen_clocks, kind in (
                    (hits, hit_clocks, "hit"),
                    (computes, compute_clocks, "compute"),
                ):
                    asked = [prompt(p + ids(rng, s, vocab))]
                    if clock is not None:
                        wall, split = clock.call(llm, asked, one)
                        phases[kind].append(split)
                    else:
                        wall, seen = timed_clocks(llm, asked, one)
                        seen_clocks.append(seen)
                    walls.append(wall)
            ttft.append(
                {
                    "H": h,
                    "S": s,
                    "ttft_ms": [1e3 * t for t in hits],
                    "compute_ms": [1e3 * t for t in computes],
                    "L_ms": 1e3 * h * kv_bytes_per_token / rate,
                    # per call: vLLM's TTFT_CLOCKS, ms (not read with --phases), or
                    # the call's host phases
                    **(
                        {"phases_ms": phases}
                        if clock is not None
                        else {"vllm_hit_ms": hit_clocks, "vllm_compute_ms": compute_clocks}
                    ),
                }
            )
        if args.profile and h == max(args.heads):
            # one more hit, traced: the first prompt (evicted from the GPU by the later
            # ones, and the GPU's prefix cache reset) with a new suffix
            reset(llm)
            llm.start_profile()
            # the profiler's own start-up slows the first steps it traces: a short
            # request takes it, and the hit comes well after (the summary keeps only
            # the 100 ms before the hit's first copy)
            timed(llm, [prompt(ids(rng, 16, vocab))], one)
            time.sleep(0.5)
            asked = prompt(prompts[0] + ids(rng, args.suffixes[0], vocab))
            traced = timed_clocks(llm, [asked], one)
            llm.stop_profile()
    profile = trace_summary(trace_dir) if args.profile else None
    if profile is not None:
        profile["wall_ms"], profile["vllm_ms"] = 1e3 * traced[0], traced[1]
    decode = []
    many = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for _ in range(args.decode_repeats):
        batch = [prompt(ids(rng, 1024, vocab)) for _ in range(32)]
        t1 = timed(llm, [prompt(ids(rng, 1024, vocab)) for _ in range(32)], one)
        itl0, dec0 = decode_clocks(llm)
        cpu0 = engine_cpu()
        tn = timed(llm, batch, many)
        cpu1 = engine_cpu()
        itl1, dec1 = decode_clocks(llm)
        steps = args.decode_tokens - 1
        row = {
            "tokens_per_s": 32 * steps / (tn - t1),
            "itl_ms": 1e3 * (tn - t1) / steps,
            "wall_s": tn,
            "engine_main_cpu_s": cpu1[0] - cpu0[0],
            "engine_threads_cpu_s": cpu1[1] - cpu0[1],
        }
        if itl1[1] > itl0[1] and dec1[1] > dec0[1]:
            row["vllm_itl_ms"] = 1e3 * (itl1[0] - itl0[0]) / (itl1[1] - itl0[1])
            mean_decode = (dec1[0] - dec0[0]) / (dec1[1] - dec0[1])
            row["vllm_tokens_per_s"] = 32 * steps / mean_decode
        decode.append(row)
    result = {
        "mode": args.mode,
        "eager": args.eager,
        "link_GBps": rate / 1e9,
        "ttft": ttft,
        "decode": decode,
        "round": args.round,
        "metrics": metrics(llm),
        "profile": profile,
    }
    shut(llm, result, args.out)
    if args.mode not in NO_STATS:
        # where the engine's loads spent their time (the adapter's timings, ms)
        stats = final_stats(workdir / f"{args.mode}-stats.json") or {}
        result["timings"] = stats.get("adapter", {}).get("timings")
    return result


#: the copy that starts a traced hit's load: the first host-to-device copy this large
HIT_COPY_BYTES = 1 << 20
#: what the summary keeps of the trace before that copy (a short request traced first,
#: to take the profiler's start-up, ended longer before)
BEFORE_HIT_US = 100_000


def trace_summary(folder: Path) -> dict[str, Any] | None:
    """The traced hit, from the newest torch profiler trace in ``folder``, in ms from
    its load's first copy (the first host-to-device copy of :data:`HIT_COPY_BYTES` or
    more), events from :data:`BEFORE_HIT_US` before it on: per copy direction and for
    kernels, how many, their bytes, when the first began and the last ended, and the
    time busy; the host-to-device copies' rate over their span and while busy, and the
    five longest gaps between them; vLLM's host ranges, and the Python calls of 1 ms or
    more before the first copy."""
    import gzip

    traces = sorted(folder.rglob("*.json*"), key=lambda f: f.stat().st_mtime)
    if not traces:
        return None
    raw = traces[-1].read_bytes()
    data = json.loads(gzip.decompress(raw) if traces[-1].suffix == ".gz" else raw)
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    big = [
        e["ts"]
        for e in events
        if "HtoD" in e.get("name", "")
        and int((e.get("args") or {}).get("bytes", 0)) >= HIT_COPY_BYTES
    ]
    if not big:
        return None
    t0 = min(big)
    events = [e for e in events if e["ts"] >= t0 - BEFORE_HIT_US]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]

    def group(chosen: list[dict[str, Any]]) -> dict[str, Any]:
        if not chosen:
            return {"n": 0}
        nbytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e in chosen)
        first = min(e["ts"] for e in chosen) - t0
        last = max(e["ts"] + e["dur"] for e in chosen) - t0
        busy = sum(e["dur"] for e in chosen)
        return {
            "n": len(chosen),
            "GB": nbytes / 1e9,
            "first_ms": first / 1e3,
            "last_end_ms": last / 1e3,
            "busy_ms": busy / 1e3,
            "span_GBps": nbytes / 1e3 / max(last - first, 1e-9),
            "busy_GBps": nbytes / 1e3 / max(busy, 1e-9),
        }

    h2d = sorted((e for e in gpu if "HtoD" in e.get("name", "")), key=lambda e: e["ts"])
    gaps = []  # (ms with no host-to-device copy running, ms at which it began)
    end = h2d[0]["ts"] + h2d[0]["dur"] if h2d else 0.0
    for e in h2d[1:]:
        if e["ts"] > end:
            gaps.append(((e["ts"] - end) / 1e3, (end - t0) / 1e3))
        end = max(end, e["ts"] + e["dur"])
    # vLLM's own ranges on the host (scheduling, the model runner's phases), in order
    marks = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["dur"] >= 100),
        key=lambda e: e["ts"],
    )
    # the Python calls of 1 ms or more that began before the first copy, outer ones
    # first (the trace's Python tracer, with stacks on)
    calls = sorted(
        (
            e
            for e in events
            if e.get("cat") == "python_function" and e["dur"] >= 1000 and e["ts"] <= t0
        ),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    return {
        "trace": traces[-1].name,
        "python_before_first_copy_ms": [
            [e["name"][-90:], round((e["ts"] - t0) / 1e3, 2), round(e["dur"] / 1e3, 2)]
            for e in calls
        ][:120],
        "host_ranges_ms": [
            [e["name"], round((e["ts"] - t0) / 1e3, 2), round(e["dur"] / 1e3, 2)] for e in marks
        ][:60],
        "h2d": group(h2d),
        "d2h": group([e for e in gpu if "DtoH" in e.get("name", "")]),
        "d2d": group([e for e in gpu if "DtoD" in e.get("name", "")]),
        "kernels": group([e for e in gpu if e.get("cat") == "kernel"]),
        "h2d_gaps_ms": [[round(g, 3), round(at, 3)] for g, at in sorted(gaps, reverse=True)[:5]],
    }


# ------------------------------------------------------------------ report


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def report(folder: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    lines: list[str] = []
    checks = [r for r in runs if "tokens" in r]
    for eager in (True, False):
        ref = next((r for r in checks if r["mode"] == "plain" and r["eager"] == eager), None)
        if ref is None:
            continue
        lines.append(f"check ({'eager' if eager else 'compiled + CUDA graphs'}), against plain:")
        lines.append(
            f"  {'mode':14} {'ok':5} {'tokens':7} {'top5':5} {'max|dlogp|':>10} {'hits':>6} final"
        )
        for r in checks:
            if r["eager"] != eager or r["mode"] == "plain":
                continue
            c = compare(ref, r)
            lines.append(
                f"  {r['mode']:14} {c['ok']!s:5} {c['tokens_equal']!s:7} "
                f"{c['top5_ids_equal']!s:5} {c['max_logprob_diff']:10.2e} {c['external_hits']:6} "
                f"{(r.get('engine_stats') or {}).get('final', '-')}"
                + (
                    f"  parted at plain's near ties: prompts {c['near_ties']}"
                    if c["near_ties"]
                    else ""
                )
            )
    benches = [r for r in runs if "ttft" in r and r.get("round") is None]
    for eager in (True, False):
        rows = [r for r in benches if r["eager"] == eager]
        if not rows:
            continue
        lines.append(
            f"bench ({'eager' if eager else 'compiled + CUDA graphs'}); TTFT medians ms; "
            f"link {rows[0]['link_GBps']:.1f} GB/s"
        )
        cases = [(t["H"], t["S"]) for t in rows[0]["ttft"]]
        heads = "".join(f" {f'{h // 1024}k+{s}':>9}" for h, s in cases)
        lines.append(f"  {'mode':14}{heads}")
        for r in rows:
            by = {(t["H"], t["S"]): t for t in r["ttft"]}
            lines.append(
                "  " + f"{r['mode']:14}" + "".join(f" {med(by[c]['ttft_ms']):9.1f}" for c in cases)
            )
        ref = rows[0]["ttft"]
        lines.append("  " + f"{'L (copy)':14}" + "".join(f" {t['L_ms']:9.1f}" for t in ref))
        lines.append(
            "  " + f"{'C (compute)':14}" + "".join(f" {med(t['compute_ms']):9.1f}" for t in ref)
        )
        if all("vllm_hit_ms" in t for r in rows for t in r["ttft"]):
            lines.append(
                "  vLLM's clocks, medians ms: hit's first-scheduled-to-token (its load's wait "
                "included) / compute's; each call's time outside vLLM's TTFT"
            )
            for r in rows:
                cells = []
                for t in r["ttft"]:
                    prefill = med([c[2] for c in t["vllm_hit_ms"]])
                    compute = med([c[2] for c in t["vllm_compute_ms"]])
                    outside = med(
                        [w - c[0] for w, c in zip(t["ttft_ms"], t["vllm_hit_ms"], strict=True)]
                    )
                    cells.append(f"{prefill:.0f}/{compute:.0f} +{outside:.0f}")
                lines.append(f"  {r['mode']:14} " + " ".join(f"{c:>13}" for c in cells))
        timed = [(r["mode"], (r.get("timings") or {}).get("load")) for r in rows]
        if any(t for _, t in timed):
            lines.append("  loads, ms (p50): submit to done, copy, done to collected (p50, p90)")
            for mode, t in timed:
                if t:
                    lines.append(
                        f"  {mode:14} {t['submit_to_done_ms_p50']:8.1f} {t['copy_ms_p50']:8.1f} "
                        f"{t['done_to_collected_ms_p50']:8.1f} {t['done_to_collected_ms_p90']:8.1f}"
                    )
        lines += layerwise_steps(rows)
        lines += phase_rows(rows)
        lines += traced(rows)
        lines.append("  decode: tokens/s (median), ITL ms")
        for r in rows:
            if not r["decode"]:
                continue
            tps = med([d["tokens_per_s"] for d in r["decode"]])
            itl = med([d["itl_ms"] for d in r["decode"]])
            lines.append(f"  {r['mode']:14} {tps:9.0f} {itl:7.2f}")
    lines += decode_rounds([r for r in runs if r.get("round") is not None])
    return "\n".join(lines)


def traced(rows: list[dict[str, Any]]) -> list[str]:
    """The traced hit of each mode that has one: per group, n, GB, first start, last
    end, busy (ms from the load's first copy), and the host-to-device rates."""
    lines: list[str] = []
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        if not lines:
            lines.append("  traced hit, ms from the load's first copy: n, GB, first, end, busy")
        for name in ("h2d", "d2h", "d2d", "kernels"):
            g = prof[name]
            if not g["n"]:
                continue
            rate = (
                f"  {g['span_GBps']:.1f} GB/s over its span, {g['busy_GBps']:.1f} busy"
                if name == "h2d"
                else ""
            )
            lines.append(
                f"  {r['mode']:14} {name:8} {g['n']:6} {g['GB']:7.3f} {g['first_ms']:8.1f} "
                f"{g['last_end_ms']:8.1f} {g['busy_ms']:8.1f}{rate}"
            )
        lines.append(f"  {r['mode']:14} h2d gaps (ms, at): {prof['h2d_gaps_ms']}")
        if "wall_ms" in prof:
            clock = "/".join(f"{v:.0f}" for v in prof["vllm_ms"])
            lines.append(
                f"  {r['mode']:14} traced call {prof['wall_ms']:.0f} ms; vLLM's TTFT/queue/"
                f"scheduled-to-token {clock}"
            )
        ranges = "; ".join(f"{n} {at:.1f}+{d:.1f}" for n, at, d in prof.get("host_ranges_ms", []))
        if ranges:
            lines.append(f"  {r['mode']:14} host ranges (name at+dur): {ranges}")
    return lines


def phase_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Per mode and cell with ``--phases``, the hit's and the GPU hit's (compute's)
    medians: the call's wall time, each phase's time, and when the first load's submit
    began (the host time before any byte of the hit can move)."""
    labels = list(dict.fromkeys(label for label, _, _ in PHASES))
    lines: list[str] = []
    for r in rows:
        for t in r["ttft"]:
            split = t.get("phases_ms")
            if not split:
                continue
            if not lines:
                lines.append(
                    "  host phases (in-process engine), medians ms: wall, submit at; "
                    + ", ".join(labels)
                )
            for kind, calls in split.items():
                if not calls:
                    continue

                def m(key: str, calls: list[dict[str, float]] = calls) -> str:
                    seen = [c[key] for c in calls if key in c]
                    return f"{med(seen):.1f}" if seen else "-"

                cell = f"{t['H'] // 1024}k+{t['S']} {kind}"
                lines.append(
                    f"  {r['mode']:14} {cell:16} {m('wall'):>6} {m('load_submit_at'):>6}; "
                    + " ".join(f"{label} {m(label)}" for label in labels)
                )
    return lines


def layerwise_steps(rows: list[dict[str, Any]]) -> list[str]:
    """Per mode with layer-wise loads, per cell: the medians of the hit steps' span from
    the loads' submit to the forward pass's end, and of the time vLLM's thread was
    blocked in the waits (``adapter.timings.layerwise_loads``; the bench's hits are the
    run's only steps with loads, one each, in the order of its cells, then the traced
    hit of ``--profile``)."""
    lines: list[str] = []
    for r in rows:
        recent = ((r.get("timings") or {}).get("layerwise_loads") or {}).get("recent_ms")
        calls = [len(t["ttft_ms"]) for t in r["ttft"]]
        if not recent or len(recent) != sum(calls) + bool(r.get("profile")):
            continue
        if not lines:
            lines.append("  layer-wise hit steps, medians ms: submit to forward end / blocked")
        cells, at = [], 0
        for n in calls:
            steps = recent[at : at + n]
            at += n
            cells.append(f"{med([s for s, _ in steps]):.0f}/{med([b for _, b in steps]):.0f}")
        lines.append(f"  {r['mode']:14} " + " ".join(f"{c:>9}" for c in cells))
    return lines


def decode_rounds(runs: list[dict[str, Any]]) -> list[str]:
    """The decode rounds' table: per mode, the median tokens/s over every round's
    repeats, and its ratio to plain vLLM's median in each round (the modes of a
    round ran one after another in one machine's minutes)."""
    lines: list[str] = []
    for eager in (True, False):
        rows = [r for r in runs if r["eager"] == eager]
        plain = {r["round"]: r for r in rows if r["mode"] == "plain"}
        if not rows or not plain:
            continue
        lines.append(
            f"decode rounds ({'eager' if eager else 'compiled + CUDA graphs'}): tokens/s median, "
            "ITL ms median (vLLM's clocks where it has them), per-round ratio to plain"
        )
        key = (
            "vllm_tokens_per_s"
            if all("vllm_tokens_per_s" in d for r in rows for d in r["decode"])
            else "tokens_per_s"
        )
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["round"])
            tps = [d[key] for r in mine for d in r["decode"]]
            itl = [d.get("vllm_itl_ms", d["itl_ms"]) for r in mine for d in r["decode"]]
            ratios = [
                med([d[key] for d in r["decode"]])
                / med([d[key] for d in plain[r["round"]]["decode"]])
                for r in mine
                if r["round"] in plain
            ]
            # the engine process's other threads' CPU over the batch's wall time
            busy = [
                d["engine_threads_cpu_s"] / d["wall_s"]
                for r in mine
                for d in r["decode"]
                if "wall_s" in d
            ]
            lines.append(
                f"  {mode:14} {med(tps):9.0f} {med(itl):7.2f}  "
                + " ".join(f"{x:.3f}" for x in ratios)
                + f"  (median {med(ratios):.3f})"
                + (f"  threads {med(busy):.2f} CPU" if busy else "")
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("--mode", choices=list(MODES), required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--eager", action="store_true")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.08)
    c.add_argument("--block-size", type=int, default=BLOCK, help="vLLM's CPU build: 32")
    b = sub.add_parser("bench")
    b.add_argument("--mode", choices=list(MODES), required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--eager", action="store_true")
    b.add_argument(
        "--heads", type=int, nargs="*", default=[2048, 8192, 32768], help="none: decode only"
    )
    b.add_argument("--round", type=int, help="a decode round's number (vllm_gpu.sh --decode)")
    b.add_argument("--suffixes", type=int, nargs="+", default=[64, 512])
    b.add_argument("--prompts", type=int, default=4)
    b.add_argument("--decode-tokens", type=int, default=128)
    b.add_argument("--decode-repeats", type=int, default=3)
    b.add_argument(
        "--profile",
        action="store_true",
        help="trace one more hit at the largest H (torch profiler, CUDA activity) and "
        "summarize the GPU's copies and kernels",
    )
    b.add_argument(
        "--phases",
        action="store_true",
        help="vLLM's engine in this process, each TTFT call split into the host phases "
        "it spent its time in (scheduling, the connector's lookup and metadata, the "
        "model runner's update, preparation, load submit, execution, sampling); vLLM's "
        "own TTFT clocks are then not read",
    )
    r = sub.add_parser("report")
    r.add_argument("folder")
    args = p.parse_args(argv)
    if args.cmd == "model":
        build_model(Path(args.out))
        return 0
    if args.cmd == "report":
        print(report(Path(args.folder)))
        return 0
    result = run_check(args) if args.cmd == "check" else run_bench(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.cmd == "check":
        print(json.dumps({k: v for k, v in result.items() if k in ("mode", "eager", "tokens")}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
