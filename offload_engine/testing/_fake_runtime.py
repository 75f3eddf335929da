"""A CPU-backed runtime whose streams and events behave like a GPU's.

Each :class:`FakeStream` is a worker thread that runs the operations enqueued
on it in order, so work is truly asynchronous: ``record`` marks an event done
when the stream reaches it, ``wait_event`` holds a stream until the event's
latest record (at the time of the call) is reached, ``query`` never blocks and
``synchronize`` sleeps on a condition. "Device memory" is host memory the
runtime handed out (:meth:`FakeRuntime.empty`); "pinned" memory is host memory
registered with :meth:`FakeRuntime.pin_host`. Copies are ``ctypes.memmove``
over raw addresses, an implementation independent of the host handler's torch
indexing, so the two check each other.

For tests, it records every batched-copy call and can inject faults:
:meth:`fail_next` makes the next copy of a kind raise (the failure surfaces at
the next event recorded on that stream, as an asynchronous device error
would), and :meth:`hang_next` makes the next copy never finish until
:meth:`release_hangs` or :meth:`close`.

**Several devices.** ``FakeRuntime(devices=4)`` is device 0 of a host of four
whose devices reach each other's memory (``peer_access`` narrows that): each
device has its own "device memory" and streams (:meth:`FakeRuntime.empty_on`,
:meth:`~FakeRuntime.alloc_device_on`, :meth:`~FakeRuntime.new_stream_on`), a DMA
must move between pinned host memory and the memory of its stream's device, a
block copy's slot rows must lie in memory its stream's device reaches, and an
event may be recorded only on a stream of the device it was made on
(:meth:`~FakeRuntime.new_event_on`), as in CUDA; any stream may wait on any event. Faults
can be aimed at one device (``fail_next(device=...)``,
:meth:`~FakeRuntime.fail_allocations_on`); every copy is recorded with its
stream's device (:class:`BatchCall`, :class:`KernelCall`), and every stream wait
with the record it waits for (``wait_calls``).
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from offload_engine.device.runtimes.base import (
    I64,
    MAX_PIN_CHUNK_BYTES,
    U64,
    BlockCopy,
    DeviceRuntime,
    pin_chunks,
    spans_cover,
)
from offload_engine.errors import RuntimeUnavailableError, TransferError
from offload_engine.vocabulary import Direction, Medium

_STOP = object()


class FakeDeviceError(RuntimeError):
    """An injected (or detected) device failure of the fake runtime."""


class FakeEvent:
    """Counts records and completions; a failed op poisons the next record.
    ``device``: the device it was made on, whose streams alone may record it."""

    def __init__(self, lock: threading.Lock, device: int = 0) -> None:
        self._cond = threading.Condition(lock)
        self.device = device
        self.recorded = 0
        self.completed = 0
        self.errors: dict[int, BaseException] = {}

    def complete(self, generation: int, error: BaseException | None) -> None:
        with self._cond:
            if error is not None:
                self.errors[generation] = error
            self.completed = max(self.completed, generation)
            self.errors = {g: e for g, e in self.errors.items() if g >= generation}
            self._cond.notify_all()

    def reached(self, error_type: type[Exception], what: str) -> bool:
        """Whether the latest record's work is done (a query); raise ``error_type``
        if it failed."""
        with self._cond:
            target = self.recorded
            if self.completed < target:
                return False
            error = self.errors.get(target)
        if error is not None:
            raise error_type(f"{what} before this event failed: {error}") from error
        return True

    def wait_for(self, generation: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.completed >= generation)


class SerialStream:
    """A FIFO of operations run in order by one thread (the fakes' streams).

    An operation that raises leaves its error pending on the stream; the next
    event recorded there carries it, as an asynchronous device error would.
    ``inline`` streams have no thread: each operation runs at once, in the
    thread that enqueues it (a device that finishes work as soon as it gets it).
    """

    def __init__(self, name: str, *, inline: bool = False) -> None:
        self.name = name
        self._ops: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.pending_error: BaseException | None = None
        self.inline = inline
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        if not inline:
            self.thread.start()

    def enqueue(self, op: Callable[[], None]) -> None:
        if not self.inline:
            self._ops.put(op)
            return
        try:
            op()
        except Exception as exc:  # noqa: BLE001 - surfaces at the next recorded event
            self.pending_error = exc

    def stop(self) -> None:
        if not self.inline:
            self._ops.put(_STOP)

    def join(self) -> None:
        if not self.inline:
            self.thread.join()

    def _run(self) -> None:
        while True:
            op = self._ops.get()
            if op is _STOP:
                return
            try:
                op()  # type: ignore[operator]
            except Exception as exc:  # noqa: BLE001 - surfaces at the next recorded event
                self.pending_error = exc

    def take_error(self) -> BaseException | None:
        error, self.pending_error = self.pending_error, None
        return error

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class FakeStream(SerialStream):
    """A stream of the fake CUDA-like runtime."""

    _ids = itertools.count()

    def __init__(self, runtime: FakeRuntime, device: int | None = None) -> None:
        self.runtime = runtime
        #: the device the stream belongs to (its copies use that device's host link)
        self.device = runtime.device_index if device is None else device
        super().__init__(f"offload-engine-fake-stream-{next(self._ids)}", inline=runtime.inline)


@dataclass(frozen=True)
class BatchCall:
    """One recorded batched-copy call (``device``: its stream's device)."""

    stream: str
    kind: Direction
    count: int
    dst: tuple[int, ...]
    src: tuple[int, ...]
    sizes: tuple[int, ...]
    device: int = 0


@dataclass(frozen=True)
class KernelCall:
    """One recorded block copy: its stream, the stream's device, the blocks, and the
    device whose memory holds its slot rows (-1: pinned host memory)."""

    stream: str
    device: int
    count: int
    rows_on: int


class FakeDeviceMemory:
    """Host memory a fake hands out as "device memory", and the address ranges it
    covers (so a fake can refuse a copy to or from anything else). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        start = t.data_ptr()
        with self._lock:
            self._ranges.append((start, start + t.numel() * t.element_size()))
        return t

    def holds(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` lies inside one tensor this memory handed out."""
        with self._lock:
            return any(lo <= start and end <= hi for lo, hi in self._ranges)


class FakeRuntime(DeviceRuntime):
    """A runtime whose device is host memory and whose streams are threads.

    With ``inline=True`` the streams have no threads: every operation runs when
    it is enqueued, in the enqueuing thread, so work is done by the time a launch
    returns (for deterministic tests and for measuring the engine's own threads;
    ``hang_next`` would hang the launching thread there).

    ``devices``: how many devices the fake host has; the runtime is device
    ``device_index`` of them, and ``peer_access`` the devices it may borrow (every
    other one unless given). ``host_indices``: how the host numbers them (as
    ``CUDA_VISIBLE_DEVICES`` reorders them; None entries: it cannot be told), the
    same order unless given.
    """

    nonblocking_launch = True  # every call only puts work on a stream thread

    name = "fake"

    def __init__(
        self,
        medium: Medium = Medium.GPU,
        *,
        max_batch: int = 4096,
        batched: bool = True,
        pin_chunk_bytes: int = MAX_PIN_CHUNK_BYTES,
        kernel_copies: bool = True,
        inline: bool = False,
        devices: int = 1,
        device_index: int = 0,
        peer_access: Iterable[int] | None = None,
        host_indices: Sequence[int | None] | None = None,
    ) -> None:
        if host_indices is not None and len(host_indices) != devices:
            raise ValueError(f"host_indices {host_indices} does not name {devices} devices")
        self._host_indices = tuple(range(devices)) if host_indices is None else tuple(host_indices)
        if not 0 <= device_index < devices:
            raise ValueError(f"device_index {device_index} is not one of {devices} devices")
        self._index = device_index
        others = tuple(d for d in range(devices) if d != device_index)
        peers = others if peer_access is None else tuple(sorted(set(peer_access)))
        if any(d not in others for d in peers):
            raise ValueError(f"peer_access {peers} names a device not in {others}")
        self._peers = peers
        self.medium = medium
        self.inline = inline
        self.device = torch.device("cpu")
        self.max_batch = max_batch
        self.batched = batched
        self.pin_chunk_bytes = pin_chunk_bytes
        self._kernel_copies = kernel_copies
        self._lock = threading.Lock()
        self._streams: list[FakeStream] = []
        #: each device's memory; ``device_memory`` is this runtime's own device's
        self.device_memories = [FakeDeviceMemory() for _ in range(devices)]
        self.device_memory = self.device_memories[device_index]
        self._alloc_failures: dict[int, BaseException] = {}
        self._pinned: dict[int, tuple[int, int]] = {}  # registration start -> (start, end)
        # (kind, device or None for any device) -> the injected error / a hang
        self._fail_next: dict[tuple[str, int | None], BaseException] = {}
        self._hang_next: set[tuple[str, int | None]] = set()
        self._release = threading.Event()
        self.batch_calls: list[BatchCall] = []
        self.block_copies = 0
        self.kernel_calls: list[KernelCall] = []
        #: every stream wait: (the stream's name, id of the event, the record waited for)
        self.wait_calls: list[tuple[str, int, int]] = []
        self.pin_calls: list[tuple[int, int]] = []
        self.unpin_calls: list[int] = []
        self.closed = False
        self.compute = self.new_stream()

    # ------------------------------------------------------------ streams and events

    def new_stream(self, priority: int = 0) -> FakeStream:
        return self._new_stream(self._index)

    def _new_stream(self, device: int) -> FakeStream:
        with self._lock:
            if self.closed:
                raise FakeDeviceError("the fake runtime is closed")
            stream = FakeStream(self, device)
            self._streams.append(stream)
        return stream

    # ------------------------------------------------------------ peers

    @property
    def device_index(self) -> int:
        return self._index

    def host_device_index(self, device: int) -> int | None:
        return self._host_indices[device] if 0 <= device < len(self._host_indices) else None

    def peer_devices(self) -> tuple[int, ...]:
        return self._peers

    def _check_peer(self, device: int) -> None:
        if device not in self._peers:
            raise RuntimeUnavailableError(
                f"fake device {self._index} has no peer access to device {device} "
                f"(its peers: {self._peers})"
            )

    def alloc_device_on(self, device: int, nbytes: int) -> torch.Tensor:
        self._check_peer(device)
        return self.empty_on(device, (nbytes,))

    def new_stream_on(self, device: int, priority: int = 0) -> FakeStream:
        self._check_peer(device)
        return self._new_stream(device)

    def new_event_on(self, device: int) -> FakeEvent:
        self._check_peer(device)
        return FakeEvent(threading.Lock(), device)

    def empty_on(
        self, device: int, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8
    ) -> torch.Tensor:
        """A tensor in ``device``'s fake memory; raises the error
        :meth:`fail_allocations_on` set for ``device``, if any."""
        with self._lock:
            error = self._alloc_failures.get(device)
        if error is not None:
            raise error
        return self.device_memories[device].empty(shape, dtype)

    def fail_allocations_on(self, device: int, error: BaseException | None = None) -> None:
        """Make every later allocation on ``device`` raise (its memory is full)."""
        with self._lock:
            self._alloc_failures[device] = error or FakeDeviceError(
                f"out of memory on fake device {device}"
            )

    def memory_of(self, start: int, end: int) -> int | None:
        """The device whose fake memory holds ``[start, end)``, or None."""
        for device, memory in enumerate(self.device_memories):
            if memory.holds(start, end):
                return device
        return None

    def current_stream(self) -> FakeStream:
        return self.compute

    def new_event(self) -> FakeEvent:
        return FakeEvent(threading.Lock(), self._index)

    def stream_handle(self, stream: Any) -> int:
        return id(stream)  # a fake stream has no driver handle: its identity stands in

    def event_handle(self, event: Any) -> int:
        return id(event)

    def record(self, event: Any, stream: Any) -> None:
        if event.device != stream.device:  # cuEventRecord: CUDA_ERROR_INVALID_HANDLE
            raise TransferError(
                f"an event of device {event.device} recorded on {stream.name} of device "
                f"{stream.device}: an event is recorded only on its own device's streams"
            )
        with event._cond:
            event.recorded += 1
            generation = event.recorded
        stream.enqueue(lambda: event.complete(generation, stream.take_error()))

    def wait_event(self, stream: Any, event: Any) -> None:
        generation = event.recorded
        self.wait_calls.append((stream.name, id(event), generation))
        if generation:
            stream.enqueue(lambda: event.wait_for(generation))

    def synchronize(self, event: Any) -> None:
        with event._cond:
            target = event.recorded
            event._cond.wait_for(lambda: event.completed >= target)
            error = event.errors.get(target)
        if error is not None:
            raise FakeDeviceError(f"device work before this event failed: {error}") from error

    def query(self, event: Any) -> bool:
        return bool(event.reached(FakeDeviceError, "device work"))

    def enqueue(self, stream: FakeStream, op: Callable[[], None]) -> None:
        """Run ``op`` on ``stream`` in order (tests use it as "compute work")."""
        stream.enqueue(op)

    # ------------------------------------------------------------ memory

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A tensor in the fake's "device memory"."""
        return self.empty_on(self._index, shape, dtype)

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        return self.device_memory.holds(
            start, start + max(tensor.numel() * tensor.element_size(), 1)
        )

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return self.empty((nbytes,))

    def pin_host(self, tensor: torch.Tensor) -> Callable[[], None]:
        base = tensor.data_ptr()
        total = tensor.numel() * tensor.element_size()
        row = tensor.stride(0) * tensor.element_size() if tensor.dim() > 1 else 1
        starts = []
        with self._lock:
            for offset, size in pin_chunks(total, row, self.pin_chunk_bytes):
                self._pinned[base + offset] = (base + offset, base + offset + size)
                self.pin_calls.append((base + offset, size))
                starts.append(base + offset)

        def release() -> None:
            with self._lock:
                for s in starts:
                    if self._pinned.pop(s, None) is not None:
                        self.unpin_calls.append(s)

        return release

    def _is_pinned_range(self, start: int, end: int) -> bool:
        # a range may span consecutive chunks of one registration
        with self._lock:
            spans = [(lo, hi - lo) for lo, hi in self._pinned.values()]
        return spans_cover(spans, start, end)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        return self._is_pinned_range(start, start + tensor.numel() * tensor.element_size())

    def upload(self, stream: Any, values: I64) -> torch.Tensor:
        return torch.tensor(np.asarray(values, dtype=np.int64))

    # ------------------------------------------------------------ faults

    def fail_next(
        self, kind: str = "copy", error: BaseException | None = None, *, device: int | None = None
    ) -> None:
        """Make the next operation of ``kind`` (``copy`` or ``kernel``) fail; with
        ``device``, the next one on a stream of that device."""
        with self._lock:
            self._fail_next[kind, device] = error or FakeDeviceError(f"injected {kind} failure")

    def hang_next(self, kind: str = "copy", *, device: int | None = None) -> None:
        """Make the next operation of ``kind`` never finish until released (with
        ``device``: the next one on a stream of that device)."""
        with self._lock:
            self._hang_next.add((kind, device))

    def release_hangs(self) -> None:
        self._release.set()

    def _faults(self, kind: str, device: int) -> tuple[BaseException | None, bool]:
        """The fault aimed at this operation: one aimed at its stream's device
        first, else one aimed at any device."""
        with self._lock:
            error = self._fail_next.pop((kind, device), None)
            if error is None:
                error = self._fail_next.pop((kind, None), None)
            hang = False
            for key in ((kind, device), (kind, None)):
                if key in self._hang_next:
                    self._hang_next.discard(key)
                    hang = True
                    break
        return error, hang

    def _run_faults(self, error: BaseException | None, hang: bool) -> None:
        if hang:
            self._release.wait()
            raise FakeDeviceError("a hung operation was released")
        if error is not None:
            raise error

    # ------------------------------------------------------------ copies

    def _check_dma(self, dst: U64, src: U64, sizes: U64, kind: Direction, device: int) -> None:
        host, dev = (dst, src) if kind is Direction.STORE else (src, dst)
        memory = self.device_memories[device]
        for h, d, n in zip(host.tolist(), dev.tolist(), sizes.tolist(), strict=True):
            if not self._is_pinned_range(h, h + n):
                raise FakeDeviceError(f"DMA from/to host memory at {h:#x} that is not pinned")
            if not memory.holds(d, d + n):
                raise FakeDeviceError(
                    f"DMA on a stream of device {device} from/to {d:#x}, which is not that "
                    "device's memory"
                )

    def memcpy_batch(self, stream: Any, dst: U64, src: U64, sizes: U64, kind: Direction) -> int:
        n = int(sizes.shape[0])
        step = self.max_batch if self.batched else 1
        calls = 0
        for lo in range(0, n, step):
            d, s, z = dst[lo : lo + step], src[lo : lo + step], sizes[lo : lo + step]
            self._check_dma(d, s, z, kind, stream.device)
            self.batch_calls.append(
                BatchCall(
                    stream.name,
                    kind,
                    len(z),
                    tuple(d.tolist()),
                    tuple(s.tolist()),
                    tuple(z.tolist()),
                    stream.device,
                )
            )
            calls += 1
        error, hang = self._faults("copy", stream.device)
        dst_l, src_l, size_l = dst.tolist(), src.tolist(), sizes.tolist()

        def op() -> None:
            self._run_faults(error, hang)
            for d, s, z in zip(dst_l, src_l, size_l, strict=True):
                ctypes.memmove(d, s, z)

        stream.enqueue(op)
        return calls

    @property
    def supports_kernel_strategy(self) -> bool:
        return self._kernel_copies

    def copy_blocks(self, stream: Any, copy: BlockCopy) -> None:
        base = copy.region_base.tolist()
        stride = copy.region_stride.tolist()
        size = copy.region_size.tolist()
        offset = copy.slot_offset.tolist()
        cache_ids = copy.cache_ids.tolist()
        slot_ids = copy.slot_ids.tolist() if copy.slot_ids is not None else range(copy.count)
        rows_on = self._rows_on(stream.device, copy, base, offset, size, slot_ids)
        error, hang = self._faults("kernel", stream.device)
        self.block_copies += 1
        self.kernel_calls.append(KernelCall(stream.name, stream.device, copy.count, rows_on))

        def op() -> None:
            self._run_faults(error, hang)
            for cid, sid in zip(cache_ids, slot_ids, strict=True):
                row = copy.slot_base + sid * copy.slot_bytes
                for b, st, z, off in zip(base, stride, size, offset, strict=True):
                    cache_addr = (b + cid * st) & 0xFFFFFFFFFFFFFFFF
                    if copy.direction is Direction.STORE:
                        ctypes.memmove(row + off, cache_addr, z)
                    else:
                        ctypes.memmove(cache_addr, row + off, z)

        stream.enqueue(op)

    def _rows_on(
        self,
        device: int,
        copy: BlockCopy,
        base: list[int],
        offset: list[int],
        size: list[int],
        slot_ids: Any,
    ) -> int:
        """The device whose memory holds the copy's slot rows (-1: pinned host memory,
        the kernel strategy's tier); refuses rows a kernel on ``device`` cannot reach
        (another device's memory without peer access, or plain host memory)."""
        if not copy.count or not base:
            return device
        rows = [int(s) for s in slot_ids]
        lo = copy.slot_base + min(rows) * copy.slot_bytes + min(offset)
        end = max(o + z for o, z in zip(offset, size, strict=True))
        hi = copy.slot_base + max(rows) * copy.slot_bytes + end
        found = self.memory_of(lo, hi)
        if found is None:
            if self._is_pinned_range(lo, hi):
                return -1
            raise FakeDeviceError(f"a block copy's slot rows at {lo:#x} are in no device's memory")
        if found != device and not (device == self._index and found in self._peers):
            raise FakeDeviceError(
                f"a block copy on device {device} reaches slot rows in device {found}'s memory "
                "without peer access"
            )
        return found

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Release hung operations and stop every stream thread. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            streams = list(self._streams)
        self._release.set()
        for s in streams:
            s.stop()
        for s in streams:
            s.join()
