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

Host memory is pinned by registering a plain allocation (``cudaHostRegister``,
portable and mapped, in chunks of at most 64 GiB) rather than with
``pin_memory=True``, whose allocator rounds sizes up to a power of two.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from offload_engine.errors import RuntimeUnavailableError, TransferError
from offload_engine.runtimes.base import (
    I64,
    MAX_PIN_CHUNK_BYTES,
    U64,
    BlockCopy,
    DeviceRuntime,
    TorchStyleEvents,
    pin_chunks,
    torch_block_copy,
)
from offload_engine.vocabulary import Direction, Medium

_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_LOCATION_TYPE_HOST = 2
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


_P = ctypes.c_void_p
_Z = ctypes.c_size_t
_BATCH_V13 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _Z, _P, _P, _Z, _P)
_BATCH_V12 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _Z, _P, _P, _Z, _P, _P)
_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, _Z, _P)


class _Driver:
    """Driver entry points, resolved once."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.batch_has_fail_idx = False
        self.memcpy: Any = None
        self.error_name: Callable[[int], str] = lambda rc: f"CUresult {rc}"
        self.notes: list[str] = []
        try:
            from cuda.bindings import driver as drv
        except ImportError:
            self.notes.append("cuda-python is not installed: copies go one cuMemcpyAsync each")
            lib = ctypes.CDLL("libcuda.so.1")
            self.memcpy = _MEMCPY(("cuMemcpyAsync", lib))
            return

        def name(rc: int) -> str:
            err, text = drv.cuGetErrorName(drv.CUresult(rc))
            return text.decode() if err == 0 and text else f"CUresult {rc}"

        self.error_name = name
        err, version = drv.cuDriverGetVersion()
        if int(err) != 0:
            raise RuntimeUnavailableError(f"cuDriverGetVersion failed: {name(int(err))}")
        flags = 0  # CU_GET_PROC_ADDRESS_DEFAULT

        def resolve(symbol: bytes, ver: int) -> int | None:
            rc, ptr, status = drv.cuGetProcAddress(symbol, ver, flags)
            ok = int(rc) == 0 and int(status) == 0 and ptr
            return int(ptr) if ok else None

        mem = resolve(b"cuMemcpyAsync", min(int(version), 13000))
        if mem is None:
            raise RuntimeUnavailableError("the CUDA driver has no cuMemcpyAsync entry point")
        self.memcpy = _MEMCPY(mem)
        if int(version) >= 13000:
            ptr = resolve(b"cuMemcpyBatchAsync", 13000)
            if ptr is not None:
                self.batch = _BATCH_V13(ptr)
        elif int(version) >= 12080:
            ptr = resolve(b"cuMemcpyBatchAsync", 12080)
            if ptr is not None:
                self.batch = _BATCH_V12(ptr)
                self.batch_has_fail_idx = True
        if self.batch is None:
            self.notes.append(
                f"driver {version} has no cuMemcpyBatchAsync: copies go one cuMemcpyAsync each"
            )


class CudaRuntime(TorchStyleEvents, DeviceRuntime):
    """One CUDA device through torch.cuda and the driver."""

    name = "cuda"
    medium = Medium.GPU

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        *,
        max_batch: int = 4096,
        batched: bool = True,
        use_triton: bool = True,
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
        self.max_batch = max_batch
        self._driver = _Driver()
        self.batched = batched and self._driver.batch is not None
        self._kernel: Callable[[BlockCopy], None] | None = None
        if use_triton:
            try:
                from offload_engine.runtimes._triton_copy import launch_block_copy
            except ImportError as exc:
                self._driver.notes.append(f"triton unavailable ({exc}): block copies use torch ops")
            else:
                self._kernel = launch_block_copy
        self._local = threading.local()
        self._attrs: dict[Direction, _MemcpyAttributes] = {}
        index = self.device.index or 0
        for kind in (Direction.STORE, Direction.LOAD):
            dev = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, index)
            host = _MemLocation(_CU_MEM_LOCATION_TYPE_HOST, 0)
            src, dst = (dev, host) if kind is Direction.STORE else (host, dev)
            self._attrs[kind] = _MemcpyAttributes(_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, src, dst, 0)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail_idx = ctypes.c_size_t(0)

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
        return torch.cuda.Stream(device=self.device, priority=priority)  # type: ignore[no-untyped-call]

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

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
            rc = cudart.cudaHostRegister(base + offset, size, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
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

    # ------------------------------------------------------------ copies

    def memcpy_batch(self, stream: Any, dst: U64, src: U64, sizes: U64, kind: Direction) -> int:
        self._bind_thread()
        n = int(sizes.shape[0])
        if n == 0:
            return 0
        handle = ctypes.c_void_p(stream.cuda_stream)
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        driver = self._driver
        if not self.batched or not stream.cuda_stream:  # the legacy default stream refuses batches
            copy = driver.memcpy
            for d, s, z in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
                rc = copy(d, s, z, handle)
                if rc:
                    raise TransferError(f"cuMemcpyAsync failed: {driver.error_name(rc)}")
            return n
        attrs = ctypes.addressof(self._attrs[kind])
        idx = ctypes.addressof(self._attr_idx)
        calls = 0
        for lo in range(0, n, self.max_batch):
            hi = min(lo + self.max_batch, n)
            args = (
                dst.ctypes.data + 8 * lo,
                src.ctypes.data + 8 * lo,
                sizes.ctypes.data + 8 * lo,
                hi - lo,
                attrs,
                idx,
                1,
            )
            if driver.batch_has_fail_idx:
                rc = driver.batch(*args, ctypes.addressof(self._fail_idx), handle)
            else:
                rc = driver.batch(*args, handle)
            if rc:
                raise TransferError(f"cuMemcpyBatchAsync failed: {driver.error_name(rc)}")
            calls += 1
        return calls

    @property
    def supports_kernel_strategy(self) -> bool:
        return self._kernel is not None

    @property
    def block_copy_alignment(self) -> int:  # type: ignore[override]
        return 8 if self._kernel is not None else 1

    def copy_blocks(self, stream: Any, copy: BlockCopy) -> None:
        with torch.cuda.stream(stream):
            if self._kernel is not None:
                self._kernel(copy)
            else:
                torch_block_copy(copy)
