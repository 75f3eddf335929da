"""examples/layerwise_forward.py: a forward pass that loads its prefix layer by layer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layerwise_forward_pass_matches_the_original() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "layerwise_forward.py"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical to the pass over the original KV" in proc.stdout
