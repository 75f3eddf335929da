"""The driverless profiling scripts in benchmarks/device run end to end on a CPU machine.

They build the device handlers over a driver whose entry points do nothing, so
they break whenever the native program asks the driver for a new entry point;
this runs each with a few jobs and checks the figures it prints.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device" / script), *args],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_launcher_profile_prints_prepare_and_enqueue_per_direction_and_slot_kind() -> None:
    out = _run("profile_launcher_local.py", "--jobs", "8", "--sizes", "8")
    rows = re.findall(
        r"staged (store|load)\s+8 (random|allocator)\s*: "
        r"prepare\s+([\d.]+) us, enqueue\s+([\d.]+) us",
        out,
    )
    assert {(d, k) for d, k, _, _ in rows} == {
        (d, k) for d in ("store", "load") for k in ("random", "allocator")
    }
    assert all(float(p) > 0 and float(e) > 0 for _, _, p, e in rows)


def test_the_submit_profile_prints_submit_and_prepare_hot_and_cold() -> None:
    out = _run("profile_submit_local.py", "--jobs", "8", "--sizes", "8")
    assert re.search(r"8 blocks: submit alone: after the result\s+[\d.]+ us", out), out
    for how in ("hot", "sleep", "python"):
        assert re.search(rf"prepare {how}\s*:\s+[\d.]+ us \[map_transfer [\d.]+", out), out
