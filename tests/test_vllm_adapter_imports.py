"""offload_engine and its vLLM adapter import, and the adapter config works, without vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["vllm"] = None  # as if vLLM were not installed: `import vllm` fails

    import offload_engine
    import offload_engine.connectors
    import offload_engine.connectors.vllm
    from offload_engine.connectors.vllm import parse_extra_config, select_backend
    from offload_engine.connectors.vllm import bridge, config, layout, platform, testing

    cfg = parse_extra_config({"cpu_bytes_to_use": 1024})
    backend = select_backend(type("P", (), {"device_type": "cpu"})())
    assert backend.cache_medium is offload_engine.Medium.CPU
    assert sys.modules["vllm"] is None, "something imported vLLM"
    assert not [m for m in sys.modules if m.startswith("vllm.")], "vLLM submodules imported"

    try:
        offload_engine.connectors.vllm.EngineOffloadingSpec
    except ImportError as exc:
        assert "needs vLLM" in str(exc), exc
    else:
        raise AssertionError("EngineOffloadingSpec imported without vLLM")
    print("ok")
    """
)


def test_engine_and_connectors_import_without_vllm() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "ok"
