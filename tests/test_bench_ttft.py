"""The time-to-first-token pass (offload_engine.bench.ttft) on the fake runtime: tiny shapes,
every variant run, every field filled, the layer-wise loads checked byte for byte."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from offload_engine.bench.ttft import (
    TtftDevice,
    TtftPlan,
    TtftShape,
    format_ttft_rows,
    run_ttft_pass,
)
from offload_engine.errors import ConfigError
from offload_engine.testing import FakeRuntime
from offload_engine.vocabulary import Direction

SHAPE = TtftShape(
    layers=4,
    hidden=64,
    intermediate=128,
    heads=4,
    kv_heads=2,
    head_dim=32,
    block_tokens=16,
    dtype=torch.float32,
)
PLAN = TtftPlan(shape=SHAPE, hits=(64,), new=(16, 32), layers_per_load=(1, 3), reps=2)


class CorruptingRuntime(FakeRuntime):
    """Flips the first byte of every batched copy of direction ``corrupts`` (host to
    device) after it lands."""

    corrupts = Direction.LOAD

    def memcpy_batch(self, stream: Any, dst: Any, src: Any, sizes: Any, kind: Direction) -> int:
        calls = super().memcpy_batch(stream, dst, src, sizes, kind)
        if kind is self.corrupts:
            first = int(dst[0])

            def flip() -> None:
                byte = ctypes.c_ubyte.from_address(first)
                byte.value ^= 0xFF

            stream.enqueue(flip)
        return calls


def fake_device(runtime: FakeRuntime) -> TtftDevice:
    return TtftDevice(
        runtime,
        runtime.empty,
        launch=lambda work: runtime.enqueue(runtime.current_stream(), work),
        launch_on=runtime.enqueue,
    )


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


def test_the_pass_runs_every_variant_on_the_fake_runtime(fake: FakeRuntime) -> None:
    ticks: list[str] = []
    rows = run_ttft_pass(fake_device(fake), PLAN, tick=ticks.append)
    assert len(ticks) == PLAN.ticks
    assert [(r["hit_tokens"], r["new_tokens"]) for r in rows] == [(64, 16), (64, 32)]
    for r in rows:
        assert r["bit_exact"] and r["errors"] == []
        assert r["mismatched_blocks"] == {"1": 0, "3": 0}
        assert set(r["layerwise_ms"]) == {"1", "3"}
        assert r["best_layers_per_load"] in (1, 3)
        assert r["hit_bytes"] == 4 * SHAPE.block_bytes
        for key in (
            "load_ms",
            "compute_ms",
            "load_then_compute_ms",
            "recompute_ms",
            "layerwise_best_ms",
            "best_vs_bound",
            "best_floor_ms",
            "floor_vs_bound",
            "best_vs_floor",
            "staged_floor_vs_bound",
            "best_vs_load_then_compute",
            "ideal_vs_load_then_compute",
            "load_gbps",
        ):
            assert r[key] > 0, key
        assert all(t > 0 for t in r["layerwise_ms"].values())
        assert 0.5 <= r["ideal_vs_load_then_compute"] < 1
        assert {v: len(x) for v, x in r["samples_ms"].items()} == dict.fromkeys(PLAN.variants, 2)
        assert r["attention"] == "sdpa-gqa"
    table = format_ttft_rows(rows)
    assert len(table) == 4 and "b G=3" in table[0] and "bit-exact" in table[1]


def test_layerwise_compute_reads_the_loaded_hit_not_the_poison(fake: FakeRuntime) -> None:
    """The forward pass of b (waiting on each part's fence on the compute stream) ends in
    the same hidden states as a (a host wait for the whole load), both started on a
    poisoned cache, and differs from a forward pass over the poison."""
    from offload_engine.bench.ttft import TtftBench

    bench = TtftBench(fake_device(fake), PLAN)
    try:
        out = {}
        for variant in ("a", "b1", "b3"):
            bench.run(variant, 64, 16)
            assert bench.model.state is not None
            out[variant] = bench.model.state.clone()
        bench.poison(64)
        bench.run("C", 64, 16)
        assert bench.model.state is not None
        poisoned = bench.model.state.clone()
    finally:
        bench.close()
    assert torch.equal(out["a"], out["b1"]) and torch.equal(out["a"], out["b3"])
    assert not torch.equal(out["a"], poisoned)


class SlowCopies(FakeRuntime):
    """Each batched copy lands 10 ms after its stream reaches it."""

    def memcpy_batch(self, stream: Any, dst: Any, src: Any, sizes: Any, kind: Direction) -> int:
        stream.enqueue(lambda: time.sleep(0.01))
        return super().memcpy_batch(stream, dst, src, sizes, kind)


def test_the_floor_moves_the_hits_bytes_and_the_forward_waits_for_them() -> None:
    """The floor's parts copy the hit's tier bytes into the floor's buffer, and the
    forward pass waits on each part before its layers: the compute stream finds the
    layer's bytes in place at every layer, though every copy lands late."""
    from offload_engine.bench.ttft import TtftBench

    fake = SlowCopies()
    bench = TtftBench(fake_device(fake), PLAN)
    nbytes = 64 // SHAPE.block_tokens * SHAPE.block_bytes
    seen: list[bool] = []
    step = bench.model.step

    def checked_step(i: int, *args: Any) -> None:
        lo, hi = nbytes * i // SHAPE.layers, nbytes * (i + 1) // SHAPE.layers
        want = bench.tier.span[lo:hi]
        seen.append(torch.equal(bench.floor_dst[lo:hi].cpu(), want))
        step(i, *args)

    try:
        bench.floor_dst.zero_()
        bench.model.step = checked_step  # type: ignore[method-assign]
        bench.run("f1", 64, 16)
        assert seen == [True] * SHAPE.layers
        assert torch.equal(bench.floor_dst[:nbytes].cpu(), bench.tier.span[:nbytes])
    finally:
        bench.model.step = step  # type: ignore[method-assign]
        bench.close()
        fake.close()


def test_the_staged_floor_places_each_parts_bytes_before_its_layers() -> None:
    """The staged floor scatters each part's bytes into its layers' hit blocks, and each
    layer's compute finds them there, though every copy lands late."""
    from offload_engine.bench.ttft import TtftBench

    fake = SlowCopies()
    bench = TtftBench(fake_device(fake), PLAN)
    nh = 64 // SHAPE.block_tokens
    hit = bench.table[:nh]
    seen: list[bool] = []
    step = bench.model.step

    def checked_step(i: int, *args: Any) -> None:
        cache = bench.cache[i]
        per = cache[0].numel() * cache.element_size()
        lo = i * nh * per  # G = 1: part i's bytes, then its one layer
        want = bench.floor_dst[lo : lo + nh * per].view(cache.dtype).view(nh, *cache.shape[1:])
        seen.append(torch.equal(cache.index_select(0, hit), want))
        step(i, *args)

    try:
        bench.model.step = checked_step  # type: ignore[method-assign]
        bench.run("s1", 64, 16)
        assert seen == [True] * SHAPE.layers
    finally:
        bench.model.step = step  # type: ignore[method-assign]
        bench.close()
        fake.close()


def test_a_corrupted_layerwise_load_is_reported_as_a_mismatch() -> None:
    runtime = CorruptingRuntime()
    try:
        plan = TtftPlan(shape=SHAPE, hits=(32,), new=(16,), layers_per_load=(2,), reps=1)
        [row] = run_ttft_pass(fake_device(runtime), plan)
    finally:
        runtime.close()
    assert not row["bit_exact"]
    assert row["mismatched_blocks"]["2"] > 0
    assert "G=2" in row["errors"][0] and "differ" in row["errors"][0]
    assert "ERROR: G=2" in format_ttft_rows([row])[1]


def test_the_model_attends_causally_to_the_hit_and_the_new_tokens() -> None:
    """The new tokens' output equals a dense reference: causal attention, aligned to the
    last key, over the hit's K/V read from the paged cache and the new K/V written there."""
    from offload_engine.bench.ttft import PrefillModel

    torch.manual_seed(0)
    s = SHAPE
    model = PrefillModel(s, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    cache = torch.randn(6, 2, s.block_tokens, s.kv_heads, s.head_dim)
    table = torch.tensor([4, 1, 3])  # two hit blocks, then the new tokens' block
    x = torch.randn(s.block_tokens, s.hidden)
    hit_k = cache[table[:2], 0].reshape(-1, s.kv_heads, s.head_dim)
    hit_v = cache[table[:2], 1].reshape(-1, s.kv_heads, s.head_dim)
    out = model.layer(x, cache, table)

    f = torch.nn.functional
    h = f.rms_norm(x, (s.hidden,), model.norm)
    q, k, v = torch.split(h @ model.qkv, [128, 64, 64], dim=-1)
    keys = torch.cat([hit_k, k.reshape(-1, s.kv_heads, s.head_dim)])
    values = torch.cat([hit_v, v.reshape(-1, s.kv_heads, s.head_dim)])
    assert torch.equal(cache[3, 0].reshape(-1, s.kv_heads, s.head_dim), keys[32:])
    group = s.heads // s.kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.reshape(16, s.heads, s.head_dim), keys)
    scores = scores / s.head_dim**0.5
    allowed = torch.ones(16, 48, dtype=torch.bool).tril(32)
    attn = torch.einsum(
        "hqk,khd->qhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), values
    )
    want = x + attn.reshape(16, -1) @ model.o
    h = f.rms_norm(want, (s.hidden,), model.norm)
    gate, up = (h @ model.gate_up).chunk(2, dim=-1)
    want = want + (f.silu(gate) * up) @ model.down
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "bad",
    [
        {"hits": (100,)},
        {"new": ()},
        {"layers_per_load": (0,)},
        {"reps": 0},
    ],
)
def test_a_plan_that_cannot_run_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        TtftPlan(**bad)


def test_the_quick_plan_is_small() -> None:
    plan = TtftPlan.quick()
    assert plan.hits == (2048,) and plan.new == (128, 512) and plan.reps == 1
    assert plan.cache_blocks == (2048 + 512) // 16
    # the full plan's KV cache (4.25 GiB), the hit's reference copy and the floor's
    # buffer (4 GiB each), one layer's weights and the recompute's activations over
    # 34,816 tokens
    assert 16 << 30 < TtftPlan().device_bytes() < 20 << 30


def test_the_grid_is_drawn(fake: FakeRuntime, tmp_path: Any) -> None:
    from offload_engine.bench.plots import ttft_figure

    rows = run_ttft_pass(fake_device(fake), PLAN)
    assert all(set(r["layerwise_load_ms"]) == {"1", "3"} for r in rows)
    assert all(set(r["floor_ms"]) == set(r["staged_floor_ms"]) == {"1", "3"} for r in rows)
    path = ttft_figure(rows, "fake", "2026-11-26", tmp_path / "ttft.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
