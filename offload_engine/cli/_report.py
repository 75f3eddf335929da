"""What every ``offload-engine bench`` report starts with."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any


def output_dir(args: argparse.Namespace) -> Path:
    """Create ``-o``'s directory (and the folders above it) and return it. Where that
    fails, the :class:`OSError` names ``-o``: the command reports it in one line."""
    path = Path(args.output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"-o {args.output_dir}: cannot create it: {exc.strerror or exc}") from exc
    return path


def report_header(
    schema: str, args: argparse.Namespace, day: str, machine: dict[str, Any], label: str
) -> dict[str, Any]:
    """What every bench report starts with: schema, command, date, version, machine."""
    from offload_engine import __version__

    return {
        "schema": schema,
        "command": shlex.join(["offload-engine", *args.argv]),
        "date": day,
        "offload_engine": __version__,
        "quick": args.quick,
        "machine": {**machine, "label": label},
    }
