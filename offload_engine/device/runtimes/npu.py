"""Ascend NPU runtime: torch_npu for streams and events, CANN's ACL for copies and pinning.

Streams, events and the current stream come from ``torch.npu`` (torch_npu);
stream priorities are not used (NPU streams have none; a priority is ignored). Batched
copies go through ``aclrtMemcpyBatchAsync`` (CANN 8.5 and later), called with
``ctypes`` on ``libascendcl.so`` with the numpy descriptor arrays' buffers:
there is no maintained Python binding for it. Where the symbol is missing
(older CANN), or the product refuses it (``ACL_ERROR_RT_FEATURE_NOT_SUPPORT``,
e.g. the first-generation Atlas training and inference series), copies go one
``aclrtMemcpyAsync`` each. Device-side block copies (the staged strategy) are
torch indexing on the NPU stream: there is no Triton on Ascend, so no kernel
strategy either.

**The stream handle.** torch_npu does not launch work when it is issued: with
its task queue on (the default), operators, event records and event waits are
queued and launched later by a consumer thread. A direct ACL call on a stream
could therefore overtake an event wait issued just before it. The handle is
read from the stream object's ``npu_stream`` attribute *at every call*:
torch_npu's getter (``NPUStream::stream()``) empties the task queue before it
returns the ``aclrtStream``, so everything issued on the stream before is
launched first, and work issued after (the job's end event) is queued behind.

**Pinning.** The host tier is a plain allocation registered with
``aclrtHostRegisterV2(ptr, size, ACL_HOST_REG_PINNED)`` (CANN 8.5 and later) in
chunks of at most 64 GiB, and unregistered with ``aclrtHostUnregister``. ACL
wants 4 KiB-aligned addresses, and torch's allocator aligns large buffers to
64 bytes only, so each registration is widened to whole pages. The release
call keeps the tensor alive until its pages are unregistered.

Everything here is tested on CPU through :mod:`offload_engine.testing`
(a fake ``torch.npu`` and a fake ``libascendcl``); nothing has run on Ascend
hardware. See ``docs/npu.md``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from offload_engine._checks import check_int
from offload_engine.device.runtimes.base import (
    I64,
    MAX_PIN_CHUNK_BYTES,
    U64,
    BlockCopy,
    DeviceRuntime,
    TorchStyleEvents,
    pin_chunks,
    spans_cover,
    torch_block_copy,
)
from offload_engine.errors import ConfigError, RuntimeUnavailableError, TransferError
from offload_engine.vocabulary import Direction, Medium

#: descriptors per aclrtMemcpyBatchAsync call, at most
ACL_MAX_BATCH = 4096
#: ACL wants page-aligned host registrations
HOST_PAGE_BYTES = 4096
#: the library the ACL entry points come from (found through LD_LIBRARY_PATH, which
#: CANN's set_env.sh sets; torch_npu has loaded it already)
ASCENDCL_LIBRARY = "libascendcl.so"

# aclrtMemcpyKind
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
# aclrtMemLocationType
ACL_MEM_LOCATION_TYPE_HOST = 0  # host memory that ACL allocated or registered
ACL_MEM_LOCATION_TYPE_DEVICE = 1
# aclrtHostRegisterV2 flag: register (non-page-locked) host memory as page-locked
ACL_HOST_REG_PINNED = 0x10000000
# aclError values this module acts on
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
#: what aclrtMemcpyBatchAsync writes to failIndex when no single copy is to blame
SIZE_MAX = ctypes.c_size_t(-1).value

_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"


class AclMemLocation(ctypes.Structure):
    """``aclrtMemLocation``: ``{uint32_t id; aclrtMemLocationType type;}``."""

    _fields_ = (("id", ctypes.c_uint32), ("type", ctypes.c_int))


class AclMemcpyBatchAttr(ctypes.Structure):
    """``aclrtMemcpyBatchAttr``: ``{dstLoc; srcLoc; uint8_t rsv[16];}`` (rsv zero)."""

    _fields_ = (
        ("dstLoc", AclMemLocation),
        ("srcLoc", AclMemLocation),
        ("rsv", ctypes.c_uint8 * 16),
    )


_P = ctypes.c_void_p
_Z = ctypes.c_size_t
#: aclError aclrtMemcpyBatchAsync(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes,
#:     size_t numBatches, aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes, size_t numAttrs,
#:     size_t *failIndex, aclrtStream stream)
MEMCPY_BATCH_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _P, _Z, _P, _P, _Z, _P, _P)
#: aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
#:     aclrtMemcpyKind kind, aclrtStream stream)
MEMCPY_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, _P, _Z, _P, _Z, ctypes.c_int, _P)
#: aclError aclrtHostRegisterV2(void *ptr, uint64_t size, uint32_t flag)
HOST_REGISTER_V2 = ctypes.CFUNCTYPE(ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_uint32)
#: aclError aclrtHostUnregister(void *ptr)
HOST_UNREGISTER = ctypes.CFUNCTYPE(ctypes.c_int, _P)
#: const char *aclGetRecentErrMsg(void)
RECENT_ERR_MSG = ctypes.CFUNCTYPE(ctypes.c_char_p)


# --------------------------------------------------------------------------- loading

#: What ``info`` and the runtime say when torch_npu is missing: one install hint for both.
TORCH_NPU_MISSING = (
    "torch_npu is not installed (from the offload-engine checkout: pip install -e '.[npu]'; "
    "CANN 8.5 or later is installed separately)"
)


def load_torch_npu() -> Any:
    """Import torch_npu and return its ``torch.npu`` module, or raise
    :class:`RuntimeUnavailableError` saying why it cannot be used.

    torch_npu sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` while it imports and
    restores it only when the import succeeds; after a failed import the
    variable is put back as it was, so child processes see the caller's
    environment.
    """
    saved = os.environ.get(_AUTOLOAD)
    try:
        import torch_npu
    except ModuleNotFoundError as exc:
        _restore_env(saved)
        if exc.name == "torch_npu":
            raise RuntimeUnavailableError(TORCH_NPU_MISSING) from exc
        raise RuntimeUnavailableError(_import_failure(exc)) from exc
    except (ImportError, OSError, RuntimeError) as exc:
        _restore_env(saved)
        raise RuntimeUnavailableError(_import_failure(exc)) from exc
    npu = getattr(torch_npu, "npu", None)
    if npu is None:
        raise RuntimeUnavailableError("torch_npu imported, but it has no torch_npu.npu module")
    return npu


def _restore_env(saved: str | None) -> None:
    if saved is None:
        os.environ.pop(_AUTOLOAD, None)
    else:
        os.environ[_AUTOLOAD] = saved


def _import_failure(exc: BaseException) -> str:
    text = f"torch_npu is installed but cannot be imported: {type(exc).__name__}: {exc}"
    message = str(exc)
    if ".so" in message or isinstance(exc, OSError):
        text += (
            " (CANN is missing or its environment is not set: install CANN 8.5 or later and "
            "source its set_env.sh before starting Python)"
        )
    elif "backend extension" in message:
        text += f" (torch's device-backend autoload failed; {_AUTOLOAD}=0 turns it off)"
    return text


def load_ascendcl(path: str = ASCENDCL_LIBRARY) -> ctypes.CDLL:
    """``libascendcl`` through ctypes, or :class:`RuntimeUnavailableError`."""
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        raise RuntimeUnavailableError(
            f"cannot load {path} ({exc}): CANN is not installed, or its set_env.sh was not sourced"
        ) from exc


def _symbol(lib: Any, name: str, prototype: Any) -> Any:
    """``name`` from ``lib`` called through ``prototype``, or None where it is missing."""
    try:
        entry = getattr(lib, name)
    except AttributeError:
        return None
    address = ctypes.cast(entry, ctypes.c_void_p).value
    return prototype(address) if address else None


class _Acl:
    """The ACL entry points this runtime calls, resolved once."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib  # keeps the library (or a fake's callbacks) alive
        self.batch = _symbol(lib, "aclrtMemcpyBatchAsync", MEMCPY_BATCH_ASYNC)
        self.memcpy = _symbol(lib, "aclrtMemcpyAsync", MEMCPY_ASYNC)
        self.register = _symbol(lib, "aclrtHostRegisterV2", HOST_REGISTER_V2)
        self.unregister = _symbol(lib, "aclrtHostUnregister", HOST_UNREGISTER)
        self.recent = _symbol(lib, "aclGetRecentErrMsg", RECENT_ERR_MSG)
        if self.memcpy is None:
            raise RuntimeUnavailableError("libascendcl has no aclrtMemcpyAsync")

    def describe(self, call: str, rc: int) -> str:
        text = f"{call} failed: aclError {rc}"
        if self.recent is not None:
            recent = self.recent()
            if recent:
                text += f" ({recent.decode(errors='replace').strip()})"
        return text


def page_spans(
    base: int,
    total: int,
    row_bytes: int,
    limit: int = MAX_PIN_CHUNK_BYTES,
    page: int = HOST_PAGE_BYTES,
) -> list[tuple[int, int]]:
    """``(address, size)`` registrations covering ``[base, base + total)``: page-aligned,
    consecutive, at most ``limit`` bytes each. Inner boundaries are the page start at or
    below a row boundary (:func:`pin_chunks`), so a row straddles two registrations by
    less than a page at most."""
    if total <= 0:
        return []
    if limit < 4 * page:
        raise ConfigError(f"pin chunk limit {limit} is below four {page}-byte pages")
    start = base - base % page
    end = -(-(base + total) // page) * page
    # widening to pages adds less than a page at either end of a chunk
    cuts = {
        (base + offset) - (base + offset) % page
        for offset, _ in pin_chunks(total, row_bytes, limit - 2 * page)
    }
    bounds = [start, *sorted(c for c in cuts if c > start), end]
    return [(lo, hi - lo) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def _subtract(spans: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``spans`` (``(address, size)``) outside every ``taken`` range."""
    out = []
    for lo, size in spans:
        pieces = [(lo, lo + size)]
        for t_lo, t_size in taken:
            t_hi = t_lo + t_size
            pieces = [
                part
                for a, b in pieces
                for part in ((a, min(b, t_lo)), (max(a, t_hi), b))
                if part[1] > part[0]
            ]
        out += [(a, b - a) for a, b in pieces]
    return out


def _parse_index(device: int | str | torch.device | None, npu: Any) -> int:
    if device is None:
        return int(npu.current_device())
    if isinstance(device, bool):
        raise ConfigError(f"device must be an NPU index or 'npu[:N]', got {device!r}")
    if isinstance(device, int):
        return device
    index: int | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, rest = device.partition(":")
        if rest and not rest.isdigit():
            raise ConfigError(f"device must be 'npu' or 'npu:N', got {device!r}")
        index = int(rest) if rest else None
    else:
        raise ConfigError(f"device must be an NPU index or 'npu[:N]', got {device!r}")
    if kind != "npu":
        raise ConfigError(f"the NPU runtime needs an npu device, got {device!r}")
    return int(npu.current_device()) if index is None else index


# --------------------------------------------------------------------------- runtime


class NpuRuntime(TorchStyleEvents, DeviceRuntime):
    """One Ascend NPU through torch_npu and CANN's ACL.

    ``npu`` (the ``torch.npu`` module) and ``acl_library`` (libascendcl, a
    ``ctypes.CDLL`` or any object whose attributes are ACL's entry points) are
    injectable; by default torch_npu is imported (guarded) and
    :func:`load_ascendcl` loads the library. ``batched=False`` forces one
    ``aclrtMemcpyAsync`` per copy.
    """

    name = "npu"
    medium = Medium.NPU

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        *,
        max_batch: int = ACL_MAX_BATCH,
        batched: bool = True,
        pin_chunk_bytes: int = MAX_PIN_CHUNK_BYTES,
        npu: Any = None,
        acl_library: Any = None,
    ) -> None:
        check_int(max_batch, "max_batch", maximum=ACL_MAX_BATCH)
        check_int(pin_chunk_bytes, "pin_chunk_bytes", minimum=4 * HOST_PAGE_BYTES)
        if npu is None:
            npu = load_torch_npu()
        if not npu.is_available():
            raise RuntimeUnavailableError("torch_npu imported, but no NPU is visible")
        index = _parse_index(device, npu)
        count = int(npu.device_count())
        if not 0 <= index < count:
            raise ConfigError(f"npu:{index} does not exist ({count} visible)")
        self._npu = npu
        self.index = index
        self.device = self._device_for(index)
        self.max_batch = max_batch
        self.pin_chunk_bytes = pin_chunk_bytes
        self._acl = _Acl(acl_library if acl_library is not None else load_ascendcl())
        self._lock = threading.Lock()
        self._notes: list[str] = []
        if self._acl.batch is None:
            self._notes.append(
                "libascendcl has no aclrtMemcpyBatchAsync (an older CANN): copies go one "
                "aclrtMemcpyAsync each"
            )
        if self._acl.register is None:
            self._notes.append(
                "libascendcl has no aclrtHostRegisterV2 (CANN before 8.5): host memory cannot be "
                "pinned"
            )
        self.batched = batched and self._acl.batch is not None
        self._local = threading.local()
        self._pinned: dict[int, list[int]] = {}  # registration address -> [size, users]
        self._attrs: dict[Direction, AclMemcpyBatchAttr] = {}
        dev = AclMemLocation(index, ACL_MEM_LOCATION_TYPE_DEVICE)
        host = AclMemLocation(0, ACL_MEM_LOCATION_TYPE_HOST)
        self._attrs[Direction.STORE] = AclMemcpyBatchAttr(dstLoc=host, srcLoc=dev)
        self._attrs[Direction.LOAD] = AclMemcpyBatchAttr(dstLoc=dev, srcLoc=host)
        self._attr_index = (ctypes.c_size_t * 1)(0)  # one attribute for the whole batch

    def _device_for(self, index: int) -> torch.device:
        """The torch device of NPU ``index`` (torch_npu registers the ``npu`` type)."""
        return torch.device("npu", index)

    @property
    def notes(self) -> tuple[str, ...]:
        """Why any fast path is not in use."""
        with self._lock:
            return tuple(self._notes)

    def _bind_thread(self) -> None:
        # ACL calls need the device's context current on the calling thread
        if getattr(self._local, "bound", False):
            return
        self._npu.set_device(self.index)
        self._local.bound = True

    # ------------------------------------------------------------ streams and events

    def new_stream(self, priority: int = 0) -> Any:
        return self._npu.Stream(device=self.index)  # priorities are not supported

    def current_stream(self) -> Any:
        return self._npu.current_stream(self.index)

    def new_event(self) -> Any:
        return self._npu.Event()

    def stream_handle(self, stream: Any) -> int:
        # read at every call: torch_npu's getter launches the work queued on the stream
        # (event waits included) before it hands out the aclrtStream
        return int(stream.npu_stream)

    # ------------------------------------------------------------ memory

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pin_host(self, tensor: torch.Tensor) -> Callable[[], None]:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("pin_host takes a contiguous CPU tensor")
        register, unregister = self._acl.register, self._acl.unregister
        if register is None or unregister is None:
            raise RuntimeUnavailableError(
                "cannot pin host memory: libascendcl has no aclrtHostRegisterV2/"
                "aclrtHostUnregister (CANN 8.5 or later is needed)"
            )
        self._bind_thread()
        total = tensor.numel() * tensor.element_size()
        row = tensor.stride(0) * tensor.element_size() if tensor.dim() > 1 else 1
        wanted = page_spans(tensor.data_ptr(), total, row, self.pin_chunk_bytes, HOST_PAGE_BYTES)
        held: list[int] = []  # registrations this pin counts on (some shared with others)
        keep: list[torch.Tensor] = [tensor]  # the memory outlives its registrations

        def release() -> None:
            self._bind_thread()
            failures = []
            with self._lock:
                while held:
                    address = held.pop()
                    entry = self._pinned[address]
                    entry[1] -= 1
                    if entry[1]:
                        continue  # another pinned tensor shares this page
                    del self._pinned[address]
                    rc = int(unregister(address))
                    if rc:
                        failures.append(
                            self._acl.describe(f"aclrtHostUnregister({address:#x})", rc)
                        )
            keep.clear()
            if failures:
                raise RuntimeUnavailableError("; ".join(failures))

        with self._lock:  # pinning is rare: hold the table across the ACL calls
            # pages a registration of another tensor already covers (the page that two
            # small allocations share) are not registered twice: that registration is shared
            for address, (size, _) in sorted(self._pinned.items()):
                if any(address < lo + n and lo < address + size for lo, n in wanted):
                    self._pinned[address][1] += 1
                    held.append(address)
            shared = [(a, self._pinned[a][0]) for a in held]
            for address, size in _subtract(wanted, shared):
                rc = int(register(address, size, ACL_HOST_REG_PINNED))
                if rc:
                    error = RuntimeUnavailableError(
                        self._acl.describe(
                            f"aclrtHostRegisterV2 of {size} bytes at {address:#x} "
                            f"(tensor at {tensor.data_ptr():#x}, {total} bytes)",
                            rc,
                        )
                    )
                    break
                self._pinned[address] = [size, 1]
                held.append(address)
            else:
                return release
        try:
            release()
        except RuntimeUnavailableError as undo:
            raise error from undo
        raise error

    def _is_registered(self, start: int, end: int) -> bool:
        # a range may span consecutive registrations of one tensor
        with self._lock:
            spans = [(a, size) for a, (size, _) in self._pinned.items()]
        return spans_cover(spans, start, end)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        end = start + max(tensor.numel() * tensor.element_size(), 1)
        return self._is_registered(start, end) or bool(tensor.is_pinned())

    def upload(self, stream: Any, values: I64) -> torch.Tensor:
        host = torch.from_numpy(np.array(values, dtype=np.int64)).pin_memory()
        with self._npu.stream(stream):
            return host.to(self.device, non_blocking=True)

    # ------------------------------------------------------------ copies

    def memcpy_batch(self, stream: Any, dst: U64, src: U64, sizes: U64, kind: Direction) -> int:
        n = int(sizes.shape[0])
        if n == 0:
            return 0
        self._bind_thread()
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        handle = self.stream_handle(stream)
        calls, done = 0, 0
        batch = self._acl.batch
        if self.batched and batch is not None:
            attrs = ctypes.addressof(self._attrs[kind])
            attr_index = ctypes.addressof(self._attr_index)
            while done < n:
                hi = min(done + self.max_batch, n)
                fail = ctypes.c_size_t(SIZE_MAX)
                rc = int(
                    batch(
                        dst.ctypes.data + 8 * done,
                        sizes.ctypes.data + 8 * done,  # destMaxs: each copy fills its range
                        src.ctypes.data + 8 * done,
                        sizes.ctypes.data + 8 * done,
                        hi - done,
                        attrs,
                        attr_index,
                        1,
                        ctypes.addressof(fail),
                        handle,
                    )
                )
                if rc == ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
                    self._stop_batching(rc)
                    break
                if rc:
                    raise TransferError(
                        self._batch_failure(rc, fail.value, done, hi, n, dst, src, sizes)
                    )
                calls += 1
                done = hi
        if done == n:
            return calls
        copy = self._acl.memcpy
        kind_value = (
            ACL_MEMCPY_DEVICE_TO_HOST if kind is Direction.STORE else ACL_MEMCPY_HOST_TO_DEVICE
        )
        rest = zip(dst[done:].tolist(), src[done:].tolist(), sizes[done:].tolist(), strict=True)
        for i, (d, s, z) in enumerate(rest, start=done):
            rc = int(copy(d, z, s, z, kind_value, handle))
            if rc:
                raise TransferError(
                    self._acl.describe(
                        f"aclrtMemcpyAsync of copy {i} of {n} ({z} bytes {s:#x} -> {d:#x})", rc
                    )
                )
            calls += 1
        return calls

    def _stop_batching(self, rc: int) -> None:
        with self._lock:
            if self.batched:
                self.batched = False
                self._notes.append(
                    f"aclrtMemcpyBatchAsync returned {rc} (feature not supported on this "
                    "product): copies go one aclrtMemcpyAsync each"
                )

    def _batch_failure(
        self, rc: int, fail: int, lo: int, hi: int, n: int, dst: U64, src: U64, sizes: U64
    ) -> str:
        text = self._acl.describe(f"aclrtMemcpyBatchAsync of copies {lo}..{hi - 1} of {n}", rc)
        if fail == SIZE_MAX:
            return text + "; failIndex names no single copy"
        if fail >= hi - lo:
            return text + f"; failIndex {fail} is outside the {hi - lo} copies of the call"
        i = lo + fail
        return (
            text
            + f"; failIndex {fail}: copy {i} ({int(sizes[i])} bytes "
            + f"{int(src[i]):#x} -> {int(dst[i]):#x})"
        )

    def copy_blocks(self, stream: Any, copy: BlockCopy) -> None:
        with self._npu.stream(stream):
            torch_block_copy(copy)
