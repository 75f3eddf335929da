"""``offload-engine bench --tier remote --backend redis|mooncake``: the remote tier
against its backend's raw client (and redis-benchmark), on a server it starts on
127.0.0.1. Writes ``remote-report.json`` into the output directory."""

from __future__ import annotations

import argparse
import json
from datetime import date

from offload_engine.cli._console import print_table, progress_bar
from offload_engine.errors import ConfigError
from offload_engine.remote.mooncake_store import mooncake_import_problem

REMOTE_REPORT = "remote-report.json"
SCHEMA = "offload-engine-bench-remote/1"


def check_clients(backends: list[str]) -> None:
    """Raise :class:`ConfigError` saying what to install for a backend whose client
    library does not import (the pip command, or the system library it lacks), before
    any server starts."""
    for backend in backends:
        if backend == "redis":
            try:
                import redis  # noqa: F401
            except ImportError as exc:
                raise ConfigError(
                    "the redis client is not installed: from the offload-engine checkout, "
                    "pip install -e '.[remote]'"
                ) from exc
        else:
            try:
                import mooncake.store  # noqa: F401
            except ImportError as exc:
                raise ConfigError(mooncake_import_problem(exc)) from exc


def cmd_bench_remote(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from offload_engine.bench.machine import Machine
    from offload_engine.bench.remote import RemotePlan, run_remote_bench
    from offload_engine.cli._report import output_dir, report_header

    out = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    plan = RemotePlan.quick() if args.quick else RemotePlan()
    backends = ["redis", "mooncake"] if args.backend == "both" else [args.backend]
    check_clients(backends)
    out_dir = output_dir(args)
    steps = len(plan.chunk_mib) * len(plan.concurrency) * len(backends)
    points = []
    with progress_bar(err) as progress:
        task = progress.add_task("bench remote", total=steps)

        def tick(what: str) -> None:
            progress.update(task, advance=1, description=what)

        for backend in backends:
            points += run_remote_bench(backend, plan, tick=tick)

    machine = Machine.detect()
    label = args.machine_label or machine.label()
    day = date.today().isoformat()
    table = Table(
        title=f"Remote tier on loopback: engine vs raw client, GB/s ({label}, {day})",
        title_justify="left",
    )
    for col in (
        "backend",
        "chunk MiB",
        "jobs",
        "engine put",
        "raw put",
        "ratio",
        "engine get",
        "raw get",
        "ratio",
        "submit us/chunk",
        "CPU ms/MiB put e/r",
        "get e/r",
        "r-bench set",
        "r-bench get",
    ):
        # on a terminal narrower than the table, values wrap instead of ending in "..."
        table.add_column(col, justify="left" if col == "backend" else "right", overflow="fold")
    for p in points:
        table.add_row(
            p.backend,
            f"{p.chunk_bytes / 2**20:g}",
            str(p.concurrency),
            f"{p.engine_put_gbps:.2f}",
            f"{p.raw_put_gbps:.2f}",
            f"{p.put_ratio:.2f}",
            f"{p.engine_get_gbps:.2f}",
            f"{p.raw_get_gbps:.2f}",
            f"{p.get_ratio:.2f}",
            f"{p.submit_us_per_chunk:.1f}",
            f"{p.cpu_ms_per_mib[0]:.2f}/{p.cpu_ms_per_mib[1]:.2f}",
            f"{p.cpu_ms_per_mib[2]:.2f}/{p.cpu_ms_per_mib[3]:.2f}",
            "-" if p.redis_benchmark_set_gbps is None else f"{p.redis_benchmark_set_gbps:.2f}",
            "-" if p.redis_benchmark_get_gbps is None else f"{p.redis_benchmark_get_gbps:.2f}",
        )
    print_table(out, table)
    report = {
        **report_header(SCHEMA, args, day, machine.as_dict(), label),
        "plan": {
            "volume_mib": plan.volume_mib,
            "chunk_mib": list(plan.chunk_mib),
            "concurrency": list(plan.concurrency),
            "chunks_per_job": plan.chunks_per_job,
            "reps": plan.reps,
        },
        "points": [p.as_dict() for p in points],
        "loopback_cannot_show": ["RDMA", "network latency", "several hosts"],
    }
    (out_dir / REMOTE_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    out.print(f"wrote {out_dir / REMOTE_REPORT}", markup=False)
    return 0
