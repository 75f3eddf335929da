"""The runtime seam a device handler is written against.

A runtime is deliberately thin. torch.cuda and torch.npu share one shape
(``Stream``, ``Event.record/query/synchronize``, ``current_stream``, a stream
context), so most methods forward to it. The places runtimes really differ are
the **batched async copy** (``cuMemcpyBatchAsync`` on CUDA,
``aclrtMemcpyBatchAsync`` on CANN, a recorder on the fake), **host pinning**,
and the **device-side block copy** (a Triton kernel on CUDA, torch ops
elsewhere).

Every method that enqueues work takes the stream it goes on. Nothing here
blocks except :meth:`DeviceRuntime.synchronize`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from offload_engine.device.runtimes._native import LaunchProgram
from offload_engine.errors import RuntimeUnavailableError
from offload_engine.vocabulary import Direction, Medium

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

# Bound on one host registration: a single registration of 512 GiB or more fails.
MAX_PIN_CHUNK_BYTES = 64 << 30


@dataclass(frozen=True)
class BlockCopy:
    """A device-side copy of whole blocks between KV regions and slot rows.

    For each block ``i`` and each region ``r`` of the group: the bytes at
    ``region_base[r] + cache_ids[i] * region_stride[r]`` (``region_size[r]``
    bytes) pair with the bytes at ``slot_base + slot_ids[i] * slot_bytes +
    slot_offset[r]``. A ``STORE`` copies regions -> slots (a gather), a
    ``LOAD`` slots -> regions (a scatter).

    ``region_*`` and ``cache_ids``/``slot_ids`` are device tensors (int64)
    prepared by :meth:`DeviceRuntime.upload`; ``slot_ids`` ``None`` means
    ``slot_ids[i] = i`` (a staging buffer filled in order). A kernel works on
    the addresses; a runtime without one uses the torch views instead
    (:func:`torch_block_copy`): ``cache_views[r]`` is region ``r`` as a
    ``(num_blocks, size)`` byte view and ``slot_view`` the ``(rows, row_bytes)``
    slot rows.
    """

    region_base: torch.Tensor
    region_stride: torch.Tensor
    region_size: torch.Tensor
    slot_offset: torch.Tensor
    max_region_size: int
    cache_ids: torch.Tensor
    slot_ids: torch.Tensor | None
    count: int
    slot_base: int
    slot_bytes: int
    direction: Direction
    cache_views: tuple[torch.Tensor, ...] = ()
    slot_view: torch.Tensor | None = None
    slot_offsets: tuple[int, ...] = ()


def torch_block_copy(copy: BlockCopy) -> None:
    """:class:`BlockCopy` with torch indexing on the current stream: one gather and
    one scatter per region. For runtimes without a copy kernel; device memory only."""
    if copy.slot_view is None or not copy.cache_views:
        raise ValueError("this BlockCopy carries no torch views")
    device = copy.slot_view.device
    rows = (
        copy.slot_ids
        if copy.slot_ids is not None
        else torch.arange(copy.count, dtype=torch.int64, device=device)
    )
    for view, offset in zip(copy.cache_views, copy.slot_offsets, strict=True):
        slots = copy.slot_view[:, offset : offset + view.shape[1]]
        if copy.direction is Direction.STORE:
            slots.index_copy_(0, rows, view.index_select(0, copy.cache_ids))
        else:
            view.index_copy_(0, copy.cache_ids, slots.index_select(0, rows))


class IdBuffer:
    """A job's block ids on their way to the device (see :meth:`DeviceRuntime.new_id_buffer`).

    ``host`` is the int64 array the handler fills; ``device`` is whatever the
    runtime keeps beside it (a device tensor on CUDA, nothing by default)."""

    __slots__ = ("device", "host", "keep")

    def __init__(self, host: I64, device: Any = None, keep: Any = None) -> None:
        self.host = host
        self.device = device
        self.keep = keep  # what owns ``host``'s memory (a pinned tensor), if not ``host``

    @property
    def capacity(self) -> int:
        return int(self.host.shape[0])


class DeviceRuntime(abc.ABC):
    """Streams, events, pinned memory and copies on one accelerator device."""

    name: str
    medium: Medium
    device: torch.device
    #: descriptors per batched-copy call (drivers fault or refuse above their cap)
    max_batch: int = 4096

    # -- streams and events ----------------------------------------------------

    @abc.abstractmethod
    def new_stream(self, priority: int = 0) -> Any:
        """A new non-default stream (never the legacy default stream). A negative
        ``priority`` asks for a higher one where the device has priorities (NPU: ignored)."""

    def release_stream(self, stream: Any) -> None:  # noqa: B027 - optional hook
        """Give back a stream from :meth:`new_stream` once no work is left on it (a
        handler's close). Runtimes whose streams come from a shared pool keep them."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The calling thread's current stream on this device (the compute stream)."""

    @abc.abstractmethod
    def new_event(self) -> Any:
        """An event whose ``synchronize`` sleeps rather than spins."""

    @abc.abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` at the current end of ``stream``."""

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event``'s latest record."""

    @abc.abstractmethod
    def synchronize(self, event: Any) -> None:
        """Block until the event's recorded work has finished; raise if it failed."""

    def stream_handle(self, stream: Any) -> int:
        """The driver's handle of ``stream`` (an address), as native code takes it.
        Only a native launch program's planner asks (see :meth:`native_program`);
        the default says the runtime has none."""
        raise RuntimeUnavailableError(f"the {self.name} runtime has no native stream handles")

    def event_handle(self, event: Any) -> int:
        """The driver's handle of ``event``, as native code takes it (see
        :meth:`stream_handle`)."""
        raise RuntimeUnavailableError(f"the {self.name} runtime has no native event handles")

    def query(self, event: Any) -> bool:
        """Whether the event's recorded work has finished, without waiting; raise
        if it failed (as :meth:`synchronize` would). Only a handler with
        ``polled_completion`` calls it, so a runtime written before it existed
        still works without; such a handler refuses a runtime that lacks it."""
        raise NotImplementedError(f"{type(self).__name__} has no non-blocking event query")

    # -- peers -----------------------------------------------------------------

    @property
    def device_index(self) -> int:
        """This device's index among the host's devices (what ``peers`` names)."""
        return self.device.index if self.device.index is not None else 0

    def host_device_index(self, device: int) -> int | None:
        """Device ``device`` (as this process numbers its devices) as the host numbers
        it, for the host's :class:`~offload_engine.device.peers.PeerLedger`, which
        processes that see the devices in another order share; None where it cannot
        be told. The default: the same index."""
        return device

    def peer_devices(self) -> tuple[int, ...]:
        """The devices whose host links this one may borrow: its memory reaches
        theirs (peer access, over NVLink) and :meth:`alloc_device_on` and
        :meth:`new_stream_on` serve them. The default offers none."""
        return ()

    def alloc_device_on(self, device: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of peer ``device``'s memory as a uint8 tensor, which block
        copies on this device's streams may read and write. Raises
        :class:`RuntimeUnavailableError` where the runtime offers no such peer."""
        raise RuntimeUnavailableError(f"the {self.name} runtime offers no peer devices")

    def new_stream_on(self, device: int, priority: int = 0) -> Any:
        """A new stream on peer ``device`` (its copies use that device's own host
        link), given back with :meth:`release_stream`. Raises
        :class:`RuntimeUnavailableError` where the runtime offers no such peer."""
        raise RuntimeUnavailableError(f"the {self.name} runtime offers no peer devices")

    def new_event_on(self, device: int) -> Any:
        """A new event on peer ``device``, for :meth:`record` on that device's streams
        alone (an event is recorded only on a stream of the device it was made on;
        any stream may wait on it). Raises :class:`RuntimeUnavailableError` where the
        runtime offers no such peer."""
        raise RuntimeUnavailableError(f"the {self.name} runtime offers no peer devices")

    # -- memory ----------------------------------------------------------------

    @abc.abstractmethod
    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` lives in this runtime's device memory."""

    @abc.abstractmethod
    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory as a uint8 tensor."""

    @abc.abstractmethod
    def pin_host(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Register a host tensor's memory for DMA (in chunks of at most
        :data:`MAX_PIN_CHUNK_BYTES`); return the call that unregisters it."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True if DMA may use ``tensor``'s host memory directly."""

    @abc.abstractmethod
    def upload(self, stream: Any, values: I64) -> torch.Tensor:
        """Copy a small int64 array to the device, ordered on ``stream``."""

    def new_id_buffer(self, capacity: int) -> IdBuffer:
        """Room for ``capacity`` block ids that a handler fills and uploads once per job.

        A handler reuses a buffer only after the job that used it is done, so a
        runtime may keep host and device memory in it and copy without allocating.
        The default keeps a host array and uploads through :meth:`upload`."""
        return IdBuffer(np.empty(capacity, dtype=np.int64))

    def upload_ids(self, stream: Any, buffer: IdBuffer, count: int) -> torch.Tensor:
        """``buffer.host[:count]`` on the device, ordered on ``stream``; valid until
        the job that filled ``buffer`` is done."""
        return self.upload(stream, buffer.host[:count])

    def launcher_context(self, stream: Any) -> AbstractContextManager[Any]:
        """What a handler's launcher thread runs inside, given its SM stream: a runtime
        whose block copies go on the current stream makes ``stream`` current there,
        so no launch switches streams. The default does nothing."""
        return contextlib.nullcontext()

    def native_program(self) -> LaunchProgram:
        """A recorder for a job's launch that issues its calls in one native call
        (``DeviceHandlerConfig.native_launch``; see :mod:`offload_engine.device.runtimes._native`):
        it has this runtime's enqueueing methods (``record``, ``wait_event``,
        ``memcpy_batch``, ``copy_blocks``, ``upload_ids``). Raises
        :class:`RuntimeUnavailableError` saying why where there is none (the default:
        the NPU and fake runtimes launch from Python)."""
        raise RuntimeUnavailableError(f"the {self.name} runtime launches its jobs from Python")

    def record_current(self, event: Any) -> None:
        """Record ``event`` on the calling thread's current stream (the compute stream)."""
        self.record(event, self.current_stream())

    # -- copies ----------------------------------------------------------------

    @abc.abstractmethod
    def memcpy_batch(self, stream: Any, dst: U64, src: U64, sizes: U64, kind: Direction) -> int:
        """Enqueue ``len(sizes)`` copies on ``stream``, in calls of at most
        :attr:`max_batch` descriptors (or one call per copy where the batched
        API is missing). Returns the number of driver calls made."""

    def memcpy_2d(
        self,
        stream: Any,
        dst: int,
        src: int,
        width: int,
        height: int,
        pitches: tuple[int, int],
        kind: Direction,
    ) -> None:
        """Enqueue ``height`` copies of ``width`` bytes on ``stream``, row ``i`` from
        ``src + i * pitches[1]`` to ``dst + i * pitches[0]``. Here: one descriptor
        per row through :meth:`memcpy_batch`; a runtime with a 2D copy (the copy
        engine moves the rows as one transfer) makes that instead."""
        rows = np.arange(height, dtype=np.uint64)
        dst_rows = np.uint64(dst) + rows * np.uint64(pitches[0])
        src_rows = np.uint64(src) + rows * np.uint64(pitches[1])
        self.memcpy_batch(stream, dst_rows, src_rows, np.full(height, width, np.uint64), kind)

    @abc.abstractmethod
    def copy_blocks(self, stream: Any, copy: BlockCopy) -> None:
        """Enqueue a device-side (SM) block copy on ``stream``."""

    @property
    def supports_kernel_strategy(self) -> bool:
        """True if :meth:`copy_blocks` may address mapped pinned host memory."""
        return False

    @property
    def supports_block_copy(self) -> bool:
        """True if :meth:`copy_blocks` works at all (the staged strategy needs it)."""
        return True

    #: byte alignment :meth:`copy_blocks` needs of every address and size
    block_copy_alignment: int = 1
    #: every enqueueing call returns without waiting for earlier device work, so a
    #: handler may launch small jobs on the submitting thread or the engine's loop
    #: (a runtime whose stream switch synchronises, as the NPU's may, says False)
    nonblocking_launch: bool = False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release runtime-level resources (threads of a fake runtime)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.device}>"


class TorchStyleEvents:
    """The event half of the seam for runtimes whose streams and events follow
    torch.cuda's API (``Event.record/query/synchronize``, ``Stream.wait_event``):
    CUDA and torch_npu."""

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def query(self, event: Any) -> bool:
        return bool(event.query())


def pin_chunks(
    total: int, row_bytes: int, limit: int = MAX_PIN_CHUNK_BYTES
) -> Iterator[tuple[int, int]]:
    """``(offset, size)`` pieces of at most ``limit`` bytes that end on row boundaries,
    so no block straddles two registrations."""
    rows = max(limit // max(row_bytes, 1), 1)
    step = rows * row_bytes
    for offset in range(0, total, step):
        yield offset, min(step, total - offset)


def spans_cover(spans: Iterable[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``(address, size)`` registrations cover ``[start, end)`` without a gap
    (a range may run across consecutive registrations of one tensor)."""
    pos = start
    for lo, size in sorted(spans):
        if lo <= pos < lo + size:
            pos = lo + size
            if pos >= end:
                return True
    return False
