"""CUDA runtime: torch.cuda for streams and events, the driver for batched copies.

Batched copies use the driver's ``cuMemcpyBatchAsync``. Its entry point is
resolved through cuda-python's maintained binding (``cuGetProcAddress``), for
the ABI the driver speaks: CUDA 13 dropped the ``failIdx`` argument, 12.8/12.9
have it. The call itself goes through ``ctypes`` with the numpy descriptor
arrays' buffers: the binding's Python-level wrapper takes lists of
``CUdeviceptr`` objects, building which costs far more CPU per descriptor than
the copy submission itself. Where the batched call is missing (older driver,
no cuda-python) or the stream is the legacy default stream (which the batched
call refuses), copies go one ``cuMemcpyAsync`` per descriptor.

Calls that take a microsecond (event record and wait, an event query, the
upload of a job's block ids, short batched copies) go to the driver through
``ctypes.PyDLL`` and keep the GIL; handing it over and winning it back from a
busy thread costs far more. Batched copies go in calls of at most 256
descriptors, so no single call keeps the driver busy for long.

Device-side block copies run a CUDA C kernel compiled once per process with
NVRTC (``_cuda_copy``) and launched with one ``cuLaunchKernel``; the Triton
kernel (``_triton_copy``) is the fallback where NVRTC is missing.

Host memory is pinned by registering a plain allocation (``cudaHostRegister``,
portable and mapped, in chunks of at most 64 GiB) rather than with
``pin_memory=True``, whose allocator rounds sizes up to a power of two.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from offload_engine._loop import keep_signal_actions
from offload_engine.device.runtimes._cuda_copy import DriverBlockCopy
from offload_engine.device.runtimes._cuda_driver import (
    CALL_DESCRIPTORS,
    CU_MEM_LOCATION_TYPE_DEVICE,
    CU_MEM_LOCATION_TYPE_HOST,
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    CU_MEMORYTYPE_DEVICE,
    CU_MEMORYTYPE_HOST,
    CU_STREAM_NON_BLOCKING,
    CUDA_ERROR_NOT_READY,
    CUDA_HOST_REGISTER_PORTABLE_MAPPED,
    Driver,
    Memcpy2D,
    MemcpyAttributes,
    MemLocation,
    address_of,
    direct_copy,
    enable_peer_access,
)
from offload_engine.device.runtimes._native import (
    HOLD_GIL_DESCRIPTORS,
    OP_BATCH,
    OP_COPY2D,
    OP_HTOD,
    OP_LAUNCH,
    OP_RECORD,
    OP_WAIT,
    LaunchProgram,
)
from offload_engine.device.runtimes.base import (
    I64,
    MAX_PIN_CHUNK_BYTES,
    U64,
    BlockCopy,
    DeviceRuntime,
    IdBuffer,
    TorchStyleEvents,
    pin_chunks,
    torch_block_copy,
)
from offload_engine.device.runtimes.probe import connections_note
from offload_engine.errors import RuntimeUnavailableError, TransferError
from offload_engine.vocabulary import Direction, Medium

log = logging.getLogger("offload_engine.cuda")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def visible_device_index(visible: str | None, device: int) -> int | None:
    """Which of the host's devices is the process's device ``device`` under
    ``CUDA_VISIBLE_DEVICES=visible``: the host's own index where ``visible`` is unset,
    the ``device``-th entry where it lists indices, None where that entry is no index
    (a UUID, a MIG instance) or missing."""
    if visible is None:
        return device
    entries = [e.strip() for e in visible.split(",")]
    if device >= len(entries) or not entries[device].isdigit():
        return None
    return int(entries[device])


class CudaRuntime(TorchStyleEvents, DeviceRuntime):
    """One CUDA device through torch.cuda and the driver."""

    name = "cuda"
    medium = Medium.GPU
    nonblocking_launch = True  # driver calls only enqueue

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        *,
        max_batch: int = 4096,
        batched: bool = True,
        use_triton: bool = True,
        use_nvrtc: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeUnavailableError(
                "CUDA is not available: "
                + (
                    "torch is a CPU-only build"
                    if torch.version.cuda is None
                    else "no device visible"
                )
            )
        if device is None:
            device = torch.cuda.current_device()
        self.device = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        with keep_signal_actions():  # the native code loaded here leaves them as they were
            driver = Driver()
            connections = connections_note()
            if connections is not None:
                driver.notes.append(connections)
                _warn_once(connections)
            kernel: Callable[[BlockCopy], None] | None = None
            if use_triton:
                try:
                    from offload_engine.device.runtimes._triton_copy import launch_block_copy
                except ImportError as exc:
                    driver.notes.append(f"triton unavailable ({exc}): block copies use torch ops")
                else:
                    kernel = launch_block_copy
            # the same copy as a CUDA C kernel launched straight through the driver (a few
            # microseconds instead of Triton's 100+ of Python); Triton stays the fallback
            direct = direct_copy(self.device.index or 0, driver.notes) if use_nvrtc else None
        self._init_calls(driver, kernel, direct, max_batch=max_batch, batched=batched)
        # the calling thread's current stream as a raw handle, without torch.cuda's
        # device-index parsing (the call Triton's launcher makes); None if torch lacks it
        self._current_raw: Callable[[int], int] | None = getattr(
            torch._C, "_cuda_getCurrentRawStream", None
        )

    def _init_calls(
        self,
        driver: Any,
        kernel: Callable[[BlockCopy], None] | None,
        direct: DriverBlockCopy | None,
        *,
        max_batch: int,
        batched: bool,
    ) -> None:
        """Everything the enqueueing calls use: the driver entry points (``driver``: a
        :class:`Driver`, or in tests an object with the same attributes), the block
        copy kernels and the batched copies' attributes."""
        self.max_batch = max_batch
        self._driver = driver
        self.batched = batched and driver.batch is not None
        self._kernel = kernel
        self._direct = direct
        self._local = threading.local()
        self._attrs: dict[Direction, MemcpyAttributes] = {}
        index = self.device.index or 0
        for kind in (Direction.STORE, Direction.LOAD):
            dev = MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, index)
            host = MemLocation(CU_MEM_LOCATION_TYPE_HOST, 0)
            src, dst = (dev, host) if kind is Direction.STORE else (host, dev)
            self._attrs[kind] = MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, src, dst, 0)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail_idx = ctypes.c_size_t(0)
        self._fail_idx_at = ctypes.addressof(self._fail_idx)
        self._attr_addresses = {k: ctypes.addressof(a) for k, a in self._attrs.items()}
        self._index = index
        self._idle: torch.cuda.Stream | None = None
        self._idle_on: dict[int, torch.cuda.Stream] = {}  # the same, per peer device
        self._native_note: str | None = None

    @property
    def notes(self) -> tuple[str, ...]:
        """Why any fast path is not in use."""
        return tuple(self._driver.notes)

    # ------------------------------------------------------------ streams and events

    def _bind_thread(self) -> None:
        # driver calls need the device's primary context current on this thread
        if getattr(self._local, "bound", False):
            return
        torch.cuda.set_device(self.device)
        self._local.bound = True

    def new_stream(self, priority: int = 0) -> torch.cuda.Stream:
        """A stream made by the driver for the caller alone (see :meth:`release_stream`).
        ``torch.cuda.Stream()`` hands out a pool of 32 streams per priority in turn to
        everyone in the process: a pooled stream can be the one a model steps on, and
        copies on it then run in line with the step."""
        return self._create_stream(self.device, priority)

    def _create_stream(self, device: torch.device, priority: int) -> torch.cuda.Stream:
        create = getattr(self._driver, "stream_create", None)
        if create is None:  # a test's stand-in driver
            return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]
        self._bind_thread()
        handle = ctypes.c_void_p()
        with self._on(device):
            rc = create(ctypes.byref(handle), CU_STREAM_NON_BLOCKING, priority)
        if rc:
            raise RuntimeUnavailableError(
                f"cuStreamCreateWithPriority failed: {self._driver.error_name(rc)}"
            )
        return torch.cuda.ExternalStream(handle.value, device=device)  # type: ignore[no-untyped-call]

    def _on(self, device: torch.device) -> AbstractContextManager[Any]:
        """``device`` current for driver calls that act on the current context (no
        switch for this runtime's own device, which :meth:`_bind_thread` made current)."""
        return contextlib.nullcontext() if device == self.device else torch.cuda.device(device)

    def release_stream(self, stream: Any) -> None:
        destroy = getattr(self._driver, "stream_destroy", None)
        if destroy is None or not isinstance(stream, torch.cuda.ExternalStream):
            return
        self._bind_thread()
        handle = stream.cuda_stream
        # nothing should be left on it; waiting makes sure no cached block of torch's
        # allocator last used on it is handed to a new stream with the same handle early
        with self._on(stream.device):
            self._check(self._driver.stream_synchronize(handle), "cuStreamSynchronize")
            self._check(destroy(handle), "cuStreamDestroy")

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        # torch creates the driver event at its first record; record it once on a
        # private idle stream so ``cuda_event`` is valid for the driver calls below
        if self._idle is None:
            self._idle = self.new_stream()
        event.record(self._idle)
        return event

    # ------------------------------------------------------------ peers

    def host_device_index(self, device: int) -> int | None:
        """The index ``CUDA_VISIBLE_DEVICES`` gives ``device`` (unset: the same
        index); None where it names devices otherwise (UUIDs, MIG instances)."""
        return visible_device_index(os.environ.get("CUDA_VISIBLE_DEVICES"), device)

    def peer_devices(self) -> tuple[int, ...]:
        """The devices whose memory this one reaches (``torch.cuda.can_device_access_peer``:
        NVLink or PCIe peer to peer)."""
        own = self._index
        return tuple(
            d
            for d in range(torch.cuda.device_count())
            if d != own and torch.cuda.can_device_access_peer(own, d)
        )

    def _peer(self, device: int) -> torch.device:
        """``device`` as a torch device, or :class:`RuntimeUnavailableError` where it is
        not one of :meth:`peer_devices`."""
        if device not in self.peer_devices():
            raise RuntimeUnavailableError(
                f"CUDA device {self._index} has no peer access to device {device}"
            )
        return torch.device("cuda", device)

    def alloc_device_on(self, device: int, nbytes: int) -> torch.Tensor:
        """Peer ``device``'s memory, which this device's kernels reach once peer access
        is enabled (here, the first time a handler takes memory on that peer)."""
        where = self._peer(device)
        with keep_signal_actions():  # a peer's context may start here
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=where)
            enable_peer_access(self._driver, self._index, device)
        return buffer

    def new_stream_on(self, device: int, priority: int = 0) -> torch.cuda.Stream:
        return self._create_stream(self._peer(device), priority)

    def new_event_on(self, device: int) -> torch.cuda.Event:
        where = self._peer(device)
        idle = self._idle_on.get(device)
        if idle is None:
            idle = self._idle_on[device] = self.new_stream_on(device)
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        with torch.cuda.device(where):  # created on the peer, at its first record
            event.record(idle)
        return event

    # Record and wait go straight to the driver, holding the GIL: torch's
    # Event.record/Stream.wait_event cost 3-5 us of Python each (device guards),
    # the driver call under 1 us. Synchronize stays torch's (it releases the GIL).

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise TransferError(f"{what} failed: {self._driver.error_name(rc)}")

    def record(self, event: Any, stream: Any) -> None:
        self._bind_thread()
        rc = self._driver.event_record(event.cuda_event, stream.cuda_stream)
        self._check(rc, "cuEventRecord")

    def wait_event(self, stream: Any, event: Any) -> None:
        self._bind_thread()
        rc = self._driver.stream_wait_event(stream.cuda_stream, event.cuda_event, 0)
        self._check(rc, "cuStreamWaitEvent")

    def stream_handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def event_handle(self, event: Any) -> int:
        return int(event.cuda_event)

    def synchronize(self, event: Any) -> None:
        # an event already reached (the common case by the time the watcher looks)
        # costs one query holding the GIL; only a pending one sleeps in torch's
        # synchronize, which releases it
        self._bind_thread()
        rc = self._driver.event_query(event.cuda_event)
        if rc == CUDA_ERROR_NOT_READY:
            event.synchronize()
        else:
            self._check(rc, "cuEventQuery")

    def query(self, event: Any) -> bool:
        self._bind_thread()
        rc = self._driver.event_query(event.cuda_event)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True

    def record_current(self, event: Any) -> None:
        self._bind_thread()
        raw = self._current_raw
        if raw is not None:
            handle = raw(self._index)
        else:
            handle = torch.cuda.current_stream(self.device).cuda_stream
        self._check(self._driver.event_record(event.cuda_event, handle), "cuEventRecord")

    # ------------------------------------------------------------ memory

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pin_host(self, tensor: torch.Tensor) -> Callable[[], None]:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("pin_host takes a contiguous CPU tensor")
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        base = tensor.data_ptr()
        total = tensor.numel() * tensor.element_size()
        row = tensor.stride(0) * tensor.element_size() if tensor.dim() > 1 else 1
        registered: list[int] = []

        def release() -> None:
            while registered:
                cudart.cudaHostUnregister(registered.pop())

        for offset, size in pin_chunks(total, row, MAX_PIN_CHUNK_BYTES):
            rc = cudart.cudaHostRegister(base + offset, size, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
            if int(rc) != 0:
                release()
                raise RuntimeUnavailableError(
                    f"cudaHostRegister of {size} bytes at offset {offset} failed: {rc}"
                )
            registered.append(base + offset)
        return release

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.device.type == "cpu" and tensor.is_pinned())

    def upload(self, stream: Any, values: I64) -> torch.Tensor:
        host = torch.from_numpy(np.array(values, dtype=np.int64)).pin_memory()
        with torch.cuda.stream(stream):
            return host.to(self.device, non_blocking=True)

    def new_id_buffer(self, capacity: int) -> IdBuffer:
        host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        device = torch.empty(capacity, dtype=torch.int64, device=self.device)
        # the addresses are read once here, not per upload; the views handed out per
        # upload are kept by length (a torch narrow costs more than the upload's call)
        views: dict[int, torch.Tensor] = {}
        return IdBuffer(
            host.numpy(), device, keep=(host, host.data_ptr(), device.data_ptr(), views)
        )

    def upload_ids(self, stream: Any, buffer: IdBuffer, count: int) -> torch.Tensor:
        # one driver call from the buffer's pinned memory: no allocation, no torch op
        self._bind_thread()
        _, host_at, device_at, _ = buffer.keep
        rc = self._driver.memcpy_htod(device_at, host_at, 8 * count, stream.cuda_stream)
        self._check(rc, "cuMemcpyHtoDAsync")
        return self._id_view(buffer, count)

    @staticmethod
    def _id_view(buffer: IdBuffer, count: int) -> torch.Tensor:
        views = buffer.keep[3]
        view: torch.Tensor | None = views.get(count)
        if view is None:
            view = views[count] = buffer.device.narrow(0, 0, count)
        return view

    # ------------------------------------------------------------ copies

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
        self._bind_thread()
        c = Memcpy2D(WidthInBytes=width, Height=height, dstPitch=pitches[0], srcPitch=pitches[1])
        device, host = (src, dst) if kind is Direction.STORE else (dst, src)
        if kind is Direction.STORE:
            c.srcMemoryType, c.srcDevice = CU_MEMORYTYPE_DEVICE, device
            c.dstMemoryType, c.dstHost = CU_MEMORYTYPE_HOST, host
        else:
            c.srcMemoryType, c.srcHost = CU_MEMORYTYPE_HOST, host
            c.dstMemoryType, c.dstDevice = CU_MEMORYTYPE_DEVICE, device
        rc = self._driver.memcpy2d(ctypes.byref(c), stream.cuda_stream)
        self._check(rc, "cuMemcpy2DAsync")

    def memcpy_batch(self, stream: Any, dst: U64, src: U64, sizes: U64, kind: Direction) -> int:
        self._bind_thread()
        n = int(sizes.shape[0])
        if n == 0:
            return 0
        handle = ctypes.c_void_p(stream.cuda_stream)
        driver = self._driver
        if not self.batched or not stream.cuda_stream:  # the legacy default stream refuses batches
            dst = np.ascontiguousarray(dst, dtype=np.uint64)
            src = np.ascontiguousarray(src, dtype=np.uint64)
            sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
            copy = driver.memcpy
            for d, s, z in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
                rc = copy(d, s, z, handle)
                if rc:
                    raise TransferError(f"cuMemcpyAsync failed: {driver.error_name(rc)}")
            return n
        attrs = self._attr_addresses[kind]
        idx = ctypes.addressof(self._attr_idx)
        # each call's descriptors are copied into this thread's scratch rows, whose
        # addresses are known: reading an array's address through ``.ctypes`` costs
        # more than copying a few hundred descriptors
        scratch, d_at, s_at, z_at = self._scratch()
        calls = 0
        # calls carry at most CALL_DESCRIPTORS descriptors, so no single call keeps
        # the driver busy for long (about 1 us of CPU per descriptor)
        step = min(self.max_batch, CALL_DESCRIPTORS)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            k = hi - lo
            scratch[0, :k] = dst[lo:hi]
            scratch[1, :k] = src[lo:hi]
            scratch[2, :k] = sizes[lo:hi]
            call = driver.batch_hold if k <= HOLD_GIL_DESCRIPTORS else driver.batch
            if driver.batch_has_fail_idx:
                rc = call(d_at, s_at, z_at, k, attrs, idx, 1, self._fail_idx_at, handle)
            else:
                rc = call(d_at, s_at, z_at, k, attrs, idx, 1, handle)
            if rc:
                raise TransferError(f"cuMemcpyBatchAsync failed: {driver.error_name(rc)}")
            calls += 1
        return calls

    def _scratch(self) -> tuple[Any, int, int, int]:
        """This thread's descriptor rows (dst, src, sizes) and their addresses."""
        found = getattr(self._local, "scratch", None)
        if found is None:
            rows = np.empty((3, CALL_DESCRIPTORS), dtype=np.uint64)
            at = rows.ctypes.data
            step = 8 * CALL_DESCRIPTORS
            found = self._local.scratch = (rows, at, at + step, at + 2 * step)
        return found  # type: ignore[no-any-return]

    @property
    def supports_kernel_strategy(self) -> bool:
        return self._kernel is not None or self._direct is not None

    @property
    def block_copy_alignment(self) -> int:  # type: ignore[override]
        return 8 if self.supports_kernel_strategy else 1

    def launcher_context(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def copy_blocks(self, stream: Any, copy: BlockCopy) -> None:
        if self._direct is not None:
            self._bind_thread()
            self._check(self._direct(copy, stream.cuda_stream), "cuLaunchKernel")
            return
        raw = self._current_raw
        if self._kernel is not None and raw is not None and raw(self._index) == stream.cuda_stream:
            self._kernel(copy)  # already current (a handler's launcher thread): no switch
            return
        with torch.cuda.stream(stream):
            if self._kernel is not None:
                self._kernel(copy)
            else:
                torch_block_copy(copy)

    # ------------------------------------------------------------ native launch

    def native_program(self) -> LaunchProgram:
        if self._direct is None:
            raise RuntimeUnavailableError(
                "the native launch needs the NVRTC block-copy kernel (the Triton one is "
                "launched from Python)"
            )
        if self.batched and not self._driver.batch_address:
            raise RuntimeUnavailableError("the batched copy's entry point is unknown")
        d = self._driver
        entries = (
            address_of(d.event_record),
            address_of(d.stream_wait_event),
            d.batch_address,
            address_of(d.memcpy),
            self._direct.launch_address,
            address_of(d.memcpy_htod),
            address_of(d.memcpy2d),
        )
        try:
            return _CudaProgram(
                entries,
                d.error_name,
                batch_attrs=self._attr_addresses if self.batched else None,
                batch_variant=12 if d.batch_has_fail_idx else 13,
                batch_step=min(self.max_batch, CALL_DESCRIPTORS),
                kernel=self._direct,
                id_view=self._id_view,
                bind_thread=self._bind_thread,
            )
        except OSError as exc:
            if self._native_note is None:  # noted once: every handler asks
                self._native_note = f"native launch unavailable ({exc}): launches call from Python"
                self._driver.notes.append(self._native_note)
            raise RuntimeUnavailableError(str(exc)) from None


class _CudaProgram(LaunchProgram):
    """The calls a handler makes on :class:`CudaRuntime` while launching a job,
    recorded as the same driver calls and issued in one native call. The runtime
    hands it what those calls need: the batched copies' attributes per direction
    (``None``: no batched copy, one cuMemcpyAsync per descriptor), the batched
    call's ABI (12: with failIdx, 13: without) and descriptors per call, the
    block-copy kernel, the id buffer's device views and the call that binds the
    device's context to a thread."""

    # oe_staged_build fills in the words of batch_row and launch_row that _native.py
    # names (BATCH_* and LAUNCH_*)

    def __init__(
        self,
        entries: tuple[int, ...],
        error_name: Callable[[int], str],
        *,
        batch_attrs: dict[Direction, int] | None,
        batch_variant: int,
        batch_step: int,
        kernel: DriverBlockCopy,
        id_view: Callable[[IdBuffer, int], torch.Tensor],
        bind_thread: Callable[[], None],
    ) -> None:
        super().__init__(entries, error_name)
        self._attrs = batch_attrs
        self._variant = batch_variant
        self._step = batch_step
        self._kernel = kernel
        self._id_view = id_view
        self._bind_thread = bind_thread

    def record(self, event: Any, stream: Any) -> None:
        self.op(OP_RECORD, event.cuda_event, stream.cuda_stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        self.op(OP_WAIT, stream.cuda_stream, event.cuda_event)

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
        to_host = int(kind is Direction.STORE)
        self.op(OP_COPY2D, stream.cuda_stream, dst, src, width, height, *pitches, to_host)
        self._rows2d += height

    def memcpy_batch(self, stream: Any, dst: U64, src: U64, sizes: U64, kind: Direction) -> int:
        return self.batch(stream, *self.descriptors(dst, src, sizes), int(sizes.shape[0]), kind)

    def batch(self, stream: Any, d: int, s: int, z: int, n: int, kind: Direction) -> int:
        if n == 0:
            return 0
        handle = stream.cuda_stream
        if self._attrs is None or not handle:  # as CudaRuntime.memcpy_batch: one call each
            self.op(OP_BATCH, handle, d, s, z, n, 1, 0, 0)
            return n
        step = self._step
        self.op(OP_BATCH, handle, d, s, z, n, step, self._attrs[kind], self._variant)
        return -(-n // step)

    # -- the staged planner's templates and addresses (offload_engine.device.staged_native)

    def batch_row(self, kind: Direction) -> Any:
        """A batched copy op's words (:meth:`memcpy_batch`'s op) with its stream,
        descriptor offsets and count left at 0: a job's pieces fill them in (on
        handler streams, never the legacy default stream)."""
        if self._attrs is None:
            return np.array([OP_BATCH, 0, 0, 0, 0, 0, 1, 0, 0], dtype=np.int64)
        attrs = self._attrs[kind]
        return np.array([OP_BATCH, 0, 0, 0, 0, 0, self._step, attrs, self._variant], np.int64)

    def launch_row(self, template: BlockCopy, stream: Any) -> Any:
        """``template``'s launch op (:meth:`copy_blocks`'s) on ``stream``, whose block
        count, cache id address and slot base a job's pieces fill in (slot ids: none)."""
        args = self._kernel.launch_args(template)
        if args is None:  # pragma: no cover - a template copies blocks
            raise ValueError("the template copies no blocks")
        func, shape, values = args
        words = [OP_LAUNCH, func, *shape, stream.cuda_stream, len(values), *values]
        return np.array(words, dtype=np.int64)

    def copy_blocks(self, stream: Any, copy: BlockCopy) -> None:
        args = self._kernel.launch_args(copy)
        if args is not None:
            func, shape, values = args
            self.op(OP_LAUNCH, func, *shape, stream.cuda_stream, len(values), *values)

    def upload_ids(self, stream: Any, buffer: IdBuffer, count: int) -> torch.Tensor:
        self.upload_ids_at(stream, buffer, count)
        return self._id_view(buffer, count)

    def upload_ids_at(self, stream: Any, buffer: IdBuffer, count: int) -> int:
        """:meth:`upload_ids`'s op; the ids' device address."""
        _, host_at, device_at, _ = buffer.keep
        self.op(OP_HTOD, device_at, host_at, 8 * count, stream.cuda_stream)
        return int(device_at)

    @staticmethod
    def host_ids_at(buffer: IdBuffer) -> int:
        """The address of the id buffer's host memory."""
        return int(buffer.keep[1])

    def run(self) -> None:
        self._bind_thread()  # the calls need the device's context on this thread
        super().run()
