"""A device handler's configuration: the copy strategies and the validated knobs."""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Literal

from offload_engine._checks import check_int, check_seconds
from offload_engine.device.peers import MAX_DEVICES
from offload_engine.errors import ConfigError

#: ``DeviceHandlerConfig.native_launch`` unless given: use the native launch where the
#: runtime has it (one foreign call per job instead of one per driver call)
NATIVE_LAUNCH_DEFAULT: bool | Literal["auto"] = "auto"
#: ``DeviceHandlerConfig.peer_staging_bytes`` unless given: device memory on each
#: borrowed peer
PEER_STAGING_BYTES_DEFAULT = 64 << 20
#: ``DeviceHandlerConfig.peer_min_blocks`` unless given: smaller jobs stay on the own
#: link (a step's few blocks gain nothing from a second link's extra copies and events)
PEER_MIN_BLOCKS_DEFAULT = 64
_PEERS_ARE = "peers must be None, 'auto' or a tuple of device indices"


class CopyStrategy(enum.Enum):
    """How a job's bytes move: ``DMA`` (merged batched copy descriptors),
    ``STAGED`` (gather on the device into slot-shaped staging, then DMA whole
    slots), ``KERNEL`` (an SM copy to mapped pinned memory); ``AUTO`` picks per
    handler (see :class:`DeviceHandlerConfig`)."""

    AUTO = "auto"
    DMA = "dma"
    STAGED = "staged"
    KERNEL = "kernel"


@dataclass(frozen=True)
class DeviceHandlerConfig:
    """Tuning of a device handler; every field is validated at construction.

    ``staging_bytes`` is the device memory for the staged strategy, split in
    ``staging_buffers`` buffers (0 bytes disables it): with more buffers, more
    pieces can be gathered ahead of the copy engine, which hides gathers that
    wait for SMs a concurrent GEMM holds.
    ``AUTO`` picks ``dma`` or ``staged`` for each job at launch
    (:func:`~offload_engine.device.policy.choose_strategy` gives the reasons):
    ``dma`` when every region of a block is at least ``dma_min_chunk_bytes``,
    or the job needs at most ``dma_max_descriptors`` copy descriptors (block
    regions, before merging), or at most ``dma_backlog_descriptors`` while at
    least ``dma_backlog_bytes`` are launched and unfinished on the handler and
    every region is at least ``dma_backlog_min_region_bytes``;
    else ``staged``, where there is staging memory. The staged strategy's pieces are
    planned by the native library (built with the system C compiler on first
    use): without it ``AUTO`` picks ``dma`` and ``STAGED`` is refused.
    ``streams``: stream sets jobs
    rotate over (``None``: one with a batched copy API, four without).
    ``max_inflight``: jobs launched and not yet finished.
    ``close_timeout``: how long close waits for device work already abandoned
    by the engine before reporting the device broken.
    ``inline_launch_blocks``: a job of at most this many blocks (``dma``: block
    regions, one copy descriptor each) is put on the streams by the engine's
    loop thread when the launcher thread has nothing pending, which spares the
    launcher's wake-up; larger jobs, and jobs behind them, go through the
    launcher thread. A job with a fence (``TransferSpec.fence``: a layer-wise
    load's part, on which a stream waits soon) is launched by the thread that
    submits it when nothing is queued or pending before it, whatever its size.
    0 sends every job through the launcher thread, as does a runtime whose
    launches may wait (``nonblocking_launch`` false: NPU).
    ``submitter_launch``: such small jobs are launched by the thread that
    submits them when nothing is queued before them, sparing the loop's wake-up
    too: the least CPU per job in all, but the submitter pays the launch (a step
    that replays a CUDA graph starts that much later).
    ``polled_completion``: a finished job is found by the caller's own poll (the
    engine's ``get_finished``), one event query per stream the job used, and
    reported there, without waking the watcher thread; the watcher reports
    only while someone waits (a ``wait``, close, a full queue, a deadline).
    With ``submitter_launch`` too, a small job wakes no other thread at all.
    ``native_launch``: a job's driver calls are recorded and issued by one
    native call that releases the GIL (:mod:`offload_engine.device.runtimes._native`;
    CUDA with the NVRTC kernel and a C compiler). ``"auto"`` uses it where the
    runtime has it and keeps the Python calls elsewhere (logged); ``True``
    refuses a runtime without it; ``False`` always calls from Python.
    ``peers``: the devices whose host links this handler may borrow, over NVLink
    (host -> peer -> this device for loads, the reverse for stores): a tuple of
    device indices, ``"auto"`` (every peer the runtime reaches), or ``None`` or
    ``()`` (the own link only). ``peer_staging_bytes``: the device memory taken on
    each borrowed peer for the buffers its part of a job passes through (at least
    one tier slot per staging buffer where ``peers`` names any; the handler checks
    that against its layout). ``peer_min_blocks``: a staged job of at least this
    many blocks is split over the own link and the borrowed ones; smaller jobs,
    and jobs of other strategies, stay on the own link. The fake and CUDA runtimes
    offer peers (CUDA's not yet run on a host of several GPUs); see
    :mod:`offload_engine.device.multipath`.
    """

    strategy: CopyStrategy = CopyStrategy.AUTO
    staging_bytes: int = 256 << 20
    staging_buffers: int = 2
    dma_min_chunk_bytes: int = 512 << 10
    dma_max_descriptors: int = 256
    dma_backlog_bytes: int = 128 << 20
    dma_backlog_descriptors: int = 512
    dma_backlog_min_region_bytes: int = 128 << 10
    streams: int | None = None
    max_inflight: int = 16
    close_timeout: float = 30.0
    inline_launch_blocks: int = 64
    submitter_launch: bool = False
    polled_completion: bool = False
    native_launch: bool | Literal["auto"] = NATIVE_LAUNCH_DEFAULT
    peers: tuple[int, ...] | Literal["auto"] | None = None
    peer_staging_bytes: int = PEER_STAGING_BYTES_DEFAULT
    peer_min_blocks: int = PEER_MIN_BLOCKS_DEFAULT

    def __post_init__(self) -> None:
        if not (isinstance(self.native_launch, bool) or self.native_launch == "auto"):
            raise ConfigError(
                f"native_launch must be 'auto', True or False, got {self.native_launch!r}"
            )
        for key in ("submitter_launch", "polled_completion"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be a bool, got {getattr(self, key)!r}")
        if not isinstance(self.strategy, CopyStrategy):
            raise ConfigError(f"strategy must be a CopyStrategy, got {self.strategy!r}")
        for key in (
            "staging_bytes",
            "dma_min_chunk_bytes",
            "dma_max_descriptors",
            "dma_backlog_bytes",
            "dma_backlog_descriptors",
            "dma_backlog_min_region_bytes",
            "inline_launch_blocks",
        ):
            value = getattr(self, key)
            check_int(value, key, minimum=0)
        if self.streams is not None:
            check_int(self.streams, "streams (or None)")
        for key in ("max_inflight", "staging_buffers"):
            check_int(getattr(self, key), key)
        if self.staging_buffers < 2:
            raise ConfigError(f"staging_buffers must be at least 2, got {self.staging_buffers}")
        check_seconds(self.close_timeout, "close_timeout")
        borrows = self._check_peers()
        check_int(self.peer_staging_bytes, "peer_staging_bytes", minimum=1 if borrows else 0)
        check_int(self.peer_min_blocks, "peer_min_blocks")

    def _check_peers(self) -> bool:
        """Refuse a ``peers`` that is not None, ``"auto"`` or a tuple of distinct
        device indices; return whether it names any peer."""
        peers = self.peers
        if peers is None:
            return False
        if isinstance(peers, str):
            if peers != "auto":
                raise ConfigError(_PEERS_ARE + f", got {peers!r}")
            return True
        if not isinstance(peers, tuple):
            raise ConfigError(_PEERS_ARE + f", got {peers!r}")
        for i, device in enumerate(peers):
            check_int(device, f"peers[{i}] (a device index)", minimum=0, maximum=MAX_DEVICES - 1)
        repeated = sorted(d for d, n in collections.Counter(peers).items() if n > 1)
        if repeated:
            raise ConfigError(f"peers must name each device once, got {peers!r} ({repeated})")
        return bool(peers)
