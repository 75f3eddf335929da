"""The store pass (offload_engine.bench.ttft_stores) on the fake runtime: tiny shapes, every
variant run, every field filled, the layer-wise stores checked byte for byte."""

from __future__ import annotations

from typing import Any

import pytest

from offload_engine.bench.ttft import TtftBench, TtftPlan
from offload_engine.bench.ttft_stores import (
    StoreBench,
    format_store_rows,
    run_store_pass,
    store_ticks,
    store_variants,
)
from offload_engine.errors import ConfigError
from offload_engine.testing import FakeRuntime
from offload_engine.vocabulary import Direction
from tests.test_bench_ttft import SHAPE, CorruptingRuntime, fake, fake_device

__all__ = ["fake"]  # the fixture, shared with the TTFT pass's tests

PLAN = TtftPlan(shape=SHAPE, hits=(64,), new=(16, 32), layers_per_load=(1, 3), reps=2)


class CorruptingStores(CorruptingRuntime):
    """Flips the first byte of every device-to-host batched copy after it lands."""

    corrupts = Direction.STORE


def test_the_pass_runs_every_variant_and_checks_the_stores(fake: FakeRuntime) -> None:
    ticks: list[str] = []
    rows = run_store_pass(fake_device(fake), PLAN, tick=ticks.append)
    assert len(ticks) == store_ticks(PLAN)
    assert store_variants(PLAN) == ("C", "s1", "s2-1", "s2-3")
    assert [(r["hit_tokens"], r["new_tokens"]) for r in rows] == [(64, 16), (64, 32)]
    for r in rows:
        assert r["bit_exact"] and r["errors"] == []
        assert r["mismatched_blocks"] == {"1": 0, "3": 0}
        assert r["new_bytes"] == r["new_tokens"] // 16 * SHAPE.block_bytes
        assert r["compute_ms"] > 0 and r["after_prefill_ms"] > 0
        assert r["after_done_ms"] >= r["after_prefill_ms"]
        for g in ("1", "3"):
            assert r["layerwise_done_ms"][g] >= r["layerwise_prefill_ms"][g] > 0
            assert r["layerwise_prefill_vs_compute"][g] > 0
            assert r["layerwise_done_vs_after"][g] > 0
        assert {v: len(x) for v, x in r["samples_ms"].items()} == dict.fromkeys(
            store_variants(PLAN), 2
        )
    table = format_store_rows(rows)
    assert len(table) == 4 and "s2 done G=3" in table[0] and "bit-exact" in table[1]


def test_each_part_stores_the_bytes_its_layers_computed(fake: FakeRuntime) -> None:
    """Over poisoned new blocks, every part's store holds the forward pass's K and V."""
    bench = TtftBench(fake_device(fake), PLAN)
    try:
        stores = StoreBench(bench)
        for g in (1, 2, 4):
            assert stores.mismatched(64, 32, g) == 0
    finally:
        bench.close()


def test_a_corrupted_store_is_reported_as_a_mismatch() -> None:
    runtime = CorruptingStores()
    try:
        plan = TtftPlan(shape=SHAPE, hits=(32,), new=(16,), layers_per_load=(2,), reps=1)
        [row] = run_store_pass(fake_device(runtime), plan)
    finally:
        runtime.close()
    assert not row["bit_exact"] and row["mismatched_blocks"]["2"] > 0
    assert "G=2" in row["errors"][0] and "differ" in row["errors"][0]
    assert "ERROR: G=2" in format_store_rows([row])[1]


def test_new_blocks_past_the_tier_are_refused(fake: FakeRuntime) -> None:
    plan = TtftPlan(shape=SHAPE, hits=(16,), new=(32,), layers_per_load=(2,), reps=1)
    with pytest.raises(ConfigError, match="must not exceed the largest hit"):
        run_store_pass(fake_device(fake), plan)


def test_bench_device_cuda_ttft_stores_reports_the_store_pass(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``offload-engine bench --device cuda --ttft-stores`` with the GPU faked: the store
    pass runs on the fake runtime, its rows go into the report and the printout."""
    import json

    from offload_engine.bench import CaseResults
    from offload_engine.bench import cuda as bench_cuda
    from offload_engine.cli import main
    from offload_engine.device.runtimes import probe as runtimes
    from offload_engine.runtimes import RuntimeInfo

    gpu = RuntimeInfo("cuda", True, "simulated", ("cuda:0 Simulated GPU",), ("dma",))
    monkeypatch.setattr(runtimes, "probe_cuda", lambda: gpu)
    asked: list[bool] = []

    def ttft(plan: TtftPlan, *, tick: Any, stores: bool = False) -> list[dict[str, Any]]:
        asked.append(stores)
        if not stores:
            return []
        runtime = FakeRuntime()
        try:
            small = TtftPlan(shape=SHAPE, hits=(32,), new=(16,), layers_per_load=(2,), reps=1)
            return run_store_pass(fake_device(runtime), small, tick=tick)
        finally:
            runtime.close()

    monkeypatch.setattr(bench_cuda, "run_cuda_cases", lambda *a, **k: CaseResults([], []))
    monkeypatch.setattr(bench_cuda, "run_cuda_step", lambda *a, **k: [])
    monkeypatch.setattr(bench_cuda, "run_cuda_ttft", ttft)
    argv = ["bench", "--quick", "--device", "cuda", "--ttft-stores", "-o", str(tmp_path)]
    assert main(argv) == 0
    assert asked == [False, True]
    report = json.loads((tmp_path / "report.json").read_text())
    [row] = report["ttft_stores"]
    assert row["bit_exact"] and set(row["layerwise_done_ms"]) == {"2"}
    assert "Stores of a prefill's new blocks" in capsys.readouterr().out
