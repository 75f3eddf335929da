"""Two engines in two processes share one store: A stores, B loads, bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.remote.conftest import Backend

ROOT = Path(__file__).resolve().parents[2]


def peer(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.remote.peer", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the Mooncake client logs a lot; the verdict is on stdout
        text=True,
    )


def test_process_a_stores_process_b_loads_bit_exact(backend: Backend) -> None:
    address = (
        backend.server.url if backend.name == "redis" else backend.server.address  # type: ignore[union-attr]
    )
    common = [backend.name, address, "--seed", "11", "--blocks", "40"]
    a = peer("store", *common)
    try:
        assert a.stdout is not None
        line = a.stdout.readline().strip()  # blocks until A has stored (or failed)
        assert line == "STORED", line
        b = peer("load", *common)
        out, _ = b.communicate(timeout=120)
        assert b.returncode == 0, out
        assert out.startswith("LOADED 40 EXACT (contains 40)"), out
    finally:
        if a.stdin is not None:
            a.stdin.close()  # A releases its client and exits
        assert a.wait(timeout=60) == 0
        if a.stdout is not None:
            a.stdout.close()
