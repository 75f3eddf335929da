"""Run real vLLM (CPU backend) on the tiny model, with or without offload-engine.

Run as a script in its own process (vLLM spawns processes and warns freely):

    PYTHONPATH=. python tests/vllm/e2e_runner.py --model-dir /tmp/m --out run.json --offload

The scenario: greedy generation of ``--num-prompts`` prompts, ``--rounds``
times, with a KV cache of ``--gpu-blocks`` blocks of 32 tokens, too small to
keep earlier prompts' prefix blocks between rounds. The KV cache's memory is
given (``--kv-cache-bytes``), not derived from the machine: on the CPU backend
vLLM otherwise reserves ``gpu_memory_utilization`` of the host's memory, refuses
to start where that share is not free, and sizes the cache as that share minus
what its worker process holds at the time. With ``--offload`` the
OffloadingConnector loads ``EngineOffloadingSpec`` from ``offload_engine.connectors.vllm``;
its worker (in vLLM's worker process) writes the engine's counters to
``--stats-path`` at shutdown. The JSON written to ``--out`` holds the token ids
of every round and vLLM's metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import build_tiny_llama, make_prompts

#: the KV cache's memory: 910 blocks of the tiny MLA model (36 KiB each; the other tiny
#: models' blocks take 32 KiB), more than any test's --gpu-blocks
KV_CACHE_BYTES = 32 << 20


def _metric_value(m: Any) -> Any:
    value = getattr(m, "value", None)
    return getattr(m, "count", None) if value is None else value


def _metrics(llm: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """vLLM's metrics by name (the last series of each), and every series with its labels."""
    out: dict[str, Any] = {}
    series: list[dict[str, Any]] = []
    for m in llm.get_metrics():
        value = _metric_value(m)
        out[m.name] = value
        series.append(
            {"name": m.name, "labels": dict(getattr(m, "labels", {}) or {}), "value": value}
        )
    return out, series


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        build_tiny_llama(model)
    kwargs: dict[str, Any] = {}
    if args.offload:
        extra: dict[str, Any] = {
            "spec_name": args.spec_name,
            "spec_module_path": args.spec_module,
            "cpu_bytes_to_use": args.cpu_bytes,
            "blocks_per_chunk": args.blocks_per_chunk,
        }
        if args.stats_path:
            extra["stats_path"] = args.stats_path
        extra.update(json.loads(args.extra))
        kwargs["kv_transfer_config"] = {
            "kv_connector": args.connector,
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if args.kv_load_failure_policy:
            kwargs["kv_transfer_config"]["kv_load_failure_policy"] = args.kv_load_failure_policy
        if args.connector == "EngineConnector":
            kwargs["kv_transfer_config"]["kv_connector_module_path"] = (
                "offload_engine.connectors.vllm"
            )
    if args.async_scheduling:
        kwargs["async_scheduling"] = True
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype=args.dtype,
        block_size=32,
        num_gpu_blocks_override=args.gpu_blocks,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    t_init = time.perf_counter() - t0
    prompts = make_prompts(args.num_prompts, args.prompt_words)
    later = asked_again(prompts, args.suffix_words, args.fresh_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rounds: list[list[list[int]]] = []
    t1 = time.perf_counter()
    aborted = 0
    for i in range(args.rounds):
        asked = prompts if i == 0 else later
        if args.abort_round and i == args.rounds - 1:
            aborted = abort_round(llm, asked, params)
        outputs = llm.generate(asked, params, use_tqdm=False)
        rounds.append([list(o.outputs[0].token_ids) for o in outputs])
    t_gen = time.perf_counter() - t1
    metrics, series = _metrics(llm)
    # Shut the engine down now (not at interpreter exit), so the offload worker
    # closes its engine and writes its stats before we return. vLLM's default
    # grace before it force-kills EngineCore is 5 s, which a loaded 2-core CI
    # machine once overran (no stats file); a hung worker still fails the test.
    llm.llm_engine.engine_core.shutdown(timeout=30)
    return {
        "rounds": rounds,
        "metrics": metrics,
        "series": series,
        "seconds": {"init": t_init, "generate": t_gen},
        "offload": bool(args.offload),
        "aborted": aborted,
    }


def asked_again(prompts: list[str], suffix_words: int, fresh: int) -> list[str]:
    """The prompts of every round after the first: each first prompt with
    ``suffix_words`` new words after it (a prefix hit whose new tokens fill blocks in
    the hit's step), and every ``fresh``-th one replaced by a prompt never seen (a
    miss beside the hits); with both 0, the first round's prompts."""
    out = list(prompts)
    if suffix_words:
        suffixes = make_prompts(len(out), suffix_words, seed=2)
        out = [f"{p} {s}" for p, s in zip(out, suffixes, strict=True)]
    if fresh:
        new = make_prompts(len(out), len(prompts[0].split()), seed=3)
        out = [new[i] if i % fresh == fresh - 1 else p for i, p in enumerate(out)]
    return out


def abort_round(llm: Any, prompts: list[str], params: Any) -> int:
    """Send every prompt, step until a first batch has computed a token (its prefix
    loads ran in that step), then abort them all, before the last round: requests go
    away with their loads in flight or just done. Returns how many were aborted."""
    engine = llm.llm_engine
    ids = list(llm.enqueue(prompts, params, use_tqdm=False))
    while not any(out.outputs and out.outputs[0].token_ids for out in engine.step()):
        pass  # until a first batch has computed (its loads ran in that step)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return len(ids)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--offload", action="store_true")
    p.add_argument(
        "--connector",
        default="OffloadingConnector",
        choices=["OffloadingConnector", "EngineConnector"],
        help="vLLM's connector, or offload-engine's (loaded from offload_engine.connectors.vllm)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        choices=["fail", "recompute"],
        help="vLLM's policy for blocks whose load failed (vLLM's default when not given)",
    )
    p.add_argument("--spec-name", default="EngineOffloadingSpec")
    p.add_argument("--spec-module", default="offload_engine.connectors.vllm")
    p.add_argument("--cpu-bytes", type=int, default=64 * 2**20)
    p.add_argument("--blocks-per-chunk", type=int, default=1)
    p.add_argument("--stats-path", default=None)
    p.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    p.add_argument("--dtype", default="float32", help="vLLM's dtype (the model's weights)")
    p.add_argument("--gpu-blocks", type=int, default=16)
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=KV_CACHE_BYTES,
        help="vLLM's kv_cache_memory_bytes: the memory its worker must find free for the KV "
        "cache (gpu_memory_utilization is then neither reserved nor checked); --gpu-blocks "
        "blocks are allocated in it, and must fit",
    )
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens a step may compute (vLLM's default when not given)",
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--suffix-words",
        type=int,
        default=0,
        help="after the first round, each prompt carries this many new words",
    )
    p.add_argument(
        "--fresh-prompts",
        type=int,
        default=0,
        help="after the first round, every N-th prompt is one never seen (0: none)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduling (its default on CUDA): the next step is scheduled "
        "before the last one's output is processed",
    )
    p.add_argument(
        "--abort-round",
        action="store_true",
        help="before the last round, send every prompt, step once and abort them all",
    )
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
