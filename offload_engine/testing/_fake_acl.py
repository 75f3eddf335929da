"""The fake Ascend's streams, events and ``libascendcl``, over a device that the
:class:`AscendDevice` protocol describes (:class:`~offload_engine.testing.FakeAscend`
is the one the kit has). See :mod:`offload_engine.testing._fake_npu` for the
whole fake and what it checks.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from offload_engine.device.runtimes.npu import (
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    ACL_HOST_REG_PINNED,
    ACL_MAX_BATCH,
    ACL_MEM_LOCATION_TYPE_DEVICE,
    ACL_MEM_LOCATION_TYPE_HOST,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    HOST_PAGE_BYTES,
    HOST_REGISTER_V2,
    HOST_UNREGISTER,
    MEMCPY_ASYNC,
    MEMCPY_BATCH_ASYNC,
    SIZE_MAX,
    AclMemcpyBatchAttr,
)
from offload_engine.testing._fake_runtime import FakeEvent, SerialStream

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_CONTEXT_NULL = 107002

_RECENT_ADDRESS = ctypes.CFUNCTYPE(ctypes.c_void_p)  # aclGetRecentErrMsg's ABI: returns a pointer


class AscendDevice(Protocol):
    """What the streams, events and ACL surface use of the simulated machine."""

    device_count: int
    local: threading.local

    def stream_for(self, handle: int | None) -> FakeNpuStream | None: ...
    def current_stream(self) -> FakeNpuStream: ...
    def submit(self, stream: FakeNpuStream, op: Callable[[], None]) -> None: ...
    def flush(self) -> None: ...
    def is_device_range(self, start: int, end: int) -> bool: ...
    def add_registration(self, address: int, size: int) -> bool: ...
    def remove_registration(self, address: int) -> bool: ...
    def is_registered_range(self, start: int, end: int) -> bool: ...


class FakeNpuError(RuntimeError):
    """A device failure of the fake (torch_npu reports them as RuntimeError)."""


# --------------------------------------------------------------------------- streams


class FakeNpuStream(SerialStream):
    """``torch.npu.Stream``: one thread running its work in order."""

    def __init__(self, ascend: AscendDevice, handle: int, device: int) -> None:
        self._ascend = ascend
        self.handle = handle
        self.device_index = device
        super().__init__(f"offload-engine-fake-npu-stream-{handle}")

    @property
    def npu_stream(self) -> int:
        """The ``aclrtStream`` handle; like torch_npu, reading it empties the task queue."""
        self._ascend.flush()
        return self.handle

    @property
    def device(self) -> str:
        return f"npu:{self.device_index}"

    def run(self, op: Callable[[], None]) -> None:
        """Put ``op`` on the stream directly (what a launched task or an ACL call does)."""
        self.enqueue(op)

    def drain(self) -> None:
        """Block until everything put on the stream so far has run."""
        done = threading.Event()
        self.run(done.set)
        done.wait()

    def wait_event(self, event: FakeNpuEvent) -> None:
        generation = event.recorded
        if generation:
            self._ascend.submit(self, lambda: event.wait_for(generation))

    def record_event(self, event: FakeNpuEvent | None = None) -> FakeNpuEvent:
        event = event if event is not None else FakeNpuEvent(self._ascend)
        event.record(self)
        return event

    def query(self) -> bool:
        self._ascend.flush()
        return bool(self._ops.empty())

    def synchronize(self) -> None:
        self._ascend.flush()
        self.drain()

    def __repr__(self) -> str:
        return f"<FakeNpuStream {self.handle} npu:{self.device_index}>"


class FakeNpuEvent(FakeEvent):
    """``torch.npu.Event``: counts records and completions (the fake runtime's event
    bookkeeping); a failed op poisons the next record on its stream."""

    def __init__(
        self,
        ascend: AscendDevice,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
    ) -> None:
        super().__init__(threading.Lock())
        self._ascend = ascend

    def record(self, stream: FakeNpuStream | None = None) -> None:
        stream = stream if stream is not None else self._ascend.current_stream()
        with self._cond:
            self.recorded += 1
            generation = self.recorded
        self._ascend.submit(stream, lambda: self.complete(generation, stream.take_error()))

    def wait(self, stream: FakeNpuStream | None = None) -> None:
        (stream if stream is not None else self._ascend.current_stream()).wait_event(self)

    def query(self) -> bool:
        self._ascend.flush()
        return self.reached(FakeNpuError, "NPU work")

    def synchronize(self) -> None:
        self._ascend.flush()
        with self._cond:
            target = self.recorded
            self._cond.wait_for(lambda: self.completed >= target)
            error = self.errors.get(target)
        if error is not None:
            raise FakeNpuError(f"NPU work before this event failed: {error}") from error


# --------------------------------------------------------------------------- libascendcl


@dataclass(frozen=True)
class AclBatchCall:
    """One aclrtMemcpyBatchAsync call as the library saw it."""

    stream: int
    count: int
    dsts: tuple[int, ...]
    dest_maxs: tuple[int, ...]
    srcs: tuple[int, ...]
    sizes: tuple[int, ...]
    attrs: tuple[tuple[int, int, int, int], ...]  # (dst type, dst id, src type, src id)
    attrs_indexes: tuple[int, ...]
    thread: str


@dataclass(frozen=True)
class AclCopyCall:
    """One aclrtMemcpyAsync call."""

    stream: int
    dst: int
    dest_max: int
    src: int
    count: int
    kind: int


class FakeAscendCL:
    """``libascendcl`` entry points as ctypes function pointers (ACL's C signatures)."""

    def __init__(
        self,
        ascend: AscendDevice,
        *,
        batch: bool = True,
        register: bool = True,
        max_batch: int = ACL_MAX_BATCH,
    ) -> None:
        self._ascend = ascend
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self.batch_calls: list[AclBatchCall] = []
        self.copy_calls: list[AclCopyCall] = []
        self.register_calls: list[tuple[int, int, int]] = []  # (address, size, flag)
        self.unregister_calls: list[int] = []
        self._recent = b""
        self._fail_batch: list[tuple[int, int] | None] = []  # (rc, failIndex) per next call
        self._fail_register: list[int] = []  # rc for the next registrations
        self._fail_unregister: list[int] = []
        self._fail_copy: BaseException | None = None
        self._hang_copy = False
        self._release = threading.Event()
        #: aclrtMemcpyBatchAsync answers ACL_ERROR_RT_FEATURE_NOT_SUPPORT (a product without it)
        self.batch_unsupported = False
        self.aclrtMemcpyAsync = MEMCPY_ASYNC(self._memcpy_async)
        self.aclrtHostUnregister = HOST_UNREGISTER(self._unregister)
        # a callback cannot hand out a char* it owns, so this one returns the address of
        # a buffer it keeps; the runtime reads it through its own const char* prototype
        self._recent_buffer = ctypes.create_string_buffer(1024)
        self.aclGetRecentErrMsg = _RECENT_ADDRESS(self._recent_msg)
        if batch:
            self.aclrtMemcpyBatchAsync = MEMCPY_BATCH_ASYNC(self._batch_async)
        if register:
            self.aclrtHostRegisterV2 = HOST_REGISTER_V2(self._register)

    # ------------------------------------------------------------ faults

    def fail_next_batch(
        self, rc: int = ACL_ERROR_INVALID_PARAM, fail_index: int = SIZE_MAX, *, after: int = 0
    ) -> None:
        """aclrtMemcpyBatchAsync call ``after + 1`` from now returns ``rc`` and writes
        ``fail_index``."""
        with self._lock:
            self._fail_batch.extend([None] * after + [(rc, fail_index)])

    def fail_next_register(self, rc: int = ACL_ERROR_INVALID_PARAM, *, after: int = 0) -> None:
        """Registration call ``after + 1`` from now returns ``rc``."""
        with self._lock:
            self._fail_register.extend([ACL_SUCCESS] * after + [rc])

    def fail_next_unregister(self, rc: int = ACL_ERROR_INVALID_PARAM) -> None:
        with self._lock:
            self._fail_unregister.append(rc)

    def fail_next_copy(self, error: BaseException | None = None) -> None:
        """The next accepted copy call fails on its stream (seen at the next event)."""
        with self._lock:
            self._fail_copy = error or FakeNpuError("injected copy failure")

    def hang_next_copy(self) -> None:
        """The next accepted copy call never finishes until :meth:`release_hangs`."""
        with self._lock:
            self._hang_copy = True

    def release_hangs(self) -> None:
        self._release.set()

    # ------------------------------------------------------------ entry points

    def _refuse(self, rc: int, message: str) -> int:
        with self._lock:
            self._recent = message.encode()
        return rc

    def _recent_msg(self) -> int:
        with self._lock:
            self._recent_buffer.value = self._recent[: len(self._recent_buffer) - 1]
            return ctypes.addressof(self._recent_buffer)

    def _context(self) -> bool:
        return bool(getattr(self._ascend.local, "context", False))

    def _enqueue(self, stream: FakeNpuStream, copies: list[tuple[int, int, int]]) -> None:
        with self._lock:
            error, self._fail_copy = self._fail_copy, None
            hang, self._hang_copy = self._hang_copy, False

        def op() -> None:
            if hang:
                self._release.wait()
                raise FakeNpuError("a hung copy was released")
            if error is not None:
                raise error
            for d, s, z in copies:
                ctypes.memmove(d, s, z)

        stream.run(op)

    def _check(self, address: int, size: int, location: int, device: int) -> str | None:
        if location == ACL_MEM_LOCATION_TYPE_DEVICE:
            if not 0 <= device < self._ascend.device_count:
                return f"no device {device}"
            if not self._ascend.is_device_range(address, address + size):
                return f"{address:#x}+{size} is not device memory"
            return None
        if location == ACL_MEM_LOCATION_TYPE_HOST:
            if not self._ascend.is_registered_range(address, address + size):
                return f"{address:#x}+{size} is not registered host memory"
            return None
        return f"memory location type {location} is not supported here"

    def _batch_refusal(
        self, fail: Any, num: int, arrays: tuple[int | None, ...], num_attrs: int
    ) -> tuple[int, str] | None:
        """What ``aclrtMemcpyBatchAsync`` refuses before it reads a descriptor: the
        error and why, or None."""
        if not self._context():
            return ACL_ERROR_RT_CONTEXT_NULL, "no device set on this thread"
        if self.batch_unsupported:
            return ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "batch copies not supported"
        with self._lock:
            injected = self._fail_batch.pop(0) if self._fail_batch else None
        if injected is not None:
            fail.value = injected[1]
            return injected[0], "injected batch failure"
        if not num or num > self.max_batch:
            return ACL_ERROR_INVALID_PARAM, f"numBatches {num} not in 1..{self.max_batch}"
        if not (all(arrays) and num_attrs):
            return ACL_ERROR_INVALID_PARAM, "a NULL array or no attributes"
        return None

    def _batch_async(
        self,
        dsts: int | None,
        dest_maxs: int | None,
        srcs: int | None,
        sizes: int | None,
        num: int,
        attrs: int | None,
        attrs_indexes: int | None,
        num_attrs: int,
        fail_index: int | None,
        stream: int | None,
    ) -> int:
        if fail_index is None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "failIndex is NULL")
        fail = ctypes.c_size_t.from_address(fail_index)
        fail.value = SIZE_MAX
        arrays = (dsts, dest_maxs, srcs, sizes, attrs, attrs_indexes)
        refused = self._batch_refusal(fail, num, arrays, num_attrs)
        if refused is not None:
            return self._refuse(*refused)
        target = self._ascend.stream_for(stream)
        if target is None:
            return self._refuse(ACL_ERROR_RT_PARAM_INVALID, f"unknown stream {stream}")

        def read(address: int | None, count: int = num) -> list[int]:
            # (every array was checked non-NULL above)
            return [int(v) for v in (ctypes.c_uint64 * count).from_address(address or 0)]

        d, m, s, z = read(dsts), read(dest_maxs), read(srcs), read(sizes)
        index = read(attrs_indexes, num_attrs)
        table = (AclMemcpyBatchAttr * num_attrs).from_address(attrs or 0)
        described = tuple((a.dstLoc.type, a.dstLoc.id, a.srcLoc.type, a.srcLoc.id) for a in table)
        if index[0] != 0 or sorted(index) != index or index[-1] >= num:
            return self._refuse(ACL_ERROR_INVALID_PARAM, f"bad attrsIndexes {index}")
        for i in range(num):
            k = max(j for j in range(num_attrs) if index[j] <= i)
            dst_type, dst_id, src_type, src_id = described[k]
            problem = (
                f"size {z[i]} > destMax {m[i]}"
                if z[i] > m[i]
                else self._check(d[i], z[i], dst_type, dst_id)
                or self._check(s[i], z[i], src_type, src_id)
            )
            if problem is not None:
                fail.value = i
                return self._refuse(ACL_ERROR_INVALID_PARAM, f"copy {i}: {problem}")
        with self._lock:
            self.batch_calls.append(
                AclBatchCall(
                    target.handle,
                    num,
                    tuple(d),
                    tuple(m),
                    tuple(s),
                    tuple(z),
                    described,
                    tuple(index),
                    threading.current_thread().name,
                )
            )
        self._enqueue(target, list(zip(d, s, z, strict=True)))
        return ACL_SUCCESS

    def _memcpy_async(
        self,
        dst: int | None,
        dest_max: int,
        src: int | None,
        count: int,
        kind: int,
        stream: int | None,
    ) -> int:
        if not self._context():
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "no device set on this thread")
        target = self._ascend.stream_for(stream)
        if target is None:
            return self._refuse(ACL_ERROR_RT_PARAM_INVALID, f"unknown stream {stream}")
        d, s = int(dst or 0), int(src or 0)
        if kind == ACL_MEMCPY_DEVICE_TO_HOST:
            locations = (ACL_MEM_LOCATION_TYPE_HOST, ACL_MEM_LOCATION_TYPE_DEVICE)
        elif kind == ACL_MEMCPY_HOST_TO_DEVICE:
            locations = (ACL_MEM_LOCATION_TYPE_DEVICE, ACL_MEM_LOCATION_TYPE_HOST)
        else:
            return self._refuse(ACL_ERROR_INVALID_PARAM, f"kind {kind} is not supported here")
        problem = (
            f"count {count} > destMax {dest_max}"
            if count > dest_max
            else self._check(d, count, locations[0], 0) or self._check(s, count, locations[1], 0)
        )
        if problem is not None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, problem)
        with self._lock:
            self.copy_calls.append(AclCopyCall(target.handle, d, dest_max, s, count, kind))
        self._enqueue(target, [(d, s, count)])
        return ACL_SUCCESS

    def _register(self, ptr: int | None, size: int, flag: int) -> int:
        address = int(ptr or 0)
        if not self._context():
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "no device set on this thread")
        with self._lock:
            self.register_calls.append((address, size, flag))
            injected = self._fail_register.pop(0) if self._fail_register else None
        if injected:
            return self._refuse(injected, "injected registration failure")
        if address % HOST_PAGE_BYTES or not size:
            return self._refuse(ACL_ERROR_INVALID_PARAM, f"{address:#x} is not 4K-aligned")
        if flag != ACL_HOST_REG_PINNED:
            return self._refuse(ACL_ERROR_INVALID_PARAM, f"flag {flag:#x} is not PINNED")
        if not self._ascend.add_registration(address, size):
            return self._refuse(ACL_ERROR_INVALID_PARAM, f"{address:#x}+{size} overlaps")
        return ACL_SUCCESS

    def _unregister(self, ptr: int | None) -> int:
        address = int(ptr or 0)
        if not self._context():
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "no device set on this thread")
        with self._lock:
            self.unregister_calls.append(address)
            injected = self._fail_unregister.pop(0) if self._fail_unregister else None
        if not self._ascend.remove_registration(address):
            return self._refuse(ACL_ERROR_INVALID_PARAM, f"{address:#x} is not registered")
        if injected is not None:
            return self._refuse(injected, "injected unregistration failure")
        return ACL_SUCCESS


# --------------------------------------------------------------------------- the device
