"""Building a device tier: the pinned host tier and the store and load handlers."""

from __future__ import annotations

from typing import Any

import torch

from offload_engine._checks import check_int
from offload_engine.device.config import DeviceHandlerConfig
from offload_engine.device.handler import DeviceCopyHandler
from offload_engine.device.peers import PeerLedger
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.host import HostTier, KVLayout
from offload_engine.vocabulary import Direction


def pinned_host_tier(
    runtime: DeviceRuntime,
    layout: KVLayout,
    num_blocks: int,
    *,
    factor: int = 1,
    buffer: torch.Tensor | None = None,
    offset: int = 0,
    page_bytes: int | None = None,
    block_stride: int | None = None,
    owner: str = "the buffer",
) -> HostTier:
    """A host tier for ``layout``, registered with the runtime in chunks;
    ``tier.release()`` unregisters it.

    Without ``buffer`` the memory is allocated plainly (no power-of-two
    rounding). With one (a contiguous CPU byte tensor someone else owns, such as
    vLLM's shared offload region) the tier lives inside it, as
    :meth:`HostTier.over` places it, and ``buffer`` is registered as it is, never
    copied; give it as ``(rows, row_bytes)`` to make the registration chunks
    end on row boundaries. Release unregisters it and leaves the memory to its
    owner.
    """
    if not isinstance(runtime, DeviceRuntime) or not isinstance(layout, KVLayout):
        raise TypeError(
            f"pinned_host_tier takes a DeviceRuntime and a KVLayout, got "
            f"{type(runtime).__name__} and {type(layout).__name__}"
        )
    for key, value in (("num_blocks", num_blocks), ("factor", factor)):
        check_int(value, f"pinned_host_tier {key}")
    if buffer is None:
        rows = num_blocks * factor
        memory = torch.empty((rows, layout.slot_bytes), dtype=torch.uint8)
        unpin = runtime.pin_host(memory)
        return HostTier(
            num_blocks, layout.slot_bytes, factor=factor, memory=memory, release=unpin, pinned=True
        )
    place: dict[str, Any] = {
        "num_blocks": num_blocks,
        "slot_bytes": layout.slot_bytes,
        "factor": factor,
        "offset": offset,
        "page_bytes": page_bytes,
        "block_stride": block_stride,
        "owner": owner,
    }
    HostTier.over(buffer, **place).release()  # validate before registering anything
    unpin = runtime.pin_host(buffer)
    try:
        return HostTier.over(buffer, release=unpin, pinned=True, **place)
    except BaseException:
        unpin()
        raise


def make_device_handlers(
    runtime: DeviceRuntime,
    layout: KVLayout,
    tier: HostTier,
    config: DeviceHandlerConfig | None = None,
    *,
    ledger: PeerLedger | None = None,
) -> tuple[DeviceCopyHandler, DeviceCopyHandler]:
    """The store (device -> CPU) and load (CPU -> device) handlers over one tier
    (``ledger``: whose owners' traffic keeps them off borrowed peers' links)."""
    facts: dict[str, Any] = {"config": config, "ledger": ledger}
    return (
        DeviceCopyHandler(runtime, layout, tier, direction=Direction.STORE, **facts),
        DeviceCopyHandler(runtime, layout, tier, direction=Direction.LOAD, **facts),
    )
