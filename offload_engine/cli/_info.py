"""``offload-engine info``: the runtimes this machine offers, and why not where it does not."""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import asdict

from offload_engine.device.runtimes import probe as runtimes

#: Why ``--device npu`` is not a choice of demo and bench (docs/cli.md says the same).
NPU_NOT_OFFERED = (
    "no --device npu yet: their NPU path has not run on Ascend hardware (the NPU handler is "
    "tested through fakes only, docs/npu.md); the vLLM adapter does use the NPU"
)


def cmd_info(args: argparse.Namespace) -> int:
    from offload_engine import __version__

    found = runtimes.probe_runtimes()
    if args.json:
        print(json.dumps([asdict(r) for r in found], indent=2))
        return 0

    import torch
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    out = Console(highlight=False, soft_wrap=True)
    out.print(
        f"offload-engine {__version__}, Python {platform.python_version()}, "
        f"torch {torch.__version__}",
        markup=False,
    )
    table = Table(show_lines=True)
    for col in ("runtime", "status", "devices", "strategies", "details"):
        table.add_column(col)
    for r in found:
        details = "\n".join((r.reason, *r.notes))
        table.add_row(
            Text(r.name),
            Text("available" if r.available else "unavailable"),
            Text("\n".join(r.devices) or "-"),
            Text(", ".join(r.strategies) or "-"),
            Text(details),
        )
    out.print(table)
    cuda = next(r for r in found if r.name == "cuda")
    if cuda.available:
        auto = f"the GPU, {cuda.devices[0] if cuda.devices else 'cuda'}"
    else:
        auto = f"host memory (CUDA: {cuda.reason})"
    out.print(f"demo and bench with --device auto run on: {auto}", markup=False)
    out.print(f"device strategy auto (the default), per job: {_auto_policy()}", markup=False)
    npu = next(r for r in found if r.name == "npu")
    if npu.available:
        out.print(f"demo and bench: {NPU_NOT_OFFERED}", markup=False)
    return 0


def _auto_policy() -> str:
    """The ``auto`` copy strategy's rule with the default thresholds."""
    from offload_engine.device import DeviceHandlerConfig
    from offload_engine.device.policy import AutoPolicy

    return AutoPolicy.of(DeviceHandlerConfig()).describe()
