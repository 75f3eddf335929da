"""examples/tensor_server.py: the engine inside a server's own event loop.

The server runs on the test's loop (asyncio and trio), clients drive it over
loopback, every restored payload must equal what was stored, and stopping the
server leaves no engine thread behind (the conftest checks that too).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import anyio
import numpy as np
import pytest
import torch

from offload_engine.testing import engine_threads

pytestmark = pytest.mark.anyio

BLOCK = 4096


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_server.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tensor_server_example", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ts = _load_example()


def small_store() -> object:
    return ts.TensorStore(block_bytes=BLOCK, staging_blocks=16, tier_blocks=64, workers=2)


async def test_put_get_round_trips_over_loopback() -> None:
    rng = np.random.default_rng(7)
    sizes = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17]
    async with small_store() as store, anyio.create_task_group() as tg:
        port = await tg.start(ts.serve_tcp, store, "127.0.0.1", 0)

        async def client(name: str) -> None:
            c = await ts.Client.connect("127.0.0.1", port)
            try:
                payloads = {f"{name}-{n}": rng.bytes(n) for n in sizes}
                for key, data in payloads.items():
                    assert await c.put(key, data) == -(-len(data) // BLOCK)
                for key, data in payloads.items():
                    assert await c.get(key) == data
                tensor = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
                await c.put(f"{name}-tensor", tensor.numpy().tobytes())
                back = np.frombuffer(await c.get(f"{name}-tensor"), dtype=np.float32)
                assert torch.equal(torch.from_numpy(back.copy()).view(32, 48), tensor)
                for key in [*payloads, f"{name}-tensor"]:
                    await c.delete(key)
            finally:
                await c.aclose()

        async with anyio.create_task_group() as clients:
            for name in ("a", "b", "c"):
                clients.start_soon(client, name)
        assert store.tier_free == 64  # every block came back
        tg.cancel_scope.cancel()
    assert engine_threads() == []


async def test_requests_wait_for_staging_blocks() -> None:
    """Four requests of 3 blocks each share 4 staging blocks: all but one wait their turn."""
    store = ts.TensorStore(block_bytes=BLOCK, staging_blocks=4, tier_blocks=64)
    got: dict[str, bytes] = {}
    async with store:

        async def request(i: int) -> None:
            data = bytes([i]) * (3 * BLOCK)
            for j in range(5):
                await store.put(f"{i}-{j}", data)
                got[f"{i}-{j}"] = await store.get(f"{i}-{j}")
                store.delete(f"{i}-{j}")

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(request, i)
    assert got == {f"{i}-{j}": bytes([i]) * (3 * BLOCK) for i in range(4) for j in range(5)}
    assert store.tier_free == 64 and store.stats().succeeded == 40


async def test_errors_overwrite_and_delete() -> None:
    async with small_store() as store, anyio.create_task_group() as tg:
        port = await tg.start(ts.serve_tcp, store, "127.0.0.1", 0)
        c = await ts.Client.connect("127.0.0.1", port)
        try:
            with pytest.raises(ts.RequestError, match="no such key: k"):
                await c.get("k")
            await c.put("k", b"first" * 1000)
            await c.put("k", b"second")  # replaces, frees the old blocks
            assert await c.get("k") == b"second"
            assert store.tier_free == 63
            with pytest.raises(ts.RequestError, match="payload of 65537 bytes exceeds 65536"):
                await c.put("huge", bytes(16 * BLOCK + 1))
            for key in ("f1", "f2", "f3"):
                await c.put(key, bytes(16 * BLOCK))
            with pytest.raises(ts.RequestError, match="tier full: 16 blocks needed, 15 free"):
                await c.put("f4", bytes(16 * BLOCK))
            assert await c.get("k") == b"second"  # the connection is still in step
            for key in ("k", "f1", "f2", "f3"):
                await c.delete(key)
            with pytest.raises(ts.RequestError, match="no such key: k"):
                await c.delete("k")
            assert store.tier_free == 64
        finally:
            await c.aclose()
        tg.cancel_scope.cancel()


async def test_stopping_with_requests_in_flight_is_clean() -> None:
    store = small_store()
    async with store, anyio.create_task_group() as tg:
        port = await tg.start(ts.serve_tcp, store, "127.0.0.1", 0)
        answered = 0
        enough = anyio.Event()

        async def hammer(i: int) -> None:
            nonlocal answered
            c = await ts.Client.connect("127.0.0.1", port)
            try:
                for j in range(1000):
                    data = bytes([i, j % 256]) * (3 * BLOCK // 2)
                    await c.put(f"{i}", data)
                    assert await c.get(f"{i}") == data
                    answered += 1
                    if answered >= 40:
                        enough.set()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                pass  # the server went away mid-request
            finally:
                await c.aclose()

        for i in range(4):
            tg.start_soon(hammer, i)
        await enough.wait()
        tg.cancel_scope.cancel()  # server and clients stop with jobs queued or in flight
    stats = store.stats()
    assert stats.state == "closed"
    assert stats.failed == 0 and stats.submitted == stats.succeeded
    assert engine_threads() == []


def test_a_port_out_of_range_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert ts.run(["--port", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"{Path(sys.argv[0]).name}: error: --port -1: a TCP port is 0 to 65535"
    ]


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"tensor_server.py: error: cannot serve on 127.0.0.1:{port}: "
        f"[Errno {errno.EADDRINUSE}] {os.strerror(errno.EADDRINUSE)}"
    ]


def test_backend_trio_without_trio_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "trio", None)  # import trio raises ImportError
    assert ts.run(["--port", "0", "--backend", "trio"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"{Path(sys.argv[0]).name}: error: --backend trio: trio is not installed: from the "
        "offload-engine checkout, pip install -e '.[trio]'"
    ]
