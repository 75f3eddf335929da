"""The chaos run through the vLLM bridge (``benchmarks/chaos_bridge.py``), CI-sized.

Several threads share one
:class:`~offload_engine.connectors.vllm.bridge.EngineBridge` and call it the way vLLM's
worker does (``submit_store``/``submit_load``, ``get_finished`` every step,
``wait`` on preemption), over handlers that inject the chaos fault mix. Nothing may be
lost, handed out twice, or left in the bridge. ``--run-slow`` runs a longer variant.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

from offload_engine import Medium, SyncOffloadingEngine
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.testing import FakeHandler

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos_bridge.py"


def load_script() -> ModuleType:
    if str(SCRIPT.parent) not in sys.path:  # the script imports its sibling chaos.py
        sys.path.insert(0, str(SCRIPT.parent))
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


def _fake_bridge(manual: bool) -> tuple[EngineBridge, FakeHandler]:
    store = FakeHandler(Medium.GPU, Medium.CPU, manual=manual)
    engine = SyncOffloadingEngine([store, FakeHandler(Medium.CPU, Medium.GPU)])
    return EngineBridge(engine, Medium.GPU), store


def test_wait_with_a_repeated_id_is_not_an_error() -> None:
    """Found by the chaos run through the bridge: ``wait([j, j])`` passed the repeated id
    on to the engine, which refused it (``ValueError: job ids repeat``)."""
    bridge, _ = _fake_bridge(manual=False)
    try:
        assert bridge.submit_store(7, [1], [1], [0], [1])
        bridge.wait([7, 7, 7])
        assert [r.job_id for r in bridge.get_finished()] == [7]
    finally:
        bridge.shutdown()


def test_two_threads_waiting_on_the_same_jobs_both_return_after_them() -> None:
    bridge, store = _fake_bridge(manual=True)
    try:
        ids = [10, 11]
        for j in ids:
            assert bridge.submit_store(j, [j], [1], [0], [j])
        store.wait_launched_blocking(2)
        waiters = [threading.Thread(target=bridge.wait, args=(ids,)) for _ in range(2)]
        for t in waiters:
            t.start()
        store.complete_all()
        for t in waiters:
            t.join(10)
            assert not t.is_alive()
        assert sorted(r.job_id for r in bridge.get_finished()) == ids
        assert bridge.live_jobs == 0 and bridge.stashed_results == 0
    finally:
        bridge.shutdown()
