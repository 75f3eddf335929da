"""The NPU runtime on CPU: a fake ``torch.npu`` and a fake ``libascendcl`` (ctypes callbacks
that read the descriptor arrays from the addresses they are handed, check them, record them
and copy with memmove). Covers the ACL calls, pinning, the guarded import and the probe."""

from __future__ import annotations

import ctypes
import gc
import importlib.abc
import importlib.machinery
import itertools
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from offload_engine import ConfigError, RuntimeUnavailableError, TransferError
from offload_engine.device.runtimes import npu as npu_module
from offload_engine.device.runtimes.npu import (
    ACL_HOST_REG_PINNED,
    ACL_MEM_LOCATION_TYPE_DEVICE,
    ACL_MEM_LOCATION_TYPE_HOST,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    HOST_PAGE_BYTES,
    MEMCPY_BATCH_ASYNC,
    SIZE_MAX,
    NpuRuntime,
    page_spans,
)
from offload_engine.runtimes import probe_npu, probe_runtimes
from offload_engine.testing import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_CONTEXT_NULL,
    FakeAscend,
    FakeNpuRuntime,
    fake_torch_npu_module,
)
from offload_engine.vocabulary import Direction, Medium

ROOT = pathlib.Path(__file__).resolve().parents[1]
AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
HOST = ACL_MEM_LOCATION_TYPE_HOST
DEVICE = ACL_MEM_LOCATION_TYPE_DEVICE


@pytest.fixture
def rt() -> Iterator[FakeNpuRuntime]:
    runtime = FakeNpuRuntime()
    yield runtime
    runtime.close()


def u64(values: Any) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.asarray(values, dtype=np.uint64)


class Buffers:
    """``n`` chunks of ``chunk`` bytes: random pinned host memory, device memory, and a
    second pinned host buffer to copy back into."""

    def __init__(self, rt: FakeNpuRuntime, n: int, chunk: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.n, self.chunk = n, chunk
        self.host = torch.randint(0, 256, (n, chunk), dtype=torch.uint8, generator=gen)
        self.back = torch.zeros((n, chunk), dtype=torch.uint8)
        self.dev = rt.empty((n * chunk,))
        self.dev.zero_()
        self.unpin = [rt.pin_host(self.host), rt.pin_host(self.back)]
        # scatter: host chunk i goes to device slot perm[i]
        self.perm = np.random.default_rng(seed).permutation(n)

    def h2d(self) -> tuple[Any, Any, Any]:
        dst = u64(self.dev.data_ptr() + self.perm * self.chunk)
        src = u64(self.host.data_ptr() + np.arange(self.n) * self.chunk)
        return dst, src, u64(np.full(self.n, self.chunk))

    def d2h(self) -> tuple[Any, Any, Any]:
        dst = u64(self.back.data_ptr() + np.arange(self.n) * self.chunk)
        src = u64(self.dev.data_ptr() + self.perm * self.chunk)
        return dst, src, u64(np.full(self.n, self.chunk))

    def release(self) -> None:
        for unpin in self.unpin:
            unpin()


def unregistered() -> torch.Tensor:
    """Host memory in pages of its own (a large allocation is a mapping of its own), so it
    cannot share a page that a registration of a small buffer was widened to."""
    return torch.zeros(1 << 20, dtype=torch.uint8)


def sync(rt: NpuRuntime, stream: Any) -> None:
    event = rt.new_event()
    rt.record(event, stream)
    rt.synchronize(event)


# --------------------------------------------------------------------------- batched copies


def test_batched_copies_go_in_calls_of_at_most_4096_and_are_bit_exact(
    rt: FakeNpuRuntime,
) -> None:
    buf = Buffers(rt, 10_000, 16)
    stream = rt.new_stream()
    acl = rt.ascend.acl
    dst, src, sizes = buf.h2d()
    assert rt.memcpy_batch(stream, dst, src, sizes, Direction.LOAD) == 3
    assert [c.count for c in acl.batch_calls] == [4096, 4096, 1808]
    # what the library read from the raw arrays is exactly what was passed, in order
    assert sum((c.dsts for c in acl.batch_calls), ()) == tuple(dst.tolist())
    assert sum((c.srcs for c in acl.batch_calls), ()) == tuple(src.tolist())
    assert all(c.dest_maxs == c.sizes == (16,) * c.count for c in acl.batch_calls)
    # one attribute for the whole call: host -> this device
    assert {c.attrs for c in acl.batch_calls} == {((DEVICE, 0, HOST, 0),)}
    assert {c.attrs_indexes for c in acl.batch_calls} == {(0,)}
    assert {c.stream for c in acl.batch_calls} == {stream.handle}
    dst, src, sizes = buf.d2h()
    assert rt.memcpy_batch(stream, dst, src, sizes, Direction.STORE) == 3
    assert acl.batch_calls[-1].attrs == ((HOST, 0, DEVICE, 0),)
    sync(rt, stream)
    device = buf.dev.view(buf.n, buf.chunk)
    assert torch.equal(device[torch.from_numpy(buf.perm)], buf.host)
    assert torch.equal(buf.back, buf.host)
    buf.release()


def test_max_batch_is_checked_and_sets_the_call_size() -> None:
    for bad in (0, 4097, True, 2.0):
        with pytest.raises(ConfigError, match="max_batch"):
            FakeNpuRuntime(max_batch=bad)  # type: ignore[arg-type]
    for bad in (4096, False, 1.5):
        with pytest.raises(ConfigError, match="pin_chunk_bytes"):
            FakeNpuRuntime(pin_chunk_bytes=bad)  # type: ignore[arg-type]
    rt = FakeNpuRuntime(max_batch=5)
    try:
        buf = Buffers(rt, 12, 64)
        stream = rt.new_stream()
        assert rt.memcpy_batch(stream, *buf.h2d(), Direction.LOAD) == 3
        assert [c.count for c in rt.ascend.acl.batch_calls] == [5, 5, 2]
        assert rt.memcpy_batch(stream, u64([]), u64([]), u64([]), Direction.LOAD) == 0
        sync(rt, stream)
        buf.release()
    finally:
        rt.close()


def test_without_the_batch_symbol_each_copy_is_one_acl_memcpy() -> None:
    rt = FakeNpuRuntime(FakeAscend(batch=False))
    try:
        assert not rt.batched
        assert any("no aclrtMemcpyBatchAsync" in n for n in rt.notes)
        buf = Buffers(rt, 7, 100)
        stream = rt.new_stream()
        assert rt.memcpy_batch(stream, *buf.h2d(), Direction.LOAD) == 7
        assert rt.memcpy_batch(stream, *buf.d2h(), Direction.STORE) == 7
        calls = rt.ascend.acl.copy_calls
        assert [c.kind for c in calls] == [ACL_MEMCPY_HOST_TO_DEVICE] * 7 + [
            ACL_MEMCPY_DEVICE_TO_HOST
        ] * 7
        assert all(c.count == c.dest_max == 100 for c in calls)
        sync(rt, stream)
        assert torch.equal(buf.back, buf.host)
        buf.release()
    finally:
        rt.ascend.close()


def test_batched_false_forces_one_call_per_copy(rt: FakeNpuRuntime) -> None:
    per_copy = FakeNpuRuntime(rt.ascend, batched=False)
    buf = Buffers(per_copy, 3, 8)
    stream = per_copy.new_stream()
    assert per_copy.memcpy_batch(stream, *buf.h2d(), Direction.LOAD) == 3
    assert rt.ascend.acl.batch_calls == [] and len(rt.ascend.acl.copy_calls) == 3
    sync(per_copy, stream)
    buf.release()


def test_a_product_without_batch_copies_switches_to_one_call_per_copy(
    rt: FakeNpuRuntime,
) -> None:
    rt.ascend.acl.batch_unsupported = True  # ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    buf = Buffers(rt, 9, 32)
    stream = rt.new_stream()
    assert rt.memcpy_batch(stream, *buf.h2d(), Direction.LOAD) == 9
    assert not rt.batched
    assert any("207000" in n for n in rt.notes)
    assert rt.memcpy_batch(stream, *buf.d2h(), Direction.STORE) == 9
    sync(rt, stream)
    assert torch.equal(buf.back, buf.host)
    assert rt.ascend.acl.batch_calls == []
    buf.release()


def test_a_refused_batch_names_the_copy_failindex_points_at() -> None:
    rt = FakeNpuRuntime(max_batch=4)
    try:
        buf = Buffers(rt, 10, 16)
        stream = rt.new_stream()
        dst, src, sizes = buf.h2d()
        rt.ascend.acl.fail_next_batch(rc=ACL_ERROR_INVALID_PARAM, fail_index=SIZE_MAX)
        with pytest.raises(TransferError, match=r"copies 0\.\.3 of 10.*aclError 100000") as info:
            rt.memcpy_batch(stream, dst, src, sizes, Direction.LOAD)
        assert "failIndex names no single copy" in str(info.value)
        assert "(injected batch failure)" in str(info.value)  # aclGetRecentErrMsg
        # the second call of a job fails: failIndex is relative to that call
        rt.ascend.acl.fail_next_batch(rc=507000, fail_index=3, after=1)
        with pytest.raises(TransferError) as info:
            rt.memcpy_batch(stream, dst, src, sizes, Direction.LOAD)
        text = str(info.value)
        assert "copies 4..7 of 10" in text and "aclError 507000" in text
        assert f"failIndex 3: copy 7 (16 bytes {int(src[7]):#x} -> {int(dst[7]):#x})" in text
        rt.ascend.acl.fail_next_batch(fail_index=99)
        with pytest.raises(TransferError, match="failIndex 99 is outside the 4 copies"):
            rt.memcpy_batch(stream, dst, src, sizes, Direction.LOAD)
        # a real check of the library: copy 5 reads host memory that is not registered
        loose = unregistered()
        src = src.copy()
        src[5] = loose.data_ptr()
        with pytest.raises(TransferError, match=r"not registered host.*failIndex 1: copy 5 "):
            rt.memcpy_batch(stream, dst, src, sizes, Direction.LOAD)
        sync(rt, stream)  # the calls that were accepted still run
        buf.release()
    finally:
        rt.close()


def test_a_refused_single_copy_is_named() -> None:
    rt = FakeNpuRuntime(batched=False)
    try:
        buf = Buffers(rt, 4, 16)
        dst, src, sizes = buf.d2h()
        dst = dst.copy()
        loose = unregistered()
        dst[2] = loose.data_ptr()
        stream = rt.new_stream()
        with pytest.raises(TransferError, match=r"aclrtMemcpyAsync of copy 2 of 4.*100000"):
            rt.memcpy_batch(stream, dst, src, sizes, Direction.STORE)
        sync(rt, stream)  # copies 0 and 1 were accepted
        buf.release()
    finally:
        rt.close()


def test_the_stream_handle_is_read_at_each_call_so_queued_waits_go_first(
    rt: FakeNpuRuntime,
) -> None:
    """torch_npu queues event waits; a copy issued straight to ACL must not overtake them."""
    buf = Buffers(rt, 4, 32)
    stream = rt.new_stream()
    gate = threading.Event()
    values = torch.full((4 * 32,), 9, dtype=torch.uint8)

    def model_writes() -> None:  # compute still running when the copy is issued
        gate.wait()
        buf.dev.copy_(values)

    rt.ascend.compute(model_writes)
    written = rt.new_event()
    rt.record(written, rt.current_stream())
    rt.wait_event(stream, written)
    assert rt.ascend.queued == 3  # the compute op, the record and the wait: not launched
    rt.memcpy_batch(stream, *buf.d2h(), Direction.STORE)
    assert rt.ascend.queued == 0  # reading npu_stream launched them ahead of the copy
    gate.set()
    sync(rt, stream)
    assert bool((buf.back == 9).all())
    buf.release()


def test_the_fake_library_refuses_a_thread_without_a_device_context(
    rt: FakeNpuRuntime,
) -> None:
    """ACL needs the device set on each calling thread; the runtime does that itself."""
    buf = Buffers(rt, 2, 8)
    stream = rt.new_stream()
    address = ctypes.cast(rt.ascend.acl.aclrtMemcpyBatchAsync, ctypes.c_void_p).value
    raw = MEMCPY_BATCH_ASYNC(address or 0)
    out: dict[str, Any] = {}

    def unbound() -> None:
        fail = ctypes.c_size_t(0)
        out["rc"] = raw(0, 0, 0, 0, 1, 0, 0, 1, ctypes.addressof(fail), stream.handle)

    def through_runtime() -> None:
        out["calls"] = rt.memcpy_batch(stream, *buf.h2d(), Direction.LOAD)

    for target in (unbound, through_runtime):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert out == {"rc": ACL_ERROR_RT_CONTEXT_NULL, "calls": 1}
    sync(rt, stream)
    buf.release()


def test_streams_events_and_capabilities_come_from_torch_npu(rt: FakeNpuRuntime) -> None:
    assert (rt.name, rt.medium) == ("npu", Medium.NPU)
    assert not rt.supports_kernel_strategy
    assert rt.supports_block_copy and rt.block_copy_alignment == 1
    high = rt.new_stream(priority=-1)  # priority is ignored, not refused
    assert high is not rt.new_stream() and rt.current_stream() is rt.ascend.default_stream
    event = rt.new_event()
    rt.record(event, high)
    rt.synchronize(event)
    assert event.query()


def test_device_selection() -> None:
    ascend = FakeAscend(device_count=2)
    try:
        assert FakeNpuRuntime(ascend).index == 0
        assert FakeNpuRuntime(ascend, device=1).index == 1
        for good, index in (("npu:1", 1), ("npu", 0)):
            assert npu_module._parse_index(good, ascend.npu) == index
        for missing in ("npu:5", 5):
            with pytest.raises(ConfigError, match="does not exist"):
                NpuRuntime(missing, npu=ascend.npu, acl_library=ascend.acl)
        for bad in ("cuda:0", "npu:x", True, 1.5, torch.device("cpu")):
            with pytest.raises(ConfigError):
                NpuRuntime(bad, npu=ascend.npu, acl_library=ascend.acl)  # type: ignore[arg-type]
    finally:
        ascend.close()
    none = FakeAscend(device_count=0)
    try:
        with pytest.raises(RuntimeUnavailableError, match="no NPU is visible"):
            FakeNpuRuntime(none)
    finally:
        none.close()


# --------------------------------------------------------------------------- pinning


def test_page_spans_are_aligned_consecutive_and_bounded() -> None:
    page = HOST_PAGE_BYTES
    assert page_spans(4096 * 10 + 64, 100, 1) == [(4096 * 10, 4096)]
    assert page_spans(4096 * 10 + 64, 0, 1) == []
    base, total, row, limit = 4096 * 7 + 64, 300_000, 3000, 16 * page
    spans = page_spans(base, total, row, limit)
    assert len(spans) > 1
    assert all(a % page == 0 and n % page == 0 and n <= limit for a, n in spans)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
    assert spans[0][0] <= base and spans[-1][0] + spans[-1][1] >= base + total
    with pytest.raises(ConfigError, match="pages"):
        page_spans(base, total, row, 2 * page)


def test_pinning_registers_whole_pages_and_release_unregisters(rt: FakeNpuRuntime) -> None:
    # a buffer that starts inside a page (torch aligns large buffers to 64 bytes, and a
    # page boundary sometimes), so registration must widen it to whole pages
    backing = torch.empty(5 * HOST_PAGE_BYTES, dtype=torch.uint8)
    skip = 64 + (-backing.data_ptr() % HOST_PAGE_BYTES)
    tensor = backing[skip : skip + 3 * HOST_PAGE_BYTES + 100]
    assert tensor.data_ptr() % HOST_PAGE_BYTES == 64
    assert not rt.is_pinned(tensor)
    release = rt.pin_host(tensor)
    [(address, size, flag)] = rt.ascend.acl.register_calls
    assert flag == ACL_HOST_REG_PINNED
    assert address % HOST_PAGE_BYTES == 0 and size % HOST_PAGE_BYTES == 0
    assert address <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() <= address + size
    assert rt.is_pinned(tensor) and rt.is_pinned(tensor[10:20])
    assert not rt.is_pinned(unregistered())
    release()
    assert rt.ascend.acl.unregister_calls == [address]
    assert rt.ascend.registrations == {} and not rt.is_pinned(tensor)


def test_pinning_is_chunked_and_a_row_spans_at_most_two_registrations() -> None:
    rt = FakeNpuRuntime(pin_chunk_bytes=16 * HOST_PAGE_BYTES)
    try:
        tensor = torch.empty((100, 3000), dtype=torch.uint8)
        release = rt.pin_host(tensor)
        calls = rt.ascend.acl.register_calls
        assert len(calls) > 1 and all(n <= 16 * HOST_PAGE_BYTES for _, n, _ in calls)
        assert rt.is_pinned(tensor)
        release()
        assert sorted(rt.ascend.acl.unregister_calls) == sorted(a for a, _, _ in calls)
        assert rt.ascend.registrations == {}
    finally:
        rt.close()


def test_a_failed_registration_rolls_back_and_says_why() -> None:
    rt = FakeNpuRuntime(pin_chunk_bytes=16 * HOST_PAGE_BYTES)
    try:
        tensor = torch.empty((100, 3000), dtype=torch.uint8)
        rt.ascend.acl.fail_next_register(207001, after=2)
        with pytest.raises(RuntimeUnavailableError, match=r"aclrtHostRegisterV2 of .*207001"):
            rt.pin_host(tensor)
        assert len(rt.ascend.acl.unregister_calls) == 2  # the two that had succeeded
        assert rt.ascend.registrations == {} and not rt.is_pinned(tensor)
    finally:
        rt.close()


def test_a_failed_unregistration_is_raised_after_trying_them_all() -> None:
    rt = FakeNpuRuntime(pin_chunk_bytes=16 * HOST_PAGE_BYTES)
    try:
        tensor = torch.empty((100, 3000), dtype=torch.uint8)
        release = rt.pin_host(tensor)
        count = len(rt.ascend.acl.register_calls)
        rt.ascend.acl.fail_next_unregister(100000)
        with pytest.raises(RuntimeUnavailableError, match=r"aclrtHostUnregister\(0x"):
            release()
        assert len(rt.ascend.acl.unregister_calls) == count
        release()  # nothing left to unregister
        assert len(rt.ascend.acl.unregister_calls) == count
    finally:
        rt.close()


def test_the_registered_memory_lives_until_it_is_unregistered(rt: FakeNpuRuntime) -> None:
    tensor = torch.empty(2 * HOST_PAGE_BYTES, dtype=torch.uint8)
    ref = weakref.ref(tensor)
    release = rt.pin_host(tensor)
    del tensor
    gc.collect()
    assert ref() is not None
    release()
    gc.collect()
    assert ref() is None


def test_pinning_needs_cann_8_5_and_a_contiguous_cpu_tensor() -> None:
    rt = FakeNpuRuntime(FakeAscend(register=False))
    try:
        assert any("aclrtHostRegisterV2" in n for n in rt.notes)
        with pytest.raises(RuntimeUnavailableError, match=r"CANN 8\.5 or later"):
            rt.pin_host(torch.empty(64, dtype=torch.uint8))
    finally:
        rt.ascend.close()
    rt = FakeNpuRuntime()
    try:
        with pytest.raises(ValueError, match="contiguous CPU"):
            rt.pin_host(torch.empty((4, 4), dtype=torch.uint8).t())
    finally:
        rt.close()


def test_the_runtime_is_safe_to_share_between_threads(rt: FakeNpuRuntime) -> None:
    """Pin, copy both ways and unpin from many threads at once on one runtime."""
    errors: list[BaseException] = []
    results: list[bool] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        try:
            buf = Buffers(rt, 64, 48, seed=seed)
            stream = rt.new_stream()
            rt.memcpy_batch(stream, *buf.h2d(), Direction.LOAD)
            rt.memcpy_batch(stream, *buf.d2h(), Direction.STORE)
            sync(rt, stream)
            ok = torch.equal(buf.back, buf.host)
            buf.release()
            with lock:
                results.append(ok)
        except BaseException as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [True] * 8
    assert rt.ascend.registrations == {}
    assert len({c.thread for c in rt.ascend.acl.batch_calls}) == 8


# --------------------------------------------------------------------------- guarded import


class FailingTorchNpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import torch_npu`` fail the way the real one does without CANN: it turns
    torch's autoload off first, then its extension fails to load."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "torch_npu":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        os.environ[AUTOLOAD] = "0"
        raise self.error


@pytest.fixture
def no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.delenv(AUTOLOAD, raising=False)
    return monkeypatch


LIBHCCL = ImportError("libhccl.so: cannot open shared object file: No such file or directory")
AUTOLOAD_FAILED = RuntimeError(
    "Failed to load the backend extension: torch_npu. You can disable extension "
    "auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0."
)
TWO_ACCELERATORS = RuntimeError("Two accelerators cannot be used at the same time in PyTorch")


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (LIBHCCL, r"libhccl\.so.*CANN is missing or its environment is not set"),
        (AUTOLOAD_FAILED, r"backend extension.*autoload failed"),
        (TWO_ACCELERATORS, r"RuntimeError: Two accelerators"),
        (OSError("libascend_hal.so: cannot open"), r"OSError.*CANN is missing"),
        (ModuleNotFoundError("No module named 'torch_npu._C'", name="torch_npu._C"), "_C"),
    ],
)
@pytest.mark.parametrize("autoload", [None, "1"])
def test_a_torch_npu_that_cannot_load_is_refused_clearly(
    no_torch_npu: pytest.MonkeyPatch, error: BaseException, says: str, autoload: str | None
) -> None:
    if autoload is not None:
        no_torch_npu.setenv(AUTOLOAD, autoload)
    no_torch_npu.setattr(sys, "meta_path", [FailingTorchNpu(error), *sys.meta_path])
    with pytest.raises(RuntimeUnavailableError, match=says) as info:
        NpuRuntime()
    assert info.value.__cause__ is error
    assert "torch_npu is installed but cannot be imported" in str(info.value)
    assert os.environ.get(AUTOLOAD) == autoload  # torch_npu's half-done switch undone
    npu_info = probe_npu()
    assert not npu_info.available and npu_info.reason == str(info.value)
    assert [i.name for i in probe_runtimes()] == ["cuda", "npu", "cpu"]


def test_without_torch_npu_the_runtime_says_how_to_install_it(
    no_torch_npu: pytest.MonkeyPatch,
) -> None:
    no_torch_npu.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> not found
    with pytest.raises(RuntimeUnavailableError, match=r"not installed.*\[npu\]") as refused:
        NpuRuntime()
    info = probe_npu()
    # info and the runtime give the same install hint
    assert not info.available and info.reason == str(refused.value)
    assert "pip install -e '.[npu]'" in info.reason and "CANN" in info.reason


def test_a_torch_npu_without_its_npu_module_is_refused(no_torch_npu: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("torch_npu")
    no_torch_npu.setitem(sys.modules, "torch_npu", module)
    with pytest.raises(RuntimeUnavailableError, match=r"no torch_npu\.npu"):
        npu_module.load_torch_npu()


def test_a_missing_libascendcl_is_refused_clearly() -> None:
    with pytest.raises(RuntimeUnavailableError, match=r"cannot load libnot-ascendcl\.so.*CANN"):
        npu_module.load_ascendcl("libnot-ascendcl.so")


def test_through_the_imports_the_runtime_moves_real_bytes(
    no_torch_npu: pytest.MonkeyPatch,
) -> None:
    ascend = FakeAscend()
    try:
        no_torch_npu.setitem(sys.modules, "torch_npu", fake_torch_npu_module(ascend))
        no_torch_npu.setattr(npu_module, "load_ascendcl", lambda: ascend.acl)
        rt = FakeNpuRuntime(ascend, via_import=True)
        buf = Buffers(rt, 5, 64)
        stream = rt.new_stream()
        rt.memcpy_batch(stream, *buf.h2d(), Direction.LOAD)
        rt.memcpy_batch(stream, *buf.d2h(), Direction.STORE)
        sync(rt, stream)
        assert torch.equal(buf.back, buf.host)
        buf.release()
        info = probe_npu()
        assert info.available and info.devices == ("npu:0",)
        assert info.strategies == ("dma", "staged")
        assert any("no kernel strategy" in n for n in info.notes)
    finally:
        ascend.close()


@pytest.mark.parametrize(
    ("ascend_kw", "available", "says"),
    [({"batch": False}, True, "no aclrtMemcpyBatchAsync"), ({"register": False}, False, "8.5")],
)
def test_the_probe_reports_what_libascendcl_lacks(
    no_torch_npu: pytest.MonkeyPatch, ascend_kw: dict[str, bool], available: bool, says: str
) -> None:
    ascend = FakeAscend(**ascend_kw)
    try:
        no_torch_npu.setitem(sys.modules, "torch_npu", fake_torch_npu_module(ascend))
        no_torch_npu.setattr(npu_module, "load_ascendcl", lambda: ascend.acl)
        info = probe_npu()
        assert info.available is available
        assert says in (" ".join(info.notes) if available else info.reason)
    finally:
        ascend.close()


BROKEN_TORCH_NPU = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, os, sys

    class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        error = None
        def find_spec(self, name, path=None, target=None):
            return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # as torch_npu does, first
            raise self.error

    broken = Broken()
    sys.meta_path.insert(0, broken)
    os.environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    errors = [
        ImportError("libhccl.so: cannot open shared object file: No such file or directory"),
        RuntimeError("Failed to load the backend extension: torch_npu. You can disable "
                     "extension auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0."),
    ]
    broken.error = errors[0]

    from offload_engine import (HostCopyHandler, RuntimeUnavailableError, SyncOffloadingEngine,
                                TransferSpec, cpu_blocks, host_cache_blocks)
    from offload_engine.runtimes import probe_runtimes
    from offload_engine.device.runtimes.npu import NpuRuntime
    from offload_engine.testing import cache_block_bytes, poisoned_tier, random_host_cache
    from offload_engine.connectors.vllm.config import parse_extra_config
    from offload_engine.connectors.vllm.layout import layout_from_canonical
    from offload_engine.connectors.vllm.platform import select_backend
    from offload_engine.connectors.vllm.testing import fake_canonical_kv_caches

    for error in errors:
        broken.error = error
        infos = {i.name: i for i in probe_runtimes()}
        assert not infos["npu"].available, infos["npu"]
        assert type(error).__name__ in infos["npu"].reason, infos["npu"].reason
        assert infos["cpu"].available
        try:
            NpuRuntime()
        except RuntimeUnavailableError as exc:
            assert exc.__cause__ is error
        else:
            raise AssertionError("NpuRuntime() built without torch_npu")
        assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in os.environ
        # vLLM on Ascend: selected, and refused clearly when the handlers are built
        layout = layout_from_canonical(fake_canonical_kv_caches(num_blocks=4))
        config = parse_extra_config({"cpu_bytes_to_use": 1 << 20})
        backend = select_backend(type("P", (), {"device_type": "npu"})())
        try:
            backend.build(layout, 2, config)
        except RuntimeUnavailableError as exc:
            assert "torch_npu" in str(exc)
        else:
            raise AssertionError("NPU handlers built without torch_npu")
        # the CUDA path is untouched (no GPU here: its own clear error)
        backend = select_backend(type("P", (), {"device_type": "cuda"})())
        try:
            backend.build(layout, 2, config)
        except RuntimeUnavailableError as exc:
            assert "CUDA is not available" in str(exc), exc
        # the CPU path moves bytes
        _, layout = random_host_cache(num_blocks=8)
        tier = poisoned_tier(layout, 4)
        with SyncOffloadingEngine([HostCopyHandler(layout, tier)]) as engine:
            job = engine.submit(TransferSpec(host_cache_blocks([5]), cpu_blocks([2])))
            [r] = engine.wait([job])
            assert r.success, r.error
        assert tier.memory[2].numpy().tobytes() == cache_block_bytes(layout, 5)
        tier.release()
    print("ok")
    """
)


def test_a_broken_torch_npu_breaks_nothing_else() -> None:
    """In a fresh interpreter whose ``import torch_npu`` fails (no CANN, or torch's autoload
    failing): the package imports, probes, and its CPU and CUDA paths work."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop(AUTOLOAD, None)
    proc = subprocess.run(
        [sys.executable, "-c", BROKEN_TORCH_NPU],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "ok"
