"""Shared fixtures: every async test runs on asyncio and on trio, and no test may
leave an engine thread behind. ``--require-deps`` (``tests/required_deps.py``) fails a
run in which a test skipped for a dependency the README's test command installs. A
checkout that is not installed (the GPU machine runs the tests from one) still imports
``offload_engine.connectors``."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import offload_engine
from offload_engine.testing import engine_threads
from tests import required_deps


def _connectors_from_this_checkout() -> None:
    """setup.py installs ``connectors/`` as ``offload_engine.connectors``; where the
    package runs from the source tree uninstalled, load that name from the folder."""
    if importlib.util.find_spec("offload_engine.connectors") is not None:
        return
    init = Path(__file__).resolve().parents[1] / "connectors" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "offload_engine.connectors", init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load offload_engine.connectors from {init}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    offload_engine.connectors = module  # type: ignore[attr-defined]


_connectors_from_this_checkout()


@pytest.fixture
def ascend(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A fake Ascend machine: ``import torch_npu`` finds the fake torch.npu, libascendcl is
    the fake library, and the runtime class the platform names builds on them."""
    import sys

    from offload_engine.device.runtimes import npu as npu_module
    from offload_engine.testing import FakeAscend, FakeNpuRuntime, fake_torch_npu_module

    device = FakeAscend()
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu_module(device))
    monkeypatch.setattr(npu_module, "load_ascendcl", lambda: device.acl)
    monkeypatch.setattr(npu_module, "NpuRuntime", lambda: FakeNpuRuntime(device, via_import=True))
    yield device
    device.close()


_HAS_TRIO = importlib.util.find_spec("trio") is not None


# a machine without trio (the GPU image) runs the asyncio half of the async tests
@pytest.fixture(
    params=[
        "asyncio",
        pytest.param("trio", marks=pytest.mark.skipif(not _HAS_TRIO, reason="trio not installed")),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def _no_engine_thread_left() -> Iterator[None]:
    before = set(engine_threads())
    yield
    left = [t for t in engine_threads() if t not in before and t.is_alive()]
    assert not left, f"engine threads outlived the test: {[t.name for t in left]}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="run the long chaos/soak variants"
    )
    required_deps.add_option(parser)  # --require-deps


def pytest_configure(config: pytest.Config) -> None:
    required_deps.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow") or os.environ.get("OFFLOAD_ENGINE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow variant: pass --run-slow or set OFFLOAD_ENGINE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
