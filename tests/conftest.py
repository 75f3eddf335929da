"""Shared fixtures: every async test runs on asyncio and on trio, and no test may
leave an engine thread behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from offload_engine.testing import engine_threads


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


@pytest.fixture(params=["asyncio", "trio"])
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow") or os.environ.get("OFFLOAD_ENGINE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow variant: pass --run-slow or set OFFLOAD_ENGINE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
