"""Which handler serves vLLM's KV cache, by vLLM platform.

:func:`select_backend` is the one place that decides:

* vLLM's **CPU** platform (``device_type == "cpu"``): the KV cache lives in
  host memory, so :class:`~offload_engine.HostCopyHandler` copies CPU <-> CPU;
* **CUDA** (``"cuda"``, not ROCm): the CUDA device handler, GPU <-> CPU;
* **Ascend** (``"npu"``): the NPU handler, NPU <-> CPU.

Device handlers are imported lazily, only when their platform is selected;
until a handler ships, selecting it raises
:class:`~offload_engine.errors.RuntimeUnavailableError` saying so. The platform
is passed in (vLLM's ``current_platform`` in production, any object with a
``device_type`` attribute in tests), so this module does not import vLLM.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connectors.vllm.config import DEFAULT_STAGING_BYTES, EngineOffloadingConfig
from offload_engine.errors import RuntimeUnavailableError
from offload_engine.handler import TransferHandler
from offload_engine.handlers.host import HostCopyHandler
from offload_engine.layout import KVLayout
from offload_engine.tier import HostTier
from offload_engine.vocabulary import Medium

#: ``build(layout, num_tier_blocks, config) -> (handlers, tier)``
BuildHandlers = Callable[
    [KVLayout, int, EngineOffloadingConfig], tuple[list[TransferHandler[Any]], HostTier]
]

#: Where the device handlers will live, and the adapter entry point each must offer:
#: ``build_vllm_handlers(layout, num_tier_blocks, config) -> (handlers, tier)``.
CUDA_HANDLER_MODULE = "offload_engine.handlers.cuda"
NPU_HANDLER_MODULE = "offload_engine.handlers.npu"
DEVICE_ENTRY_POINT = "build_vllm_handlers"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    """What the worker needs from a platform: the medium its KV cache lives on,
    and how to build the handlers (and the host tier they fill)."""

    name: str
    cache_medium: Medium
    build: BuildHandlers


def build_host_handlers(
    layout: KVLayout, num_tier_blocks: int, config: EngineOffloadingConfig
) -> tuple[list[TransferHandler[Any]], HostTier]:
    """CPU platform: one HostCopyHandler serves stores and loads (CPU <-> CPU)."""
    if config.strategy != "auto" or config.staging_bytes != DEFAULT_STAGING_BYTES:
        logger.info(
            "offload-engine: 'strategy' and 'staging_bytes' apply to device handlers; "
            "ignored on vLLM's CPU platform"
        )
    tier = HostTier.for_layout(layout, num_tier_blocks, factor=config.blocks_per_chunk)
    try:
        handler = HostCopyHandler(layout, tier, workers=config.host_workers)
    except BaseException:
        tier.release()
        raise
    return [handler], tier


def _device_backend(name: str, medium: Medium, module_name: str) -> Backend:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise RuntimeUnavailableError(
                f"vLLM runs on {name}, but this offload-engine has no {name} handler yet "
                f"({module_name} is missing); only vLLM's CPU platform is supported"
            ) from exc
        raise RuntimeUnavailableError(
            f"the {name} handler ({module_name}) cannot be imported: {exc}"
        ) from exc
    build = getattr(module, DEVICE_ENTRY_POINT, None)
    if build is None:
        raise RuntimeUnavailableError(
            f"{module_name} has no {DEVICE_ENTRY_POINT}(layout, num_tier_blocks, config) "
            "entry point, which the vLLM adapter needs"
        )
    return Backend(name, medium, build)


def select_backend(platform: Any) -> Backend:
    """The backend for a vLLM platform object (``vllm.platforms.current_platform``)."""
    device_type = getattr(platform, "device_type", None)
    if device_type == "cpu":
        return Backend("cpu", Medium.CPU, build_host_handlers)
    if device_type == "cuda":
        is_rocm = getattr(platform, "is_rocm", None)
        if callable(is_rocm) and is_rocm():
            raise RuntimeUnavailableError(
                "vLLM runs on ROCm, which offload-engine does not support"
            )
        return _device_backend("CUDA", Medium.GPU, CUDA_HANDLER_MODULE)
    if device_type == "npu":
        return _device_backend("NPU", Medium.NPU, NPU_HANDLER_MODULE)
    raise RuntimeUnavailableError(
        f"offload-engine has no handler for vLLM platform "
        f"{type(platform).__name__} (device_type={device_type!r}); "
        "supported: cpu, cuda, npu"
    )
