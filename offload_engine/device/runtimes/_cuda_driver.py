"""The CUDA driver's entry points as :class:`~offload_engine.device.runtimes.cuda.CudaRuntime`
calls them: resolved once per runtime (:class:`Driver`), with the ctypes types of
the batched copy's ABIs, and the NVRTC block-copy kernel, compiled once per
process and device."""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from offload_engine.device.runtimes._cuda_copy import DriverBlockCopy
from offload_engine.errors import RuntimeUnavailableError

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CU_STREAM_NON_BLOCKING = 0x1


class MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    )


_P = ctypes.c_void_p
_Z = ctypes.c_size_t
CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE = 1, 2


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D, for cuMemcpy2DAsync_v2."""

    _fields_ = (
        ("srcXInBytes", _Z),
        ("srcY", _Z),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", _P),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", _P),
        ("srcPitch", _Z),
        ("dstXInBytes", _Z),
        ("dstY", _Z),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", _P),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", _P),
        ("dstPitch", _Z),
        ("WidthInBytes", _Z),
        ("Height", _Z),
    )


_BATCH_V13 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _Z, _P, _P, _Z, _P)
_BATCH_V12 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _Z, _P, _P, _Z, _P, _P)
# the same calls holding the GIL: for a handful of descriptors the driver returns in
# a few microseconds, and releasing the GIL would hand it to another thread and
# wait to win it back (up to the 5 ms switch interval behind a busy thread)
_BATCH_V13_HOLD = ctypes.PYFUNCTYPE(ctypes.c_int, _P, _P, _P, _Z, _P, _P, _Z, _P)
_BATCH_V12_HOLD = ctypes.PYFUNCTYPE(ctypes.c_int, _P, _P, _P, _Z, _P, _P, _Z, _P, _P)
_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, _Z, _P)
#: descriptors per batched driver call (see memcpy_batch)
CALL_DESCRIPTORS = 256


class Driver:
    """Driver entry points, resolved once."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.batch_hold: Any = None
        self.batch_has_fail_idx = False
        self.memcpy: Any = None
        self.error_name: Callable[[int], str] = lambda rc: f"CUresult {rc}"
        self.notes: list[str] = []
        # microsecond calls, made holding the GIL (PyDLL): event record and wait, and
        # the upload of a job's block ids
        held = ctypes.PyDLL("libcuda.so.1")
        self.event_record = held.cuEventRecord
        self.event_record.argtypes = (_P, _P)
        self.stream_wait_event = held.cuStreamWaitEvent
        self.stream_wait_event.argtypes = (_P, _P, ctypes.c_uint)
        self.memcpy_htod = held.cuMemcpyHtoDAsync_v2
        self.memcpy_htod.argtypes = (ctypes.c_uint64, _P, _Z, _P)
        self.event_query = held.cuEventQuery
        self.event_query.argtypes = (_P,)
        plain = ctypes.CDLL("libcuda.so.1")
        # a 2D copy of many rows takes the driver tens of microseconds: released
        self.memcpy2d = plain.cuMemcpy2DAsync_v2
        self.memcpy2d.argtypes = (_P, _P)
        # a handler's own streams (see CudaRuntime.new_stream), made and destroyed once
        self.stream_create = plain.cuStreamCreateWithPriority
        self.stream_create.argtypes = (ctypes.POINTER(_P), ctypes.c_uint, ctypes.c_int)
        self.stream_synchronize = plain.cuStreamSynchronize
        self.stream_synchronize.argtypes = (_P,)
        self.stream_destroy = plain.cuStreamDestroy_v2
        self.stream_destroy.argtypes = (_P,)
        # peer access, enabled once per pair of devices (enable_peer_access)
        self.ctx_get_current = plain.cuCtxGetCurrent
        self.ctx_get_current.argtypes = (ctypes.POINTER(_P),)
        self.ctx_enable_peer_access = plain.cuCtxEnablePeerAccess
        self.ctx_enable_peer_access.argtypes = (_P, ctypes.c_uint)
        self.batch_address = 0  # the batched copy's entry point, for the native launch
        try:
            from cuda.bindings import driver as drv
        except ImportError:
            self.notes.append("cuda-python is not installed: copies go one cuMemcpyAsync each")
            lib = ctypes.CDLL("libcuda.so.1")
            self.memcpy = _MEMCPY(("cuMemcpyAsync", lib))
            return
        self._resolve(drv)

    def _resolve(self, drv: Any) -> None:
        """The error names, ``cuMemcpyAsync`` and the batched copy for the driver's
        ABI, through cuda-python's ``cuGetProcAddress``."""

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
                self.batch_address = ptr
                self.batch = _BATCH_V13(ptr)
                self.batch_hold = _BATCH_V13_HOLD(ptr)
        elif int(version) >= 12080:
            ptr = resolve(b"cuMemcpyBatchAsync", 12080)
            if ptr is not None:
                self.batch_address = ptr
                self.batch = _BATCH_V12(ptr)
                self.batch_hold = _BATCH_V12_HOLD(ptr)
                self.batch_has_fail_idx = True
        if self.batch is None:
            self.notes.append(
                f"driver {version} has no cuMemcpyBatchAsync: copies go one cuMemcpyAsync each"
            )


_PEERS: set[tuple[int, int]] = set()
_PEERS_LOCK = threading.Lock()


def enable_peer_access(driver: Any, own: int, peer: int) -> None:
    """Let device ``own``'s primary context reach device ``peer``'s memory
    (``cuCtxEnablePeerAccess``), once per pair and process: torch enables it for its
    own device-to-device copies only, not for a kernel handed raw pointers. Access
    enabled already (by torch, say) counts as done. ``driver``: a :class:`Driver`."""
    with _PEERS_LOCK:
        if (own, peer) in _PEERS:
            return
        context = ctypes.c_void_p()
        with torch.cuda.device(peer):  # the peer's primary context, current
            rc = driver.ctx_get_current(ctypes.byref(context))
        if rc or not context.value:
            what = driver.error_name(rc) if rc else "no context"
            raise RuntimeUnavailableError(f"device {peer}'s primary context: {what}")
        with torch.cuda.device(own):
            rc = driver.ctx_enable_peer_access(context, 0)
        if rc not in (0, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            raise RuntimeUnavailableError(
                f"cuCtxEnablePeerAccess from device {own} to device {peer} failed: "
                f"{driver.error_name(rc)}"
            )
        _PEERS.add((own, peer))


def address_of(fn: Any) -> int:
    """A ctypes function pointer's address."""
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


_DIRECT: dict[int, DriverBlockCopy | None] = {}
_DIRECT_LOCK = threading.Lock()


def direct_copy(index: int, notes: list[str]) -> DriverBlockCopy | None:
    """The NVRTC block-copy kernel for device ``index``, compiled once per process."""
    with _DIRECT_LOCK:
        if index not in _DIRECT:
            try:
                with warnings.catch_warnings(record=True) as seen, torch.cuda.device(index):
                    warnings.simplefilter("always")
                    _DIRECT[index] = DriverBlockCopy()
            except Exception as exc:  # noqa: BLE001 - the Triton kernel remains
                _DIRECT[index] = None
                _DIRECT_NOTES[index] = f"NVRTC block copy unavailable ({exc}): Triton launches it"
            else:
                if seen:
                    _DIRECT_NOTES[index] = f"NVRTC compile warned: {seen[0].message}"
        note = _DIRECT_NOTES.get(index)
        if note is not None:
            notes.append(note)
        return _DIRECT[index]


_DIRECT_NOTES: dict[int, str] = {}
