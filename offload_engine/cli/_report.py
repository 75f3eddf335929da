"""What every ``offload-engine bench`` report starts with."""

from __future__ import annotations

import argparse
import shlex
from typing import Any


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
