"""The chaos run through the vLLM bridge (``benchmarks/chaos_bridge.py``), CI-sized.

Several threads share one :class:`~connectors.vllm.bridge.EngineBridge` and call it the
way vLLM's worker does (``submit_store``/``submit_load``, ``get_finished`` every step,
``wait`` on preemption), over handlers that inject the chaos fault mix. Nothing may be
lost, handed out twice, or left in the bridge. ``--run-slow`` runs a longer variant.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos_bridge.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos_bridge", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chaos_bridge", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_chaos_through_the_bridge_from_several_threads(backend: str) -> None:
    figures = load_script().run(jobs=1500, threads=4, seed=1, backend=backend)
    assert figures["ok"], figures["problems"]
    assert figures["jobs_accepted"] > 500
    assert figures["results_delivered"] == figures["jobs_accepted"]
    assert figures["failures_injected_total"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_chaos_through_the_bridge_long(backend: str) -> None:
    figures = load_script().run(jobs=30_000, threads=6, seed=2, backend=backend)
    assert figures["ok"], figures["problems"]
