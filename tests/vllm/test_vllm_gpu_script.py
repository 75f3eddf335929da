"""``benchmarks/device/vllm_gpu.py``, the CUDA vLLM check and bench, on this machine: its
check runs end to end on vLLM's CPU build (32-token blocks there), and its verdict and
report read what a run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device" / "vllm_gpu.py"
sys.path.insert(0, str(SCRIPT.parent))

from vllm_gpu import PHASES, compare, phase_rows, trace_summary  # noqa: E402


def run(*args: str) -> str:
    """The script with ``args``; its stdout."""
    return python(str(SCRIPT), *args)


def python(*argv: str) -> str:
    """This interpreter with ``argv``, from the repository root; its stdout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_check_passes_layerwise_on_vllms_cpu_build(tmp_path: Path) -> None:
    """A layer-wise connector with layer-wise stores answers as plain vLLM does, and the
    report says so; the null connector (the decode bench's measure of vLLM's own
    connector path) loads in vLLM and answers as plain vLLM does, with no hit."""
    run("model", "--out", str(tmp_path / "model"))
    for mode in ("plain", "lw-lw", "null"):
        run(
            "check",
            "--mode",
            mode,
            "--model",
            str(tmp_path / "model"),
            "--out",
            str(tmp_path / "out" / f"check-{mode}.json"),
            "--eager",
            "--block-size",
            "32",
            "--gpu-memory-utilization",
            "0.25",
        )
    plain, layerwise = (
        json.loads((tmp_path / "out" / f"check-{m}.json").read_text()) for m in ("plain", "lw-lw")
    )
    verdict = compare(plain, layerwise)
    assert verdict["tokens_equal"] and verdict["top5_ids_equal"], verdict
    assert verdict["external_hits"] > 0 and verdict["ok"], verdict
    assert layerwise["engine_stats"]["final"] is True
    assert layerwise["engine_stats"]["adapter"]["store_parts_at_layer"] > 0
    null = compare(plain, json.loads((tmp_path / "out" / "check-null.json").read_text()))
    assert null["tokens_equal"] and null["top5_ids_equal"] and null["external_hits"] == 0, null
    report = run("report", str(tmp_path / "out"))
    assert "lw-lw          True  True" in report


PHASE_PROBE = """
import json, os, random, sys
from pathlib import Path
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, sys.argv[1])
import vllm_gpu as vg
from vllm import SamplingParams
work = Path(sys.argv[3])
page = 32 * 4 * 2 * 8 * 128 * 2
llm = vg.start(sys.argv[2], "lw-step", True, work, cpu_bytes=1 << 30,
               page_bytes=page, num_gpu_blocks_override=96, block_size=32,
               max_model_len=2048, max_num_seqs=4, gpu_memory_utilization=0.25)
clock = vg.PhaseClock(llm)
one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
rng = random.Random(1)
head = vg.ids(rng, 1024, 500)
vg.timed(llm, [vg.prompt(head)], one)
# steps carry the prompt's deferred stores; vLLM counts their bytes once they are done
for _ in range(200):
    if vg.metrics(llm).get("vllm:kv_offload_store_bytes", 0) >= 32 * page:
        break
    vg.timed(llm, [vg.prompt(vg.ids(rng, 16, 500))], one)
vg.reset(llm)
out = {kind: clock.call(llm, [vg.prompt(head + vg.ids(rng, 40, 500))], one)[1]
       for kind in ("hit", "compute")}
out["hits"] = vg.metrics(llm).get("vllm:external_prefix_cache_hits", 0)
vg.shut(llm)
print(json.dumps(out))
"""


def test_the_phase_clock_splits_a_tier_hit_on_vllms_cpu_build(tmp_path: Path) -> None:
    """``--phases`` on a real vLLM: a layer-wise tier hit's call is split into vLLM's
    host phases, the load's submit among them after the model runner began executing,
    and the report prints a row for the hit and one for the GPU hit after it."""
    run("model", "--out", str(tmp_path / "model"))
    out = python("-c", PHASE_PROBE, str(SCRIPT.parent), str(tmp_path / "model"), str(tmp_path))
    split = json.loads(out.strip().splitlines()[-1])
    assert split.pop("hits") >= 1024, split
    hit = split["hit"]
    for label in {label for label, _, _ in PHASES}:
        assert hit[f"{label}_n"] >= 1 and hit[label] >= 0, (label, hit)
    assert 0 < hit["execute_at"] < hit["load_submit_at"] < hit["wall"], hit
    assert hit["lookup_n"] >= 1 and hit["execute"] < hit["wall"], hit
    rows = phase_rows(
        [
            {
                "mode": "lw-step",
                "ttft": [
                    {
                        "H": 1024,
                        "S": 40,
                        "phases_ms": {kind: [calls] for kind, calls in split.items()},
                    }
                ],
            }
        ]
    )
    assert [r.split()[:3] for r in rows[1:]] == [
        ["lw-step", "1k+40", "hit"],
        ["lw-step", "1k+40", "compute"],
    ], rows


def _check(tokens: list[list[int]], top: list[dict[str, float]], hits: int) -> dict[str, Any]:
    return {
        "mode": "m",
        "eager": True,
        "tokens": tokens,
        "top5": top,
        "metrics": {"vllm:external_prefix_cache_hits": hits},
    }


def test_the_verdict_fails_on_other_ids_other_logprobs_or_no_hits() -> None:
    ref = _check([[1, 2]], [{"1": -0.5, "3": -1.0}], 0)
    assert compare(ref, _check([[1, 2]], [{"1": -0.5, "3": -1.0}], 64))["ok"]
    assert not compare(ref, _check([[1, 4]], [{"1": -0.5, "3": -1.0}], 64))["ok"]
    assert not compare(ref, _check([[1, 2]], [{"1": -0.5, "5": -1.0}], 64))["ok"]
    assert not compare(ref, _check([[1, 2]], [{"1": -0.3, "3": -1.0}], 64))["ok"]
    assert not compare(ref, _check([[1, 2]], [{"1": -0.5, "3": -1.0}], 0))["ok"]


def test_ids_that_part_at_a_near_tie_of_plain_vllms_pass_and_others_fail() -> None:
    """Greedy ids may part where plain vLLM's own two best logprobs were within the
    tolerance (a bf16 step of the logits picks either); anywhere else they fail."""
    steps = [[{"1": -0.5, "3": -1.0}, {"2": -0.69, "4": -0.70, "6": -3.0}]]
    ref = dict(_check([[1, 2]], [steps[0][0]], 0), top5_steps=steps)
    tie = compare(ref, _check([[1, 4]], [{"1": -0.5, "3": -1.0}], 64))
    assert tie["ok"] and tie["tokens_equal"] and tie["near_ties"] == [0], tie
    far = compare(ref, _check([[1, 6]], [{"1": -0.5, "3": -1.0}], 64))
    assert not far["ok"] and far["near_ties"] == [], far
    # the first step parting is no tie here: 1 and 3 are 0.5 apart
    assert not compare(ref, _check([[3, 2]], [{"1": -0.5, "3": -1.0}], 64))["ok"]


def _decode_run(mode: str, round_: int, tokens_per_s: list[float]) -> dict[str, Any]:
    return {
        "mode": mode,
        "eager": True,
        "round": round_,
        "ttft": [],
        "decode": [
            {"tokens_per_s": 1.0, "itl_ms": 9.0, "vllm_tokens_per_s": t, "vllm_itl_ms": 1e3 / t}
            for t in tokens_per_s
        ],
    }


def test_the_decode_rounds_compare_each_mode_with_plain_vllm_of_its_round(
    tmp_path: Path,
) -> None:
    """Per round, a mode's median over plain vLLM's median in that round (vLLM's own
    decode clock), whatever the order the rounds ran in."""
    runs = [
        _decode_run("plain", 1, [1000, 1100, 900]),
        _decode_run("async-step", 1, [950, 800, 900]),
        _decode_run("plain", 2, [2000, 2000, 2000]),
        _decode_run("async-step", 2, [1960, 1900, 2100]),
    ]
    for r in runs:
        name = f"decode-eager-r{r['round']}-{r['mode']}.json"
        (tmp_path / name).write_text(json.dumps(r))
    report = run("report", str(tmp_path))
    [row] = [line for line in report.splitlines() if line.strip().startswith("async-step")]
    assert "0.900 0.980" in row and "(median 0.940)" in row, report
    [plain] = [line for line in report.splitlines() if line.strip().startswith("plain")]
    assert "1.000 1.000" in plain, report


def test_the_bench_report_shows_where_the_loads_spent_their_time(tmp_path: Path) -> None:
    """A bench run's loads (the adapter's timings) get a row per mode that has them, and
    each mode's hits vLLM's own clocks: first scheduled to token, and the time outside."""
    ttft = [
        {
            "H": 8192,
            "S": 64,
            "ttft_ms": [60.0],
            "compute_ms": [37.0],
            "L_ms": 19.0,
            "vllm_hit_ms": [[40.0, 0.5, 38.0]],
            "vllm_compute_ms": [[30.0, 0.4, 28.0]],
        }
    ]
    decode = [{"tokens_per_s": 1000.0, "itl_ms": 20.0}]
    load = {
        "jobs": 4,
        "submit_to_done_ms_p50": 21.5,
        "copy_ms_p50": 19.25,
        "done_to_collected_ms_p50": 5.5,
        "done_to_collected_ms_p90": 6.75,
        "done_to_collected_ms_max": 7.0,
    }
    # a layer-wise mode's hit steps (one a call): submit to forward end, blocked in waits
    steps = {"steps": 1, "recent_ms": [[45.5, 30.25]]}
    for mode, timings in (
        ("plain", None),
        ("async-step", {"load": load}),
        ("lw-step", {"load": load, "layerwise_loads": steps}),
    ):
        run_ = {"mode": mode, "eager": True, "link_GBps": 55.0, "ttft": ttft, "decode": decode}
        if timings is not None:
            run_["timings"] = timings
        (tmp_path / f"bench-eager-{mode}.json").write_text(json.dumps(run_))
    report = run("report", str(tmp_path))
    assert "loads, ms (p50)" in report, report
    rows = [line.split() for line in report.splitlines() if "21.5" in line]
    assert rows == [[m, "21.5", "19.2", "5.5", "6.8"] for m in ("async-step", "lw-step")], report
    clocked = [line.split() for line in report.splitlines() if "38/28" in line]
    assert sorted(clocked) == [[m, "38/28", "+20"] for m in ("async-step", "lw-step", "plain")]
    assert "layer-wise hit steps" in report
    assert [line.split() for line in report.splitlines() if "46/30" in line] == [
        ["lw-step", "46/30"]
    ], report


def test_a_traced_hit_is_summarized_from_the_profilers_trace(tmp_path: Path) -> None:
    """Two host-to-device copies with a 2 ms gap, one kernel; times in the trace's us.
    What ran long before the hit's first large copy is left out."""
    import gzip

    def event(cat: str, name: str, ts: float, dur: float, nbytes: int = 0) -> dict[str, Any]:
        args = {"bytes": nbytes}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [
        # the short request that takes the profiler's start-up, long before the hit
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", -400_000.0, 10.0, 4096),
        event("kernel", "warm-up", -399_000.0, 500.0),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000.0, 1000.0, 50_000_000),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 4000.0, 1000.0, 50_000_000),
        event("kernel", "scatter", 2500.0, 500.0),
        event("cpu_op", "aten::copy_", 0.0, 9000.0),
        event("user_annotation", "gpu_model_runner: preprocess", 500.0, 300.0),
        event("user_annotation", "too short", 600.0, 50.0),
        event("python_function", "connectors/vllm/layerwise.py(146): start", -2000.0, 1500.0),
    ]
    (tmp_path / "w.pt.trace.json.gz").write_bytes(
        gzip.compress(json.dumps({"traceEvents": events}).encode())
    )
    got = trace_summary(tmp_path)
    assert got is not None
    h2d = got["h2d"]
    assert h2d["n"] == 2 and h2d["GB"] == pytest.approx(0.1)
    assert (h2d["first_ms"], h2d["last_end_ms"], h2d["busy_ms"]) == (0.0, 4.0, 2.0)
    assert h2d["span_GBps"] == pytest.approx(25.0) and h2d["busy_GBps"] == pytest.approx(50.0)
    assert got["h2d_gaps_ms"] == [[2.0, 1.0]]
    assert got["kernels"]["n"] == 1 and got["kernels"]["first_ms"] == 1.5
    assert got["d2h"] == {"n": 0}
    assert got["host_ranges_ms"] == [["gpu_model_runner: preprocess", -0.5, 0.3]]
    assert got["python_before_first_copy_ms"] == [
        ["connectors/vllm/layerwise.py(146): start", -3.0, 1.5]
    ]


def test_the_layerwise_step_row_leaves_out_the_traced_hit(tmp_path: Path) -> None:
    """With ``--profile`` the traced hit is one more step with loads, after the cells'."""
    ttft = [{"H": 32768, "S": 64, "ttft_ms": [130.0], "compute_ms": [50.0], "L_ms": 78.0}]
    steps = {"steps": 2, "recent_ms": [[41.0, 0.5], [90.0, 0.5]]}
    profile = {name: {"n": 0} for name in ("h2d", "d2h", "d2d", "kernels")}
    run_ = {
        "mode": "lw-step",
        "eager": True,
        "link_GBps": 55.0,
        "ttft": ttft,
        "decode": [],
        "timings": {"layerwise_loads": steps},
        "profile": dict(profile, h2d_gaps_ms=[]),
    }
    (tmp_path / "bench-eager-lw-step.json").write_text(json.dumps(run_))
    report = run("report", str(tmp_path))
    assert [line.split() for line in report.splitlines() if "41/0" in line] == [
        ["lw-step", "41/0"]
    ], report
