"""examples/disk_tier.py: store, restart in a fresh process, load bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
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
    assert done.returncode == code, done.stderr
    return done


def test_store_then_load_in_a_fresh_process(tmp_path: Path) -> None:
    out = _run(str(tmp_path), "--phase", "store").stdout
    assert "stored 8 blocks" in out
    out = _run(str(tmp_path), "--phase", "load").stdout
    assert "restarted: 8 objects on disk; 8 of 10 keys stored" in out
    assert "loaded 8 blocks, bit-exact" in out


def test_loading_from_an_empty_directory_is_refused(tmp_path: Path) -> None:
    done = _run(str(tmp_path), "--phase", "load", code=1)
    assert "loaded" not in done.stdout
    [line] = done.stderr.splitlines()
    assert line.startswith("nothing to load: no block is stored in")


def test_a_missing_directory_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    done = _run(str(tmp_path / "nope"), code=1)
    [line] = done.stderr.splitlines()
    assert line.startswith("disk_tier.py: error: disk tier directory") and "does not exist" in line
