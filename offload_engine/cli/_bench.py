"""``offload-engine bench``: transfer benchmarks for the hardware present.

Host memory always: the host handler's GB/s against blocks per job, the job
latency distribution, and the engine's own overhead. The GPU when CUDA is
usable: the same cases once per copy strategy (:mod:`offload_engine.bench.cuda`).
Writes ``report.json``, ``throughput.png`` and ``latency.png`` into the
output directory, and ``step.png`` where the GPU's model-step pass ran.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offload_engine.bench import BenchPlan, CaseResults, LatencySeries, SweepPoint
from offload_engine.bench.rigs import RigShape
from offload_engine.cli._console import progress_bar
from offload_engine.cli._report import output_dir, report_header
from offload_engine.device.runtimes import probe as runtimes

if TYPE_CHECKING:
    from offload_engine.bench.overhead import OverheadResult
    from offload_engine.bench.step import StepPlan, StepRow
    from offload_engine.bench.ttft import TtftPlan
    from offload_engine.device.runtimes.probe import RuntimeInfo

SCHEMA = "offload-engine-bench/1"
BENCH_SHAPE = RigShape(tier_blocks=1024)  # 1,024 blocks of 128 KiB on each side
REPORT = "report.json"
THROUGHPUT_PNG = "throughput.png"
LATENCY_PNG = "latency.png"
STEP_PNG = "step.png"  # where the model-step pass ran
OVERHEAD_JOBS = (100_000, 3000)  # jobs, latency samples
QUICK_OVERHEAD_JOBS = (5000, 300)
DISK_VOLUME_MIB = 512  # bench --tier disk: MiB each system writes and reads per chunk size


def _label(medium: str, strategy: str) -> str:
    return strategy if medium == "host" else f"{strategy} {medium}"


def _sweep_table(points: list[SweepPoint]) -> Any:
    """Blocks per job down, one GB/s column per (strategy, direction)."""
    from rich.table import Table

    table = Table(title="GB/s against blocks per job", title_justify="left")
    table.add_column("blocks/job", justify="right")
    table.add_column("MiB/job", justify="right")
    columns: dict[tuple[str, str], dict[int, SweepPoint]] = {}
    variants: dict[str, str] = {}
    for p in points:
        label = _label(p.medium, p.strategy)
        columns.setdefault((label, p.direction), {})[p.blocks_per_job] = p
        if p.variant:
            variants[label] = p.variant
    for label, direction in columns:
        table.add_column(f"{label}\n{direction}", justify="right")
    table.caption = "; ".join(f"{k}: {v}" for k, v in variants.items()) or None
    table.caption_justify = "left"
    for n in sorted({p.blocks_per_job for p in points}):
        block_bytes = next(p.block_bytes for p in points if p.blocks_per_job == n)
        cells = [f"{col[n].gbps:.2f}" if n in col else "-" for col in columns.values()]
        table.add_row(str(n), f"{n * block_bytes / 2**20:g}", *cells)
    return table


def _latency_table(series: list[LatencySeries]) -> Any:
    from rich.table import Table

    table = Table(title="Job latency, submit -> result", title_justify="left")
    for col in ("strategy", "direction", "blocks/job", "in flight", "jobs"):
        table.add_column(col, justify="left" if col in ("strategy", "direction") else "right")
    table.add_column("p50 ms", justify="right")
    table.add_column("p99 ms", justify="right")
    for s in series:
        table.add_row(
            _label(s.medium, s.strategy),
            s.direction,
            str(s.blocks_per_job),
            str(s.depth),
            f"{len(s.latencies_ms):,}",
            f"{s.p50_ms:.3f}",
            f"{s.p99_ms:.3f}",
        )
    return table


def _disk_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(
        title=f"disk tier, {report['plan']['chunk_bytes'] / 2**20:g} MiB chunks, cold (O_DIRECT), "
        f"side by side, median of {report['repeats']}, queue depth "
        f"{report['queue_depth_from']}",
        title_justify="left",
    )
    for col in ("system", "direction", "GB/s", "seconds", "O_DIRECT", "submit us/chunk"):
        table.add_column(col, justify="left" if col in ("system", "direction") else "right")
    for f in report["figures"]:
        submit = f["submit_us_per_chunk"]
        table.add_row(
            f["system"],
            f["direction"],
            f"{f['gbps']:.3f}",
            f"{f['seconds']:.3f}",
            "yes" if f["direct"] else "no",
            "-" if submit is None else f"{submit:.1f}",
        )
    table.caption = "; ".join(f"{k} = {v:.2f}" for k, v in report["ratios"].items())
    table.caption_justify = "left"
    return table


def _disk_plans(args: argparse.Namespace) -> list[Any]:
    """One plan per chunk size: ``--chunk-mib`` or ``--chunk-kib`` (default 2 MiB,
    1 MiB with ``--quick``), ``--volume-mib`` of them (default 512 MiB, 32 chunks
    with ``--quick``); :class:`InsufficientMemoryError` before anything is
    allocated if host memory cannot hold a plan."""
    from offload_engine.bench.disk import DiskBenchPlan
    from offload_engine.bench.machine import available_memory_bytes, memory_size
    from offload_engine.errors import InsufficientMemoryError

    if args.chunk_mib:
        sizes = args.chunk_mib
    elif args.chunk_kib is not None:
        sizes = [args.chunk_kib * 1024]
    else:
        sizes = [2**20 if args.quick else 2 * 2**20]
    plans = []
    for chunk in sizes:
        if args.quick:
            plan = DiskBenchPlan.quick(chunk, args.volume_mib)
        else:
            plan = DiskBenchPlan.of_volume(chunk, args.volume_mib or DISK_VOLUME_MIB)
        plan = replace(plan, queue_depth=args.queue_depth)
        free = available_memory_bytes()
        if free is not None and plan.host_bytes() > free:
            raise InsufficientMemoryError(
                f"{plan.chunks} chunks of {chunk / 2**20:g} MiB need "
                f"{memory_size(plan.host_bytes())} of host memory (the data, the host tier "
                f"and vLLM's buffer), but only {memory_size(free)} is available"
            )
        plans.append(plan)
    return plans


def cmd_bench_disk(args: argparse.Namespace) -> int:
    """``bench --tier disk``: the engine's disk tier, fio and vLLM's fs tier, one run
    per chunk size (``--chunk-mib``), ratios per size."""
    from rich.console import Console

    from offload_engine.bench.disk import disk_bytes_needed, run_disk_bench
    from offload_engine.bench.machine import Machine

    directory = Path(args.dir)  # a directory: checked with the usage
    plans = _disk_plans(args)
    repeats = 1 if args.quick else 3
    free = shutil.disk_usage(directory).free
    for plan in plans:
        need = disk_bytes_needed(plan, repeats)
        if need > free:
            raise OSError(
                f"--dir {directory}: {plan.chunks} chunks of {plan.chunk_bytes / 2**20:g} MiB "
                f"need {need / 2**30:.2f} GiB of free space ({repeats} repeat(s) of every "
                f"system), but only {free / 2**30:.2f} GiB is free; lower --volume-mib"
            )
    out_dir = output_dir(args)
    runs = [run_disk_bench(directory, plan, repeats=repeats) for plan in plans]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "command": shlex.join(["offload-engine", *args.argv]),
        "date": date.today().isoformat(),
        "machine": args.machine_label or Machine.detect(gpus=()).label(),
        "runs": runs,
        "ratios": {
            f"{r['plan']['chunk_bytes'] / 2**20:g} MiB {k}": v
            for r in runs
            for k, v in r["ratios"].items()
        },
    }
    (out_dir / "disk-report.json").write_text(json.dumps(report, indent=1) + "\n")
    out = Console()
    out.print(f"disk bench on {report['machine']}, {report['date']}", markup=False)
    for r in runs:
        out.print(_disk_table(r))
    for name, why in runs[0]["skipped"].items():
        out.print(f"note: no {name} rows: {why}", markup=False)
    out.print(f"wrote {out_dir / 'disk-report.json'}", markup=False)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if getattr(args, "tier", "host") == "disk":
        return cmd_bench_disk(args)
    if getattr(args, "tier", "host") == "remote":
        from offload_engine.cli._bench_remote import cmd_bench_remote

        return cmd_bench_remote(args)
    return cmd_bench_host(args)


@dataclass
class _GpuFound:
    """What the GPU passes produced (all empty where they did not run)."""

    cases: CaseResults
    step: list[StepRow]
    ttft: list[dict[str, Any]]
    status: dict[str, object]
    stores: list[dict[str, Any]]  # the store pass (--ttft-stores)


def _gpu_cases(
    args: argparse.Namespace,
    cuda: RuntimeInfo,
    plan: BenchPlan,
    plans: tuple[StepPlan, TtftPlan],
    tick: Callable[[str], None],
) -> _GpuFound:
    """The GPU cases, the model-step pass and the time-to-first-token pass, or why they
    did not run."""
    from offload_engine.bench.cuda import run_cuda_cases, run_cuda_step, run_cuda_ttft
    from offload_engine.errors import InsufficientMemoryError, RuntimeUnavailableError

    none = CaseResults(sweep=[], latency=[])
    if not (args.device == "cuda" or (args.device == "auto" and cuda.available)):
        why = "--device cpu" if args.device == "cpu" else f"no CUDA: {cuda.reason}"
        return _GpuFound(none, [], [], {"run": False, "reason": why}, [])
    try:
        gpu = run_cuda_cases(cuda, plan, BENCH_SHAPE, tick=tick)
        step_rows = run_cuda_step(plans[0], tick=tick)
    except RuntimeUnavailableError as exc:
        if args.device == "cuda":
            raise
        return _GpuFound(none, [], [], {"run": False, "reason": str(exc)}, [])
    status: dict[str, object] = {"run": True, "devices": list(cuda.devices)}
    try:
        ttft_rows = run_cuda_ttft(plans[1], tick=tick)
        store_rows = run_cuda_ttft(plans[1], tick=tick, stores=True) if args.ttft_stores else []
    except InsufficientMemoryError as exc:
        # a smaller GPU still gets the other passes; the report says why this one is missing
        ttft_rows, store_rows = [], []
        status["ttft_skipped"] = str(exc)
    return _GpuFound(gpu, step_rows, ttft_rows, status, store_rows)


def _print_host_report(
    report: dict[str, Any],
    results: CaseResults,
    gpu: _GpuFound,
    overhead: list[OverheadResult],
    written: list[Path],
) -> None:
    from rich.console import Console
    from rich.table import Table

    from offload_engine.bench.step import format_step_rows
    from offload_engine.bench.ttft import format_ttft_rows

    out = Console(highlight=False, soft_wrap=True)
    quick = " (quick)" if report["quick"] else ""
    out.print(f"bench on {report['machine']['label']}, {report['date']}{quick}", markup=False)
    if not report["gpu"]["run"]:
        out.print(f"GPU cases not run: {report['gpu']['reason']}", markup=False)
    out.print(_sweep_table(results.sweep))
    out.print(_latency_table(results.latency))
    if gpu.step:
        out.print("Model step slowdown (offload_engine.bench.step), against the same step alone:")
        for line in format_step_rows(gpu.step):
            out.print(line, markup=False)
    if "ttft_skipped" in gpu.status:
        out.print(
            f"note: time-to-first-token pass skipped: {gpu.status['ttft_skipped']}", markup=False
        )
    if gpu.ttft:
        out.print("Time to first token on a prefix hit (offload_engine.bench.ttft):")
        for line in format_ttft_rows(gpu.ttft):
            out.print(f"  {line}", markup=False)
    if gpu.stores:
        from offload_engine.bench.ttft_stores import format_store_rows

        out.print("Stores of a prefill's new blocks (offload_engine.bench.ttft_stores):")
        for line in format_store_rows(gpu.stores):
            out.print(f"  {line}", markup=False)
    table = Table(title="Engine overhead (instant handler)", title_justify="left")
    table.add_column("host")
    for col in ("jobs/s", "p50 us", "p99 us"):
        table.add_column(col, justify="right")
    for r in overhead:
        table.add_row(r.host, f"{r.jobs_per_s:,.0f}", f"{r.p50_us:.0f}", f"{r.p99_us:.0f}")
    out.print(table)
    out.print(f"wrote {', '.join(str(w) for w in written)}", markup=False)


def cmd_bench_host(args: argparse.Namespace) -> int:
    """``bench --tier host``: the host cases, the GPU ones where CUDA is usable, the
    engine's overhead; a JSON report and two figures (three where the step pass ran)."""
    from rich.console import Console

    from offload_engine.bench.machine import Machine
    from offload_engine.bench.overhead import backends, run_overhead
    from offload_engine.bench.rigs import open_host_rig
    from offload_engine.bench.transfers import run_rig_cases
    from offload_engine.errors import RuntimeUnavailableError

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    plan = BenchPlan.quick(args.workers) if args.quick else BenchPlan(workers=args.workers)
    jobs, samples = QUICK_OVERHEAD_JOBS if args.quick else OVERHEAD_JOBS

    found = runtimes.probe_runtimes()
    cuda = next(r for r in found if r.name == "cuda")
    if args.device == "cuda" and not cuda.available:
        raise RuntimeUnavailableError(f"CUDA is not available: {cuda.reason}")
    run_gpu = args.device == "cuda" or (args.device == "auto" and cuda.available)

    out_dir = output_dir(args)
    machine = Machine.detect(gpus=cuda.devices)
    label = args.machine_label or machine.label()
    day = date.today().isoformat()

    total = plan.steps + len(backends()) + 1
    step_plan, ttft_plan = _gpu_plans(args.quick)
    if run_gpu:
        total += plan.steps * len(cuda.strategies) + step_plan.ticks + ttft_plan.ticks
        if args.ttft_stores:
            from offload_engine.bench.ttft_stores import store_ticks

            total += store_ticks(ttft_plan)
    with progress_bar(err) as progress:
        task = progress.add_task("bench", total=total)

        def tick(what: str) -> None:
            progress.update(task, advance=1, description=what)

        gpu = _gpu_cases(args, cuda, plan, (step_plan, ttft_plan), tick)
        results = gpu.cases
        rig = open_host_rig(BENCH_SHAPE, workers=plan.workers)
        try:
            host = run_rig_cases(rig, plan, variant=f"{plan.workers} copy threads", tick=tick)
        finally:
            rig.close()
        results.sweep += host.sweep
        results.latency += host.latency
        overhead = run_overhead(jobs, samples, tick=tick)

    note = "offload-engine bench --quick (CI-sized)" if args.quick else "offload-engine bench"
    figures = _draw_figures(results, gpu.step, (label, day, note), out_dir)
    report = {
        **report_header(SCHEMA, args, day, machine.as_dict(), label),
        "runtimes": [asdict(r) for r in found],
        "plan": asdict(plan),
        "gpu": gpu.status,
        "transfers": {
            "sweep": [p.as_dict() for p in results.sweep],
            "latency": [s.as_dict() for s in results.latency],
        },
        "step": [r.as_dict() for r in gpu.step],
        "ttft": gpu.ttft,
        **({"ttft_stores": gpu.stores} if args.ttft_stores else {}),
        "overhead": {
            "jobs": jobs,
            "latency_samples": samples,
            "hosts": {r.key: r.as_dict() for r in overhead},
        },
        "figures": figures,
    }
    (out_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    written = [out_dir / f for f in (REPORT, *figures.values())]
    _print_host_report(report, results, gpu, overhead, written)
    _check_ttft([*gpu.ttft, *gpu.stores])
    return 0


def _draw_figures(
    results: CaseResults, step: list[StepRow], footer: tuple[str, str, str], out_dir: Path
) -> dict[str, str]:
    """The throughput and latency figures, and the step figure where the model-step
    pass ran, into ``out_dir``; ``footer``: machine label, date, note. Their names."""
    from offload_engine.bench.plots import latency_figure, step_figure, throughput_figure

    label, day, note = footer
    throughput_figure(results.sweep, label, day, out_dir / THROUGHPUT_PNG, note)
    latency_figure(results.latency, label, day, out_dir / LATENCY_PNG, note)
    figures = {"throughput": THROUGHPUT_PNG, "latency": LATENCY_PNG}
    if step:
        step_figure([r.as_dict() for r in step], label, day, out_dir / STEP_PNG, note)
        figures["step"] = STEP_PNG
    return figures


def _gpu_plans(quick: bool) -> tuple[StepPlan, TtftPlan]:
    """The model-step and time-to-first-token plans (CI-sized with ``--quick``)."""
    from offload_engine.bench.step import StepPlan
    from offload_engine.bench.ttft import TtftPlan

    if quick:
        return StepPlan.quick(), TtftPlan.quick()
    return StepPlan(), TtftPlan()


def _check_ttft(rows: list[dict[str, Any]]) -> None:
    """Fail the command (exit 1, after the report is written) on a layer-wise load or
    store that was not bit-exact."""
    from offload_engine.errors import JobFailedError

    errors = [e for r in rows for e in r["errors"]]
    if errors:
        raise JobFailedError(
            "the time-to-first-token pass found layer-wise transfers that are not bit-exact: "
            + "; ".join(errors)
        )
