"""The model-step pass's CPU-side parts: its plan, the moved blocks' caches in both
layouts, backpressure in the step loop, its table and its figure (the pass itself
needs CUDA: tests/gpu/test_cuda.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_engine import (
    Medium,
    QueueFullError,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.bench.plots import draw_step, step_figure
from offload_engine.bench.step import (
    CROSS_LAYER,
    INSTANT,
    LAYOUTS,
    PER_LAYER,
    StepPlan,
    StepRow,
    _Mover,
    format_step_rows,
    step_cache,
)
from offload_engine.errors import ConfigError
from offload_engine.testing import FakeHandler

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_the_default_plan_measures_both_layouts_up_to_the_saturated_link() -> None:
    plan = StepPlan()
    assert plan.layouts == LAYOUTS == (PER_LAYER, CROSS_LAYER)
    assert plan.blocks == (4, 16, 32)
    assert plan.capacity is None  # the engine's own default
    assert plan.ticks == 2 * 4 * 3 * 3 * 5
    assert StepPlan(layouts=(CROSS_LAYER,)).ticks == plan.ticks // 2


@pytest.mark.parametrize(
    "bad",
    [
        {"layouts": ("paged",)},
        {"layouts": ()},
        {"blocks": (4, 300)},  # more than half the 512-block cache
        {"blocks": (0,)},
        {"blocks": ()},
        {"capacity": 0},
    ],
)
def test_a_plan_that_cannot_run_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        StepPlan(**bad)


def test_both_caches_hold_2_mib_blocks_as_per_layer_regions_or_one_region() -> None:
    per_layer = step_cache(PER_LAYER, 2, torch.device("cpu"))
    cross = step_cache(CROSS_LAYER, 2, torch.device("cpu"))
    assert per_layer.slot_bytes == cross.slot_bytes == 2 << 20
    assert per_layer.num_blocks == cross.num_blocks == 2
    assert len(per_layer.tensors) == 32 and len(per_layer.groups[0]) == 64  # K and V a layer
    assert len(cross.tensors) == 1 and len(cross.groups[0]) == 1
    with pytest.raises(ConfigError, match="paged"):
        step_cache("paged", 2, torch.device("cpu"))


def _specs(n: int) -> tuple[list[TransferSpec], list[TransferSpec]]:
    loads = [TransferSpec(cpu_blocks([i]), gpu_blocks([i])) for i in range(n)]
    stores = [TransferSpec(gpu_blocks([i]), cpu_blocks([i])) for i in range(n)]
    return loads, stores


def test_a_step_waits_for_its_oldest_job_when_the_queue_is_full() -> None:
    """At capacity a submit waits for the oldest pending job of its own direction and
    counts the wait; no QueueFullError reaches the step."""
    handlers = [
        FakeHandler(Medium.GPU, Medium.CPU, latency=0.1),
        FakeHandler(Medium.CPU, Medium.GPU, latency=0.1),
    ]
    engine = SyncOffloadingEngine(handlers, capacity=2)
    mover = _Mover(INSTANT, 1, 1, torch.device("cpu"), engine)
    loads, stores = _specs(4)
    try:
        for spec in stores:
            mover.move(spec, 1, store=True)
        for spec in loads:  # the stores still hold their queue: loads wait for loads
            mover.move(spec, 1, store=False)
            mover.poll()
        assert mover.queue_full >= 2  # each direction's third job found two in flight
        mover.drain()
        assert mover.pending == []
        assert len(handlers[0].completed) == len(handlers[1].completed) == 4
    finally:
        mover.close()


def test_steps_that_wait_for_room_keep_every_job_they_submit_pending() -> None:
    """A submit that waited for room still records its job as pending, so the next
    step in that direction waits for it rather than finding the queue full with
    nothing of its own to wait for (steps of a store and a load, room for one each)."""
    handlers = [
        FakeHandler(Medium.GPU, Medium.CPU, latency=0.0005),
        FakeHandler(Medium.CPU, Medium.GPU, latency=0.0005),
    ]
    engine = SyncOffloadingEngine(handlers, capacity=1)
    mover = _Mover(INSTANT, 1, 1, torch.device("cpu"), engine)
    loads, stores = _specs(100)
    try:
        for load, store in zip(loads, stores, strict=True):
            mover.move(load, 1, store=False)
            mover.move(store, 1, store=True)
            mover.poll()
        mover.drain()
        assert mover.queue_full > 0
        assert len(handlers[0].completed) == len(handlers[1].completed) == 100
    finally:
        mover.close()


def test_a_full_queue_with_nothing_of_the_step_pending_is_raised() -> None:
    """Backpressure the step cannot relieve (another caller's job fills the queue) is not
    waited out forever."""
    store = FakeHandler(Medium.GPU, Medium.CPU, manual=True)
    engine = SyncOffloadingEngine([store, FakeHandler(Medium.CPU, Medium.GPU)], capacity=1)
    mover = _Mover(INSTANT, 1, 1, torch.device("cpu"), engine)
    _, stores = _specs(2)
    try:
        other = engine.submit_nowait(stores[0])
        with pytest.raises(QueueFullError):
            mover.move(stores[1], 1, store=True)
        assert mover.queue_full == 0
        store.wait_launched_blocking(1)
        store.complete(other)
        engine.wait([other])
    finally:
        mover.close()


def _rows() -> list[StepRow]:
    rows = []
    for layout in LAYOUTS:
        for mode, stream in (("eager", "default"), ("graph", "side")):
            for n in (4, 16, 32):
                for v, pct in (("none", 0.0), ("contiguous", 1.0), ("instant", 0.5),
                               ("auto", 2.0), ("dma", 3.0)):  # fmt: skip
                    slowdown = pct * n / 16 / 100
                    waits = 3 if (v == "auto" and n == 32) else 0
                    rows.append(StepRow(mode, stream, n, v, 4.0 * (1 + slowdown), slowdown,
                                        0.4, layout, waits, calls_us=100 + 10 * pct))  # fmt: skip
    return rows


def test_the_table_shows_the_layout_and_the_waits_for_room() -> None:
    lines = format_step_rows(_rows())
    assert len(lines) == 2 * 2 * 3
    assert "per-layer" in lines[0] and "cross-layer" in lines[-1]
    assert "waits for room" not in lines[0]
    [saturated] = [x for x in lines if "per-layer" in x and "eager" in x and " 32 blocks" in x]
    assert "auto +4.0% (calls 120 us, drain 0.4 ms, 3 waits for room)" in saturated
    assert "dma +6.0% (calls 130 us, drain 0.4 ms)" in saturated


def test_the_step_figure_has_a_panel_per_layout_and_mode_and_draws_the_floor(
    tmp_path: Path,
) -> None:
    rows = [r.as_dict() for r in _rows()]
    fig = draw_step(rows, "fake", "2026-11-26")
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [
        f"{layout}, {mode}, {stream} stream"
        for layout in LAYOUTS
        for mode, stream in (("eager", "default"), ("graph", "side"))
    ]
    [legend] = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[:2] == [
        "target: floor + 1.5 points (+3 from 32 blocks)",
        "floor: one contiguous copy each way",
    ]
    assert labels[2:] == ["instant", "auto", "dma"]  # "none" is the zero line
    path = step_figure(rows, "fake", "2026-11-26", tmp_path / "step.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_step_figure_takes_rows_of_several_runs_and_rows_without_a_layout(
    tmp_path: Path,
) -> None:
    """The recorded result (the one docs/performance.md cites, whatever its date), its
    two rounds drawn as medians with bars; rows that name no layout (as results before
    the cross-layer cache did) are per-layer."""
    [path] = sorted(RESULTS.glob("h100-*-step.json"))
    recorded = json.loads(path.read_text())
    rows = [r for r in recorded["rows"] if r["pass"] == "step"]
    fig = draw_step(rows, recorded["device"], recorded["date"])
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 8
    assert {ax.get_title().split(",")[0] for ax in panels} == {"per-layer", "cross-layer"}
    assert "median of 2 runs" in panels[0].get_ylabel()
    bare = [{k: v for k, v in r.items() if k != "layout"} for r in rows if r["layout"] == PER_LAYER]
    fig = draw_step(bare, recorded["device"], recorded["date"])
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 4 and all(ax.get_title().startswith("per-layer") for ax in panels)


def test_bench_device_cuda_runs_the_step_pass_and_draws_its_figure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``offload-engine bench --device cuda`` with the GPU passes faked: the step pass gets
    the quick plan (both layouts), its rows go into the report and into step.png."""
    from offload_engine.bench import CaseResults
    from offload_engine.bench import cuda as bench_cuda
    from offload_engine.cli import main
    from offload_engine.device.runtimes import probe as runtimes
    from offload_engine.runtimes import RuntimeInfo

    fake = RuntimeInfo("cuda", True, "simulated", ("cuda:0 Simulated GPU",), ("dma",))
    monkeypatch.setattr(runtimes, "probe_cuda", lambda: fake)
    plans: list[StepPlan] = []

    def step(plan: StepPlan, *, tick: Any) -> list[StepRow]:
        plans.append(plan)
        return _rows()

    monkeypatch.setattr(bench_cuda, "run_cuda_cases", lambda *a, **k: CaseResults([], []))
    monkeypatch.setattr(bench_cuda, "run_cuda_step", step)
    monkeypatch.setattr(bench_cuda, "run_cuda_ttft", lambda *a, **k: [])
    assert main(["bench", "--quick", "--device", "cuda", "-o", str(tmp_path)]) == 0
    [plan] = plans
    assert plan == StepPlan.quick() and plan.layouts == LAYOUTS
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["figures"]["step"] == "step.png"
    assert [r["layout"] for r in report["step"]] == [r.layout for r in _rows()]
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "step cross-layer" in out and "3 waits for room" in out and "step.png" in out
