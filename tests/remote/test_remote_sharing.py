"""Two engines in two processes share one store: A stores, B loads, bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from offload_engine import KeyMissError, RemoteTier, SyncOffloadingEngine
from tests.remote.conftest import Backend, digest, keys, random_tier, start_backend
from tests.remote.test_remote_tier import load_spec

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


def test_mooncake_holder_killed_gives_misses_not_a_hang() -> None:
    """The process whose memory segment holds the objects dies (SIGKILL): loads from
    another client are misses within bounded time, never wrong bytes, and the tier
    keeps serving."""
    b = start_backend("mooncake")
    try:
        common = ["mooncake", b.server.address, "--seed", "12", "--blocks", "8"]  # type: ignore[union-attr]
        holder = peer("store", *common)
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "STORED"
            tier = random_tier(8, seed=99)
            before = tier.memory.clone()
            # this client contributes no memory: every object lives in the holder's segment
            connect = b.connect(segment_bytes=0)
            with (
                RemoteTier(connect, tier, digest()) as remote,
                SyncOffloadingEngine(remote.handlers(), default_timeout=60) as engine,
            ):
                assert remote.contains(keys(8)) == 8
                holder.kill()
                holder.wait(timeout=30)
                t0 = time.monotonic()
                [r] = engine.wait([engine.submit_nowait(load_spec(keys(8), list(range(8))))])
                assert time.monotonic() - t0 < 60
                assert not r.success
                miss = r.error if isinstance(r.error, KeyMissError) else r.error.__cause__  # type: ignore[union-attr]
                assert isinstance(miss, KeyMissError) and len(miss.missing) == 8, r.error
                assert remote.stats().loaded == 0
                # no block was passed as good: every missed block is zeroed
                assert remote.stats().missed == 8 and not tier.memory.any()
                assert not torch.equal(tier.memory, before)
                assert remote.contains(keys(8)) == 0  # the missed objects were dropped
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(timeout=30)
            for f in (holder.stdin, holder.stdout):
                if f is not None:
                    f.close()
    finally:
        b.server.stop()
