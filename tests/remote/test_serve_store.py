"""``offload-engine serve-store --backend mooncake``: a segment holder's whole life against
a real ``mooncake_master`` on 127.0.0.1 started by the test.

It mounts its segment, says where it serves, keeps what short-lived clients (mounting
no segment) stored after they exit, and on SIGINT or SIGTERM unmounts the segment
and exits 0.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from offload_engine import ConfigError, MooncakeStore, MooncakeStoreConfig
from offload_engine.testing.servers import MooncakeMaster
from tests.remote.conftest import skip_unless_installed

ROOT = Path(__file__).resolve().parents[2]
SEGMENT = 64 << 20


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    skip_unless_installed("mooncake")
    try:
        server = MooncakeMaster()
    except ConfigError as exc:
        pytest.skip(str(exc))
    with server:
        yield server


def master_metrics(master: MooncakeMaster) -> dict[str, float]:
    url = f"http://127.0.0.1:{master.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def holder_command(master: str, segment_gib: float) -> list[str]:
    """``offload-engine serve-store`` as an operator runs it (``python -m offload_engine``)."""
    return [sys.executable, "-m", "offload_engine", "serve-store", "--backend", "mooncake",
            "--master", master, "--segment-gib", str(segment_gib)]  # fmt: skip


def holder_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def start_holder(master: MooncakeMaster) -> subprocess.Popen[str]:
    return subprocess.Popen(
        holder_command(master.address, SEGMENT / (1 << 30)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=holder_env(),
    )


def first_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            pytest.fail(f"serve-store said nothing in {timeout}s: {proc.communicate()[1][-2000:]}")
    return proc.stdout.readline()


def client(master: MooncakeMaster) -> MooncakeStore:
    """A client that mounts no segment, as a vLLM instance beside a holder does."""
    return MooncakeStore(
        MooncakeStoreConfig(master.address, segment_bytes=0, local_buffer_bytes=16 << 20)
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_holder_keeps_objects_across_clients_and_stops_cleanly(
    master: MooncakeMaster, sig: signal.Signals
) -> None:
    holder = start_holder(master)
    try:
        line = first_line(holder)
        assert "64 MiB Mooncake segment at 127.0.0.1" in line, line
        assert master.address in line
        assert holder.poll() is None
        assert master_metrics(master)["master_total_capacity_bytes"] == SEGMENT
        value = os.urandom(100_000)
        with client(master) as writer:
            assert writer.client.put("serve-store-test", value) == 0
        # the writer is gone; the object lives in the holder's segment
        with client(master) as reader:
            assert reader.client.get("serve-store-test") == value
            holder.send_signal(sig)
            out, err = holder.communicate(timeout=60)
            assert holder.returncode == 0, err[-3000:]
            assert f"stopped on {sig.name}; segment unmounted" in out
            # the segment left the pool with the holder, and its objects with it
            after = master_metrics(master)
            assert after["master_total_capacity_bytes"] == 0
            assert after["master_unmount_segment_requests_total"] >= 1
            assert reader.exists(["serve-store-test"]) == [False]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()


def test_no_master_is_a_one_line_error(master: MooncakeMaster) -> None:
    port = master.port
    master.stop()
    t0 = time.monotonic()
    holder = subprocess.run(
        holder_command(f"127.0.0.1:{port}", 0.0625),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=holder_env(),
        timeout=60,
        check=False,
    )
    assert holder.returncode == 1
    assert time.monotonic() - t0 < 30  # the master's port is checked, not retried for 90 s
    assert (
        holder.stderr.strip()
        .splitlines()[-1]
        .startswith("offload-engine serve-store: error: no Mooncake master listens on 127.0.0.1:")
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--master", "127.0.0.1:1", "--segment-gib", "0"], "not a positive whole number of MiB"),
        (["--master", "127.0.0.1:1", "--segment-gib", "x"], "is not a size in GiB"),
        (["--segment-gib", "1"], "the following arguments are required: --master"),
    ],
)
def test_bad_usage_exits_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from offload_engine.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve-store", "--backend", "mooncake", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
