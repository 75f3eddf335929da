"""examples/disk_tier.py: store, restart in a fresh process, load bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "disk_tier.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_store_then_load_in_a_fresh_process(tmp_path: Path) -> None:
    out = _run(str(tmp_path), "--phase", "store")
    assert "stored 8 blocks" in out
    out = _run(str(tmp_path), "--phase", "load")
    assert "restarted: 8 objects on disk; 8 of 10 keys stored" in out
    assert "loaded 8 blocks, bit-exact" in out
