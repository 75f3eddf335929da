"""Platform -> handler selection, with fake vLLM platform objects."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from connectors.vllm.config import parse_extra_config
from connectors.vllm.layout import layout_from_canonical
from connectors.vllm.platform import (
    CUDA_HANDLER_MODULE,
    DEVICE_ENTRY_POINT,
    NPU_HANDLER_MODULE,
    select_backend,
)
from connectors.vllm.testing import fake_canonical_kv_caches
from offload_engine import HostCopyHandler, Medium, RuntimeUnavailableError


@dataclass
class FakePlatform:
    device_type: str
    rocm: bool = False

    def is_rocm(self) -> bool:
        return self.rocm


def test_cpu_platform_gets_the_host_handler() -> None:
    backend = select_backend(FakePlatform("cpu"))
    assert backend.name == "cpu"
    assert backend.cache_medium is Medium.CPU
    layout = layout_from_canonical(fake_canonical_kv_caches(num_blocks=4))
    config = parse_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "host_workers": 2}, blocks_per_chunk=2
    )
    handlers, tier = backend.build(layout, 3, config)
    try:
        [handler] = handlers
        assert isinstance(handler, HostCopyHandler)
        assert handler.pair == (Medium.CPU, Medium.CPU)
        assert handler.workers == 2
        assert (tier.num_blocks, tier.factor, tier.slot_bytes) == (3, 2, layout.slot_bytes)
    finally:
        tier.release()


@pytest.mark.parametrize(
    ("device_type", "name", "module"),
    [("cuda", "CUDA", CUDA_HANDLER_MODULE), ("npu", "NPU", NPU_HANDLER_MODULE)],
)
def test_device_platform_without_its_handler_is_refused_clearly(
    device_type: str, name: str, module: str
) -> None:
    assert module not in sys.modules
    with pytest.raises(RuntimeUnavailableError, match=rf"vLLM runs on {name}.*{module} is missing"):
        select_backend(FakePlatform(device_type))


@pytest.mark.parametrize(
    ("device_type", "medium", "module"),
    [("cuda", Medium.GPU, CUDA_HANDLER_MODULE), ("npu", Medium.NPU, NPU_HANDLER_MODULE)],
)
def test_device_platform_uses_its_handler_module_once_it_exists(
    monkeypatch: pytest.MonkeyPatch, device_type: str, medium: Medium, module: str
) -> None:
    fake = types.ModuleType(module)

    def build(*args: Any) -> Any:
        raise AssertionError("not called by selection")

    setattr(fake, DEVICE_ENTRY_POINT, build)
    monkeypatch.setitem(sys.modules, module, fake)
    backend = select_backend(FakePlatform(device_type))
    assert backend.cache_medium is medium
    assert backend.build is build


def test_device_module_without_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, CUDA_HANDLER_MODULE, types.ModuleType(CUDA_HANDLER_MODULE))
    with pytest.raises(RuntimeUnavailableError, match=rf"has no {DEVICE_ENTRY_POINT}"):
        select_backend(FakePlatform("cuda"))


def test_device_module_whose_dependency_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_import(name: str, *args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError("No module named 'cuda'", name="cuda")

    monkeypatch.setattr("importlib.import_module", failing_import)
    with pytest.raises(
        RuntimeUnavailableError, match=r"cannot be imported: No module named 'cuda'"
    ):
        select_backend(FakePlatform("cuda"))


def test_rocm_and_unknown_platforms_are_refused() -> None:
    with pytest.raises(RuntimeUnavailableError, match="ROCm"):
        select_backend(FakePlatform("cuda", rocm=True))
    with pytest.raises(RuntimeUnavailableError, match=r"device_type='xpu'.*cpu, cuda, npu"):
        select_backend(FakePlatform("xpu"))
    with pytest.raises(RuntimeUnavailableError, match="device_type=None"):
        select_backend(object())
