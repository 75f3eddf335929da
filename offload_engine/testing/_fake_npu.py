"""A simulated Ascend device, so the NPU runtime
(:class:`~offload_engine.device.runtimes.npu.NpuRuntime`) runs on CPU.

:class:`FakeAscend` offers what the NPU runtime uses of torch_npu and of CANN:

* ``ascend.npu``: the ``torch.npu`` surface (``Stream``, ``Event`` with
  ``record/query/synchronize/wait``, ``current_stream``, the ``stream``
  context, ``set_device``/``current_device``/``device_count``/``is_available``).
  Each stream is a thread that runs its work in order. Like torch_npu with its
  task queue on, event records, event waits and compute work issued through
  this surface are **held in a task queue** and reach their streams only when
  something empties it: reading ``stream.npu_stream`` (as torch_npu's getter
  does), a ``synchronize``/``query``, or entering a stream context. A direct
  ACL call on a stream handle read earlier would overtake them, as it would
  on the device.
* ``ascend.acl``: ``libascendcl`` as ctypes function pointers with ACL's
  signatures (``aclrtMemcpyBatchAsync``, ``aclrtMemcpyAsync``,
  ``aclrtHostRegisterV2``, ``aclrtHostUnregister``, ``aclGetRecentErrMsg``).
  They read the descriptor arrays from the raw addresses they are given,
  check them (batch cap, ``destMax``, memory locations against the batch
  attributes, device memory vs registered host memory, the calling thread's
  device context, 4 KiB-aligned registrations), record every call, and copy
  with ``ctypes.memmove`` on the stream's thread, so round trips are bit-exact.
  Any entry point can be left out (an older CANN), and faults can be injected.

"Device memory" is host memory handed out by :meth:`FakeAscend.empty`. CPU
torch has no ``npu`` device type, so :class:`FakeNpuRuntime` replaces exactly
the NPU runtime's memory-placement methods (``_device_for``,
``is_device_tensor``, ``alloc_device``, ``upload``); streams, events, the
stream context, pinning, batched copies and block copies run the real
:class:`~offload_engine.device.runtimes.npu.NpuRuntime` code.

Torch work inside a stream context runs at once on the calling thread, so the
context first empties the task queue and waits for the stream to go idle: the
work then takes its place in the stream's order (at the cost of blocking the
caller, which the device would not do).
"""

from __future__ import annotations

import importlib.machinery
import itertools
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from offload_engine.device.runtimes.base import I64, MAX_PIN_CHUNK_BYTES, spans_cover
from offload_engine.device.runtimes.npu import (
    ACL_MAX_BATCH,
    NpuRuntime,
)
from offload_engine.testing._fake_acl import (
    FakeAscendCL,
    FakeNpuError,
    FakeNpuEvent,
    FakeNpuStream,
)
from offload_engine.testing._fake_runtime import FakeDeviceMemory


class FakeTorchNpu:
    """The ``torch.npu`` module surface the NPU runtime uses."""

    def __init__(self, ascend: FakeAscend) -> None:
        self._ascend = ascend

    def is_available(self) -> bool:
        return self._ascend.device_count > 0

    def device_count(self) -> int:
        return self._ascend.device_count

    def current_device(self) -> int:
        return int(getattr(self._ascend.local, "device", 0))

    def set_device(self, device: int) -> None:
        if not 0 <= int(device) < self._ascend.device_count:
            raise FakeNpuError(f"invalid device {device}")
        self._ascend.local.device = int(device)
        self._ascend.local.context = True

    def Stream(self, device: int | None = None, priority: int = 0) -> FakeNpuStream:
        return self._ascend.new_stream(self.current_device() if device is None else int(device))

    def Event(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> FakeNpuEvent:
        return FakeNpuEvent(self._ascend, enable_timing, blocking, interprocess)

    def current_stream(self, device: int | None = None) -> FakeNpuStream:
        return self._ascend.current_stream()

    def default_stream(self, device: int | None = None) -> FakeNpuStream:
        return self._ascend.default_stream

    @contextmanager
    def stream(self, stream: FakeNpuStream | None) -> Iterator[FakeNpuStream | None]:
        if stream is None:
            yield None
            return
        self._ascend.flush()
        stream.drain()  # torch work below then runs in the stream's order
        local = self._ascend.local
        previous = getattr(local, "stream", None)
        local.stream = stream
        try:
            yield stream
        finally:
            local.stream = previous

    def synchronize(self, device: int | None = None) -> None:
        self._ascend.flush()
        for s in self._ascend.streams():
            s.drain()


def fake_torch_npu_module(ascend: FakeAscend) -> types.ModuleType:
    """A module to put in ``sys.modules["torch_npu"]``: ``torch_npu.npu`` is ``ascend.npu``."""
    module = types.ModuleType("torch_npu")
    module.npu = ascend.npu  # type: ignore[attr-defined]
    module.__version__ = "2.13.0.fake"  # type: ignore[attr-defined]
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    return module


class FakeAscend:
    """One simulated machine: NPU streams, torch_npu's task queue, device memory, host
    registrations, and the ``torch.npu`` (:attr:`npu`) and ``libascendcl`` (:attr:`acl`)
    surfaces over them. ``close()`` stops every stream thread."""

    _handles = itertools.count(0x1000)

    def __init__(
        self,
        *,
        device_count: int = 1,
        task_queue: bool = True,
        batch: bool = True,
        register: bool = True,
        max_batch: int = ACL_MAX_BATCH,
    ) -> None:
        self.device_count = device_count
        self.task_queue = task_queue
        self.local = threading.local()
        self._lock = threading.Lock()
        self._streams: dict[int, FakeNpuStream] = {}
        self._pending: list[tuple[FakeNpuStream, Callable[[], None]]] = []
        self.device_memory = FakeDeviceMemory()
        self._registered: dict[int, int] = {}
        self.closed = False
        self.npu = FakeTorchNpu(self)
        self.acl = FakeAscendCL(self, batch=batch, register=register, max_batch=max_batch)
        self.default_stream = self.new_stream(0)

    # ------------------------------------------------------------ streams

    def new_stream(self, device: int) -> FakeNpuStream:
        with self._lock:
            if self.closed:
                raise FakeNpuError("the fake Ascend device is closed")
            stream = FakeNpuStream(self, next(self._handles), device)
            self._streams[stream.handle] = stream
        return stream

    def streams(self) -> list[FakeNpuStream]:
        with self._lock:
            return list(self._streams.values())

    def stream_for(self, handle: int | None) -> FakeNpuStream | None:
        if not handle:
            return self.default_stream  # ACL's NULL stream is the default stream
        with self._lock:
            return self._streams.get(int(handle))

    def current_stream(self) -> FakeNpuStream:
        stream: FakeNpuStream | None = getattr(self.local, "stream", None)
        return stream if stream is not None else self.default_stream

    def submit(self, stream: FakeNpuStream, op: Callable[[], None]) -> None:
        """Issue ``op`` on ``stream`` through the task queue (launched at the next flush)."""
        with self._lock:
            if self.task_queue:
                self._pending.append((stream, op))
                return
        stream.run(op)

    def flush(self) -> None:
        """Launch everything in the task queue, in issue order."""
        with self._lock:
            pending, self._pending = self._pending, []
            for stream, op in pending:
                stream.run(op)

    @property
    def queued(self) -> int:
        """Tasks issued and not launched yet."""
        with self._lock:
            return len(self._pending)

    def compute(self, op: Callable[[], None], stream: FakeNpuStream | None = None) -> None:
        """Issue ``op`` as model work on ``stream`` (the default stream)."""
        self.submit(stream if stream is not None else self.default_stream, op)

    # ------------------------------------------------------------ memory

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A tensor in the fake's device memory."""
        return self.device_memory.empty(shape, dtype)

    def is_device_range(self, start: int, end: int) -> bool:
        return self.device_memory.holds(start, end)

    def add_registration(self, address: int, size: int) -> bool:
        with self._lock:
            for lo, n in self._registered.items():
                if address < lo + n and lo < address + size:
                    return False
            self._registered[address] = size
            return True

    def remove_registration(self, address: int) -> bool:
        with self._lock:
            return self._registered.pop(address, None) is not None

    @property
    def registrations(self) -> dict[int, int]:
        with self._lock:
            return dict(self._registered)

    def is_registered_range(self, start: int, end: int) -> bool:
        with self._lock:
            spans = list(self._registered.items())
        return spans_cover(spans, start, end)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Launch what is queued, release hung copies, stop every stream thread. Idempotent."""
        self.flush()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            streams = list(self._streams.values())
        self.acl.release_hangs()
        for s in streams:
            s.stop()
        for s in streams:
            s.thread.join()


class FakeNpuRuntime(NpuRuntime):
    """:class:`NpuRuntime` on a :class:`FakeAscend`; only memory placement differs.

    ``via_import=True`` takes ``torch.npu`` from ``import torch_npu`` and the library
    from :func:`~offload_engine.device.runtimes.npu.load_ascendcl`, as production does (a
    test puts :func:`fake_torch_npu_module` in ``sys.modules`` and patches the loader).
    The runtime owns (and closes) a FakeAscend it created itself.
    """

    def __init__(
        self,
        ascend: FakeAscend | None = None,
        *,
        via_import: bool = False,
        device: int | None = None,
        max_batch: int = ACL_MAX_BATCH,
        batched: bool = True,
        pin_chunk_bytes: int = MAX_PIN_CHUNK_BYTES,
    ) -> None:
        self._owns = ascend is None
        self.ascend = ascend if ascend is not None else FakeAscend()
        try:
            super().__init__(
                device,
                max_batch=max_batch,
                batched=batched,
                pin_chunk_bytes=pin_chunk_bytes,
                npu=None if via_import else self.ascend.npu,
                acl_library=None if via_import else self.ascend.acl,
            )
        except BaseException:
            if self._owns:
                self.ascend.close()
            raise

    def _device_for(self, index: int) -> torch.device:
        return torch.device("cpu")  # the fake's device memory is host memory

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        return self.ascend.is_device_range(
            start, start + max(tensor.numel() * tensor.element_size(), 1)
        )

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return self.ascend.empty((nbytes,))

    def upload(self, stream: Any, values: I64) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=np.int64))

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A tensor in the fake's device memory (for building KV caches in tests)."""
        return self.ascend.empty(shape, dtype)

    def close(self) -> None:
        if self._owns:
            self.ascend.close()
