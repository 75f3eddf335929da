"""Which handler serves vLLM's KV cache, by vLLM platform.

:func:`select_backend` is the one place that decides:

* vLLM's **CPU** platform (``device_type == "cpu"``): the KV cache lives in
  host memory, so :class:`~offload_engine.HostCopyHandler` copies CPU <-> CPU;
* **CUDA** (``"cuda"``, not ROCm): the device handler on the CUDA runtime,
  GPU <-> CPU;
* **Ascend** (``"npu"``): the same device handler on the NPU runtime,
  NPU <-> CPU.

Device runtimes are imported lazily, only when their platform is selected; a
runtime that is missing or unusable raises
:class:`~offload_engine.RuntimeUnavailableError` saying why. The
platform is passed in (vLLM's ``current_platform`` in production, any object
with a ``device_type`` attribute in tests), so this module does not import vLLM.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from offload_engine import (
    CopyStrategy,
    DeviceHandlerConfig,
    DeviceRuntime,
    HostCopyHandler,
    HostTier,
    KVLayout,
    LedgerUnavailableError,
    Medium,
    PeerLedger,
    RuntimeUnavailableError,
    TransferHandler,
    make_device_handlers,
    pinned_host_tier,
)

from .config import DEFAULT_STAGING_BYTES, EngineOffloadingConfig


@dataclass(frozen=True)
class TierPlacement:
    """Where the host tier lives when its memory is someone else's (vLLM's shared
    offload region): block ``b`` is ``page_bytes`` at ``offset + b * block_stride``
    of ``buffer``, a contiguous ``(rows, row_bytes)`` byte tensor. ``owner`` names
    it in errors."""

    buffer: torch.Tensor
    offset: int
    page_bytes: int
    block_stride: int
    owner: str

    def tier_kwargs(self) -> dict[str, Any]:
        """The keywords :meth:`HostTier.over` and :func:`pinned_host_tier` take."""
        return {
            "buffer": self.buffer,
            "offset": self.offset,
            "page_bytes": self.page_bytes,
            "block_stride": self.block_stride,
            "owner": self.owner,
        }


class BuildHandlers(Protocol):
    """``build(layout, num_tier_blocks, config, placement) -> (handlers, tier)``;
    without a placement the tier is allocated privately."""

    def __call__(
        self,
        layout: KVLayout,
        num_tier_blocks: int,
        config: EngineOffloadingConfig,
        placement: TierPlacement | None = None,
    ) -> tuple[list[TransferHandler[Any]], HostTier]: ...


#: The device runtime of each platform, as ``module:class``, imported on selection.
CUDA_RUNTIME = "offload_engine:CudaRuntime"
NPU_RUNTIME = "offload_engine:NpuRuntime"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    """What the worker needs from a platform: the medium its KV cache lives on,
    and how to build the handlers (and the host tier they fill)."""

    name: str
    cache_medium: Medium
    build: BuildHandlers


def build_host_handlers(
    layout: KVLayout,
    num_tier_blocks: int,
    config: EngineOffloadingConfig,
    placement: TierPlacement | None = None,
) -> tuple[list[TransferHandler[Any]], HostTier]:
    """CPU platform: one HostCopyHandler serves stores and loads (CPU <-> CPU)."""
    if config.strategy != "auto" or config.staging_bytes != DEFAULT_STAGING_BYTES:
        logger.info(
            "offload-engine: 'strategy' and 'staging_bytes' apply to device handlers; "
            "ignored on vLLM's CPU platform"
        )
    if placement is None:
        tier = HostTier.for_layout(layout, num_tier_blocks, factor=config.blocks_per_chunk)
    else:
        tier = HostTier.over(
            num_blocks=num_tier_blocks,
            slot_bytes=layout.slot_bytes,
            factor=config.blocks_per_chunk,
            **placement.tier_kwargs(),
        )
    try:
        handler = HostCopyHandler(layout, tier, workers=config.host_workers)
    except BaseException:
        tier.release()
        raise
    return [handler], tier


#: ``max_inflight`` of the device handlers under ``load_mode: layerwise``
LAYERWISE_MAX_INFLIGHT = 256


def build_device_handlers(
    runtime: DeviceRuntime,
    layout: KVLayout,
    num_tier_blocks: int,
    config: EngineOffloadingConfig,
    placement: TierPlacement | None = None,
) -> tuple[list[TransferHandler[Any]], HostTier]:
    """A device platform: a store and a load handler over one pinned host tier
    (the placement's memory registered with the runtime, never copied)."""
    where = placement.tier_kwargs() if placement is not None else {}
    tier = pinned_host_tier(
        runtime, layout, num_tier_blocks, factor=config.blocks_per_chunk, **where
    )
    try:
        device_config = DeviceHandlerConfig(
            strategy=CopyStrategy(config.strategy),
            staging_bytes=config.staging_bytes,
            submitter_launch=config.submitter_launch,
            polled_completion=config.polled_completion,
            # a layer-wise step launches every part of its loads at once, so no wait for
            # a layer finds its part still queued behind the launch limit
            max_inflight=(
                LAYERWISE_MAX_INFLIGHT
                if config.load_mode == "layerwise"
                else DeviceHandlerConfig.max_inflight
            ),
        )
        if config.native_launch is not None:  # None: the handler's default
            device_config = replace(device_config, native_launch=config.native_launch)
        if config.peers is not None:
            device_config = replace(device_config, peers=config.peers)
        if config.peer_staging_bytes is not None:
            device_config = replace(device_config, peer_staging_bytes=config.peer_staging_bytes)
        if config.peer_min_blocks is not None:
            device_config = replace(device_config, peer_min_blocks=config.peer_min_blocks)
        ledger = _peer_ledger(config)
        try:
            handlers = make_device_handlers(runtime, layout, tier, device_config, ledger=ledger)
        except BaseException:
            if ledger is not None:
                ledger.close()
            raise
    except BaseException:
        tier.release()
        raise
    return list(handlers), tier


def _peer_ledger(config: EngineOffloadingConfig) -> PeerLedger | None:
    """The host's peer ledger where this worker borrows peers' links or announces its
    own traffic (``peer_ledger``, on by default with ``peers``); None where neither,
    or where the ledger cannot be opened (logged: the links are then used blind).
    The handlers' bridge closes it at shutdown."""
    wanted = bool(config.peers) if config.peer_ledger is None else config.peer_ledger
    if not wanted:
        return None
    try:
        return PeerLedger()
    except LedgerUnavailableError as exc:
        logger.warning(
            "offload-engine: no peer ledger (%s): this worker neither announces its own "
            "traffic nor sees its peers' owners'",
            exc,
        )
        return None


def load_runtime(name: str, target: str) -> Callable[[], DeviceRuntime]:
    """Import ``module:class`` of a device runtime, or say clearly why it cannot be."""
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        # offload_engine imports its runtimes on first use: getattr is the import
        runtime_class = getattr(module, class_name, None)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise RuntimeUnavailableError(
                f"vLLM runs on {name}, but this offload-engine has no {name} runtime "
                f"({module_name} is missing)"
            ) from exc
        raise RuntimeUnavailableError(
            f"the {name} runtime ({module_name}) cannot be imported: {exc}"
        ) from exc
    if runtime_class is None:
        raise RuntimeUnavailableError(f"{module_name} has no {class_name}")
    return runtime_class  # type: ignore[no-any-return]


def _device_backend(name: str, medium: Medium, target: str) -> Backend:
    make_runtime = load_runtime(name, target)

    def build(
        layout: KVLayout,
        num_tier_blocks: int,
        config: EngineOffloadingConfig,
        placement: TierPlacement | None = None,
    ) -> tuple[list[TransferHandler[Any]], HostTier]:
        return build_device_handlers(make_runtime(), layout, num_tier_blocks, config, placement)

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
        return _device_backend("CUDA", Medium.GPU, CUDA_RUNTIME)
    if device_type == "npu":
        return _device_backend("NPU", Medium.NPU, NPU_RUNTIME)
    raise RuntimeUnavailableError(
        f"offload-engine has no handler for vLLM platform "
        f"{type(platform).__name__} (device_type={device_type!r}); "
        "supported: cpu, cuda, npu"
    )
