"""The benchmark kit behind `offload-engine bench`: statistics, windows, figures, rigs."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest

from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.bench import (
    BenchPlan,
    LatencySeries,
    SweepPoint,
    percentile,
    run_window,
    series_label,
)
from offload_engine.bench.machine import Machine, check_host_memory, memory_size
from offload_engine.bench.plots import draw_latency, draw_throughput
from offload_engine.bench.rigs import RigShape, open_device_rig, open_host_rig
from offload_engine.bench.transfers import run_rig_cases
from offload_engine.device import CopyStrategy
from offload_engine.errors import InsufficientMemoryError
from offload_engine.testing import FakeHandler, FakeRuntime


def point(direction: str, n: int, walls: tuple[float, ...]) -> SweepPoint:
    return SweepPoint(
        medium="host",
        strategy="host-copy",
        variant="2 copy threads",
        direction=direction,
        blocks_per_job=n,
        block_bytes=1 << 17,
        depth=16,
        jobs=10,
        bytes_moved=2_000_000_000,
        wall_s=walls,
        p50_ms=1.0,
        p99_ms=2.0,
    )


def test_percentile_is_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(101)), 99) == 99
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_sweep_point_reports_the_median_run_and_the_spread() -> None:
    p = point("store", 8, (2.0, 1.0, 4.0))
    assert p.gbps == pytest.approx(1.0)  # median wall 2 s
    assert (p.gbps_min, p.gbps_max) == pytest.approx((0.5, 2.0))
    d = p.as_dict()
    assert d["wall_s"] == [2.0, 1.0, 4.0] and d["gbps"] == pytest.approx(1.0)


def test_labels_and_plan_sizes() -> None:
    assert series_label("host", "host-copy", "2 copy threads") == "host-copy (2 copy threads)"
    assert series_label("cuda:0", "dma", "") == "dma (cuda:0)"
    assert series_label("host", "host-copy", "") == "host-copy"
    plan = BenchPlan(bytes_per_point=1 << 20, min_jobs=4)
    assert plan.jobs_for(1, 1 << 17) == 8  # 1 MiB of 128 KiB jobs
    assert plan.jobs_for(64, 1 << 17) == 4  # at least min_jobs
    assert BenchPlan.quick().repeats == 1 and BenchPlan().repeats == 3


def test_run_window_returns_every_result_in_submit_order() -> None:
    spec = TransferSpec(gpu_blocks([1]), cpu_blocks([2]))
    with SyncOffloadingEngine([FakeHandler(latency=0.0005)]) as engine:
        results, wall = run_window(engine, [spec] * 50, depth=4)
    assert [r.job_id for r in results] == sorted(r.job_id for r in results)
    assert len(results) == 50 and all(r.success for r in results) and wall > 0


def test_rig_cases_measure_both_directions_on_the_host() -> None:
    shape = RigShape(num_layers=1, num_blocks=64, tier_blocks=64, kv_heads=1, head_dim=32)
    plan = BenchPlan(
        blocks_per_job=(1, 4),
        bytes_per_point=1 << 16,
        min_jobs=4,
        repeats=2,
        depth=4,
        latency_jobs=5,
        latency_depths=(1, 2),
        latency_blocks=2,
    )
    rig = open_host_rig(shape, workers=1)
    ticks: list[str] = []
    try:
        out = run_rig_cases(rig, plan, variant="1 copy thread", tick=ticks.append)
    finally:
        rig.close()
    assert len(ticks) == plan.steps
    assert {(p.direction, p.blocks_per_job) for p in out.sweep} == {
        (d, n) for d in ("store", "load") for n in (1, 4)
    }
    for p in out.sweep:
        assert len(p.wall_s) == 2 and p.gbps > 0
        assert p.bytes_moved == p.jobs * p.blocks_per_job * rig.block_bytes
    assert [(s.direction, s.depth, len(s.latencies_ms)) for s in out.latency] == [
        ("store", 1, 5),
        ("store", 2, 5),
        ("load", 1, 5),
        ("load", 2, 5),
    ]


def test_every_figure_names_the_machine_and_the_date() -> None:
    machine = Machine.detect()
    day = date.today().isoformat()
    series = [LatencySeries("host", "host-copy", "", "load", 8, 1, (1.0, 2.0, 3.0))]
    figures = [
        draw_throughput(
            [point("store", 1, (1.0,)), point("load", 1, (1.0,))], machine.label(), day
        ),
        draw_latency(series, machine.label(), day, note="quick"),
    ]
    for fig in figures:
        footer = " ".join(t.get_text() for t in fig.texts)
        assert f"machine: {machine.label()}" in footer and f"date: {day}" in footer
    assert f"{machine.cores} cores" in machine.label()


@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL])
def test_rig_cases_on_a_device_rig(strategy: CopyStrategy) -> None:
    """What bench runs per GPU strategy, on the fake runtime (host memory, thread streams)."""
    runtime = FakeRuntime()
    shape = RigShape(num_layers=1, num_blocks=32, tier_blocks=32, kv_heads=1, head_dim=64)
    plan = BenchPlan(
        blocks_per_job=(2,),
        bytes_per_point=1 << 14,
        min_jobs=3,
        repeats=1,
        depth=2,
        latency_jobs=3,
        latency_depths=(1,),
        latency_blocks=2,
    )
    try:
        rig = open_device_rig(
            runtime, shape, empty=runtime.empty, strategy=strategy, medium="fake:0"
        )
        try:
            out = run_rig_cases(rig, plan)
        finally:
            rig.close()
    finally:
        runtime.close()
    assert {(p.strategy, p.medium, p.direction) for p in out.sweep} == {
        (strategy.value, "fake:0", d) for d in ("store", "load")
    }
    assert all(p.bytes_moved == p.jobs * 2 * rig.block_bytes for p in out.sweep)
    assert [len(s.latencies_ms) for s in out.latency] == [3, 3]


@pytest.mark.parametrize(
    ("lo", "hi", "labels"),
    [
        (2.0, 30.0, ["2", "5", "10", "20", "50"]),  # the CPU quick run's range
        (0.3, 4.0, ["0.2", "0.5", "1", "2", "5"]),
        (0.02, 80.0, ["0.01", "0.1", "1", "10", "100"]),  # wide: powers of ten only
    ],
)
def test_latency_axis_has_plain_millisecond_ticks_that_do_not_overlap(
    lo: float, hi: float, labels: list[str]
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    values = tuple(lo * (hi / lo) ** (i / 99) for i in range(100))
    series = [
        LatencySeries("host", "host-copy", "", d, 8, depth, values)
        for d in ("store", "load")
        for depth in (1, 16)
    ]
    fig = draw_latency(series, "machine", "2026-11-23")
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = []
    for ax in fig.axes:
        shown = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
        assert [t.get_text() for t in shown] == labels  # no "2x10^0", no "$10^{1}$"
        assert ax.get_xticklabels(minor=True) == [] or not any(
            t.get_text() for t in ax.get_xticklabels(minor=True)
        )
        boxes += [t.get_window_extent(renderer) for t in shown]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)


def test_the_decode_step_keeps_its_shapes_and_the_plan_counts_its_ticks() -> None:
    import torch

    from offload_engine.bench.step import DecodeStep, StepPlan, StepRow, StepShape, format_step_rows

    shape = StepShape(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16,
                      batch=3, context=8)  # fmt: skip
    step = DecodeStep(shape, torch.device("cpu"))
    before = step.out.clone()
    step.run("eager")
    assert step.out.shape == (3, 64) and not torch.equal(step.out, before)
    assert bool(torch.isfinite(step.out.float()).all())
    with pytest.raises(RuntimeError, match="capture"):
        step.run("graph")
    quick = StepPlan.quick()
    assert quick.variants == ("none", "contiguous", "instant", "auto", "dma")
    assert quick.layouts == ("per-layer", "cross-layer")
    assert quick.ticks == 2 * 2 * 2 * 1 * 5  # layouts x modes x blocks x rounds x variants
    rows = [
        StepRow("eager", "default", 4, v, ms, ms / 4.0 - 1, 0.5)
        for v, ms in (("none", 4.0), ("contiguous", 4.1), ("auto", 4.2))
    ]
    [line] = format_step_rows(rows)
    assert "4.00 ms alone" in line and "contiguous +2.5%" in line and "auto +5.0%" in line
    # what auto took, job by job, and its calls' µs per step, beside its figure
    rows[2] = StepRow(
        "eager", "default", 4, "auto", 4.2, 0.05, 0.5, taken="dma:60,staged:6", calls_us=151.4
    )
    [line] = format_step_rows(rows)
    assert "auto +5.0% (calls 151 us, drain 0.5 ms; dma:60,staged:6)" in line


def test_allocator_slots_come_in_runs_as_vllms_cpu_allocator_hands_them_out() -> None:
    from offload_engine.bench.slots import allocator_slots

    jobs = allocator_slots(12, 4, 6)
    assert [j.tolist() for j in jobs] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],  # fresh slots, ascending, until the tier is full
        [3, 2, 1, 0],  # then the oldest evicted, reused last-in first-out: descending
        [7, 6, 5, 4],
        [11, 10, 9, 8],
    ]
    with pytest.raises(ValueError, match="do not fit"):
        allocator_slots(4, 5, 1)


def test_memory_sizes_read_in_gib_up_to_a_tib_then_in_bigger_units() -> None:
    assert memory_size(0) == "0.0 GiB"
    assert memory_size(201 * 2**20) == "0.2 GiB"
    assert memory_size(23.5 * 2**30) == "23.5 GiB"
    assert memory_size(1023.9 * 2**30) == "1023.9 GiB"
    assert memory_size(2**40) == "1.0 TiB"
    assert memory_size(2343750 * 2**30) == "2.2 PiB"
    assert memory_size(3 * 2**60) == "3.0 EiB"
    assert memory_size(5000 * 2**60) == "5000.0 EiB"


def test_host_memory_check_names_both_sizes() -> None:
    check_host_memory(100, "it needs", available=100)
    with pytest.raises(
        InsufficientMemoryError,
        match=r"^the chunks need 3\.0 TiB of host memory, but only 2\.0 GiB is available$",
    ):
        check_host_memory(3 * 2**40, "the chunks need", available=2 * 2**30)


def _run_script(name: str, *args: str) -> str:
    """Run ``benchmarks/<name>`` from the checkout; its standard output."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / name), *args],
        check=False,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_delivery_latency_script_prints_each_pollers_delay() -> None:
    """benchmarks/delivery_latency.py (cited in docs/vllm.md) runs and prints its three rows."""
    out = _run_script("delivery_latency.py", "--jobs", "3")
    rows = re.findall(r"^  (\w[\w ,.]+?)\s+median\s+([\d.]+)\s+p90\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == [
        "sleeps between polls",
        "runs Python between polls",
        "runs Python, switch interval 0.5 ms",
    ], out


def test_the_launch_burst_script_prints_both_launch_modes() -> None:
    """benchmarks/launch_burst.py (cited in docs/performance.md) runs and prints a row per
    launch mode with the jobs launched during the burst."""
    out = _run_script("launch_burst.py", "--jobs", "8")
    rows = re.findall(r"^  (.+?)\s+submits\s+[\d.]+ ms, launched during them\s+(\d+)", out, re.M)
    assert [r[0] for r in rows] == ["loop launch (default)", "submitter_launch"], out


def test_the_big_submit_script_loads_layer_wise_and_whole() -> None:
    """benchmarks/device/big_submit.py runs on the fake runtime (each load checked done and
    successful) and prints a row per mode, with the profile when asked."""
    out = _run_script("device/big_submit.py", "--blocks", "64", "--reps", "2", "--profile")
    rows = re.findall(r"^  (\w+)\s+submit\s+[\d.]+ \([\d.]+-[\d.]+\)\s+done\s+[\d.]+$", out, re.M)
    assert rows == ["layerwise", "whole"], out
    assert "submit_load_layers" in out and "cumulative" in out, out
