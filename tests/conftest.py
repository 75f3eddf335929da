"""Shared fixtures: every async test runs on asyncio and on trio, and no test may
leave an engine thread behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from offload_engine.testing import engine_threads


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
