"""The native launch (``native_launch``): a job's driver calls issued by one C call.

No GPU here: :class:`DriverlessCuda` is :class:`CudaRuntime` with its driver
entry points replaced by ``ctypes`` callbacks that record every call (reading
the descriptor arrays, attributes, kernel parameters and uploaded ids they
point at). The Python path calls them through ``ctypes`` as it calls the
driver; the native path hands their addresses to the compiled
``_native_launch.c``, which calls them from C. Device memory is a shared arena
handed out in the same order to every runtime, so two handlers built alike see
the same addresses and their call logs must be equal, call for call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from offload_engine import (
    ConfigError,
    SyncOffloadingEngine,
    TransferError,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes import _native
from offload_engine.device.runtimes._cuda_copy import DriverBlockCopy
from offload_engine.device.runtimes._cuda_driver import Memcpy2D
from offload_engine.device.runtimes._cuda_driver import MemcpyAttributes as _MemcpyAttributes
from offload_engine.device.runtimes.base import IdBuffer
from offload_engine.device.runtimes.cuda import CudaRuntime
from offload_engine.host.layout import KVLayout, RegionTables, chunk_descriptors
from offload_engine.host.tier import HostTier
from offload_engine.testing import FakeRuntime, build_layout
from offload_engine.vocabulary import Direction
from tests.staged_reference import use_reference

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler ($CC or cc) to build the native launch",
)

_P, _Z, _U, _I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
_RECORD = ctypes.CFUNCTYPE(_I, _P, _P)
_WAIT = ctypes.CFUNCTYPE(_I, _P, _P, _U)
_BATCH13 = ctypes.CFUNCTYPE(_I, _P, _P, _P, _Z, _P, _P, _Z, _P)
_BATCH12 = ctypes.CFUNCTYPE(_I, _P, _P, _P, _Z, _P, _P, _Z, _P, _P)
_MEMCPY = ctypes.CFUNCTYPE(_I, ctypes.c_uint64, ctypes.c_uint64, _Z, _P)
_LAUNCH = ctypes.CFUNCTYPE(_I, _P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P)
_HTOD = ctypes.CFUNCTYPE(_I, ctypes.c_uint64, _P, _Z, _P)
_COPY2D = ctypes.CFUNCTYPE(_I, _P, _P)

ARENA = torch.zeros(48 << 20, dtype=torch.uint8)  # "device memory", shared by every runtime


def _words(address: int | None, count: int) -> list[int]:
    return list((ctypes.c_uint64 * count).from_address(address or 0)) if count else []


class Driver:
    """Driver entry points that record their calls; ``fail(kind, nth, rc)`` makes
    the ``nth`` next call of ``kind`` return ``rc``."""

    def __init__(self, *, v12: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.notes: list[str] = []
        self._faults: dict[str, list[int]] = {}  # kind -> [calls to let pass, rc]
        self.batch_has_fail_idx = v12

        def batch(*a: Any) -> int:
            d, s, z, n, attrs, idx, nattrs = a[:7]
            got = _MemcpyAttributes.from_address(attrs)
            fields = (got.srcAccessOrder, got.srcLocHint.type, got.srcLocHint.id)
            fields += (got.dstLocHint.type, got.dstLocHint.id, got.flags)
            extra = (a[7] is not None,) if v12 else ()  # failIdx given
            entry = (_words(d, n), _words(s, n), _words(z, n), fields, _words(idx, 1), nattrs)
            return self._note("batch", *entry, *extra, a[-1] or 0)

        def launch(f: Any, *a: Any) -> int:
            params, extra = a[-2:]
            slots = (ctypes.c_void_p * 9).from_address(params)
            values = [ctypes.c_int64.from_address(p).value for p in slots[:8]]
            values.append(ctypes.c_int.from_address(slots[8]).value)
            return self._note("launch", f, *a[:7], a[7] or 0, values, extra)

        def htod(dst: int, src: Any, n: int, stream: Any) -> int:
            ids = list((ctypes.c_int64 * (n // 8)).from_address(src))
            return self._note("htod", dst, src, n, ids, stream or 0)

        def copy2d(c: Any, stream: Any) -> int:
            got = Memcpy2D.from_address(c)
            src = got.srcHost if got.srcMemoryType == 1 else got.srcDevice
            dst = got.dstHost if got.dstMemoryType == 1 else got.dstDevice
            shape = (got.WidthInBytes, got.Height, got.dstPitch, got.srcPitch)
            types = (got.srcMemoryType, got.dstMemoryType)
            return self._note("copy2d", dst, src, *shape, types, stream or 0)

        self.memcpy2d = _COPY2D(copy2d)
        self.event_record = _RECORD(lambda e, s: self._note("record", e or 0, s or 0))
        self.stream_wait_event = _WAIT(lambda s, e, f: self._note("wait", s or 0, e or 0, f))
        self.batch = (_BATCH12 if v12 else _BATCH13)(batch)
        self.batch_hold = self.batch
        self.batch_address = ctypes.cast(self.batch, ctypes.c_void_p).value
        self.memcpy = _MEMCPY(lambda d, s, n, st: self._note("memcpy", d, s, n, st or 0))
        self.memcpy_htod = _HTOD(htod)
        self.launch = _LAUNCH(launch)

    def error_name(self, rc: int) -> str:
        return f"CUDA_ERROR_{rc}"

    def fail(self, kind: str, nth: int, rc: int) -> None:
        self._faults[kind] = [nth, rc]

    def _note(self, kind: str, *args: Any) -> int:
        self.calls.append((kind, *args))
        fault = self._faults.get(kind)
        if fault is not None:
            if fault[0] == 0:
                del self._faults[kind]
                return fault[1]
            fault[0] -= 1
        return 0


class DriverlessCuda(CudaRuntime):
    """:class:`CudaRuntime`'s enqueueing code over a :class:`Driver`: streams and
    events are bare handles, device memory comes from :data:`ARENA` in order."""

    def __init__(self, driver: Driver, *, batched: bool = True, max_batch: int = 4096) -> None:
        self.device = torch.device("cpu")
        direct = object.__new__(DriverBlockCopy)
        direct._func = ctypes.c_void_p(0xF00D)
        direct._launch = driver.launch
        direct._local = threading.local()
        self._init_calls(driver, None, direct, max_batch=max_batch, batched=batched)
        self._current_raw = None
        self._at = 0
        self._handles = iter(range(0x1000, 1 << 40, 0x10))
        self.compute = SimpleNamespace(cuda_stream=0xC0)

    def _take(self, nbytes: int) -> torch.Tensor:
        at = self._at
        self._at = at + (nbytes + 255) // 256 * 256
        if self._at > ARENA.numel():
            raise MemoryError("the test arena is full")
        return ARENA[at : at + nbytes]

    def _bind_thread(self) -> None:
        pass

    def new_stream(self, priority: int = 0) -> Any:
        return SimpleNamespace(cuda_stream=next(self._handles))

    def current_stream(self) -> Any:
        return self.compute

    def new_event(self) -> Any:
        return SimpleNamespace(cuda_event=next(self._handles))

    def synchronize(self, event: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def record_current(self, event: Any) -> None:
        self.record(event, self.compute)

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return self._take(nbytes)

    def pin_host(self, tensor: torch.Tensor) -> Callable[[], None]:
        return lambda: None

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return True

    def upload(self, stream: Any, values: Any) -> torch.Tensor:
        out = self._take(8 * len(values)).view(torch.int64)
        out.copy_(torch.from_numpy(np.asarray(values, dtype=np.int64)))
        return out

    def new_id_buffer(self, capacity: int) -> IdBuffer:
        host = self._take(8 * capacity).view(torch.int64)
        device = self._take(8 * capacity).view(torch.int64)
        keep = (host, host.data_ptr(), device.data_ptr(), {})
        return IdBuffer(host.numpy(), device, keep=keep)

    def launcher_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


@pytest.fixture(autouse=True)
def fresh_library(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test builds into (or finds in) one cache of its own session."""
    cache = tmp_path_factory.getbasetemp() / "native-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_ENGINE_CACHE_DIR", str(cache))
        _native.reset_library()
        yield
    _native.reset_library()


def handlers(
    layout: KVLayout,
    tier: HostTier,
    native: bool,
    *,
    rows: int,
    v12: bool = False,
    buffers: int = 2,
    **kw: Any,
) -> tuple[Driver, DeviceCopyHandler, DeviceCopyHandler]:
    driver = Driver(v12=v12)
    strategy = kw.pop("strategy", CopyStrategy.STAGED)
    # auto: a job of more than 8 blocks' descriptors stages
    auto_max = 8 * sum(len(g) for g in layout.groups)
    runtime = DriverlessCuda(driver, **kw)
    cfg = DeviceHandlerConfig(
        strategy=strategy,
        staging_bytes=buffers * rows * layout.slot_bytes,
        staging_buffers=buffers,
        native_launch=native,
        max_inflight=4,
        dma_max_descriptors=auto_max,
        dma_backlog_descriptors=auto_max,
        dma_backlog_min_region_bytes=0,
    )
    store, load = make_device_handlers(runtime, layout, tier, cfg)
    assert (store._native is not None) is native
    return driver, store, load


def jobs(
    rng: np.random.Generator, n_cache: int, n_slots: int, count: int, groups: int = 1
) -> Iterator[Any]:
    """``count`` (store?, cache ids, slots, blocks per group) jobs: random slots, or an
    allocator's runs (consecutive slots, ascending or handed back last-in first-out)."""
    for _ in range(count):
        per = int(rng.integers(0, min(n_cache, n_slots) // groups + 1))
        n = per * groups
        cache = rng.choice(n_cache, size=n, replace=False).tolist()
        if rng.random() < 0.5:
            slots = rng.choice(n_slots, size=n, replace=False).tolist()
        else:
            start = int(rng.integers(0, n_slots - n + 1))
            slots = list(range(start, start + n))
            if rng.random() < 0.5:
                slots.reverse()
        yield rng.random() < 0.5, cache, slots, (per,) * groups


def run_jobs(engine: SyncOffloadingEngine, todo: list[Any]) -> list[Any]:
    results = []
    for store, ids, slots, *sizes in todo:
        cache = gpu_blocks(ids, group_sizes=sizes[0]) if sizes else gpu_blocks(ids)
        spec = (
            TransferSpec(cache, cpu_blocks(slots))
            if store
            else TransferSpec(cpu_blocks(slots), cache)
        )
        [r] = engine.wait([engine.submit(spec)])
        results.append(r)
    return results


@needs_cc
@pytest.mark.parametrize(
    ("kind", "strategy", "rows", "buffers", "batched", "v12", "max_batch"),
    [
        ("cross-layer", CopyStrategy.STAGED, 3, 2, True, False, 4096),
        ("cross-layer", CopyStrategy.STAGED, 8, 2, True, True, 4096),
        ("cross-layer", CopyStrategy.STAGED, 2, 3, True, False, 4096),
        ("groups", CopyStrategy.STAGED, 2, 2, True, False, 4096),
        ("groups", CopyStrategy.STAGED, 5, 4, True, False, 4096),
        ("flash-attention", CopyStrategy.STAGED, 5, 2, False, False, 4096),
        ("mla", CopyStrategy.STAGED, 4, 3, True, False, 2),
        ("flash-attention", CopyStrategy.DMA, 4, 2, True, False, 3),
        ("cross-layer", CopyStrategy.DMA, 4, 2, True, False, 4096),
        ("groups", CopyStrategy.DMA, 4, 2, False, False, 4096),
        ("separate-kv", CopyStrategy.KERNEL, 4, 2, True, False, 4096),
        ("flash-attention", CopyStrategy.AUTO, 3, 2, True, False, 4096),
        ("groups", CopyStrategy.AUTO, 2, 3, True, True, 4096),
    ],
)
def test_native_program_makes_the_python_paths_calls(
    kind: str,
    strategy: CopyStrategy,
    rows: int,
    buffers: int,
    batched: bool,
    v12: bool,
    max_batch: int,
) -> None:
    """Random jobs (stores and loads, random and allocator slots, several pieces)
    make the same driver calls, arguments and order on both paths (a staged job's
    pieces planned by the native library on one, call by call on the other)."""
    layout = build_layout(kind, lambda s, d: torch.empty(s, dtype=d), num_blocks=24)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 40)
    groups = len(layout.groups)
    todo = list(jobs(np.random.default_rng(len(kind) + rows), 24, 40, 40, groups))
    logs = []
    for native in (False, True):
        driver, store, load = handlers(
            layout,
            tier,
            native,
            rows=rows,
            buffers=buffers,
            v12=v12,
            batched=batched,
            max_batch=max_batch,
            strategy=strategy,
        )
        with SyncOffloadingEngine([store, load]) as engine:
            results = run_jobs(engine, todo)
            assert all(r.success for r in results), [r.error for r in results if not r.success][:1]
        taken = {r.strategy for r in results}
        # auto takes both strategies, job by job, on the same streams
        assert taken == ({"dma", "staged"} if strategy is CopyStrategy.AUTO else {strategy.value})
        logs.append(driver.calls)
    python, native_calls = logs
    kinds = {c[0] for c in python}
    assert {"record", "wait"} <= kinds
    if strategy is not CopyStrategy.DMA:
        assert {"launch", "htod"} <= kinds
    if strategy is not CopyStrategy.KERNEL:
        assert ("batch" if batched else "memcpy") in kinds
    assert len(python) == len(native_calls)
    for i, (a, b) in enumerate(zip(python, native_calls, strict=True)):
        assert a == b, f"call {i}"


@needs_cc
def test_a_native_dma_job_makes_its_descriptors_without_numpy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the native launch a dma job never reaches the numpy descriptors (tens of
    microseconds of a cold thread), whose only callers are the Python launch's."""
    from offload_engine.device import dma

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the native launch made descriptors with numpy")

    monkeypatch.setattr(dma, "chunk_descriptors", refuse)
    layout = build_layout("groups", lambda s, d: torch.empty(s, dtype=d), num_blocks=24)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 40)
    driver, store, load = handlers(layout, tier, True, rows=4, strategy=CopyStrategy.DMA)
    todo = list(jobs(np.random.default_rng(3), 24, 40, 12, len(layout.groups)))
    with SyncOffloadingEngine([store, load]) as engine:
        results = run_jobs(engine, todo)
    assert all(r.success for r in results), [r.error for r in results if not r.success][:1]
    assert {r.strategy for r in results} == {"dma"}
    assert "batch" in {c[0] for c in driver.calls}


@needs_cc
@pytest.mark.parametrize("seed", range(6))
def test_native_dma_descriptors_are_the_numpy_ones(seed: int) -> None:
    """``oe_chunk_descriptors`` makes exactly :func:`chunk_descriptors`' descriptors,
    merges included: regions that continue each other inside a block and across
    consecutive blocks, tiers with gaps between blocks and several slots a block,
    stores and loads, and ids appended after an earlier batch in the program."""
    rng = np.random.default_rng(seed)
    program = _native.LaunchProgram((0,) * len(_native.ENTRY_NAMES), str)
    for _ in range(40):
        nreg = int(rng.integers(1, 5))
        size = rng.choice([64, 4096, 1 << 21], size=nreg).astype(np.uint64)
        touching = rng.random() < 0.5  # regions back to back: a block merges whole
        stride = np.full(nreg, int(size.sum()) if touching else 1 << 24, dtype=np.uint64)
        base = (1 << 40) + np.concatenate(([0], np.cumsum(size)[:-1])).astype(np.uint64)
        if not touching:
            base = (1 << 40) + np.arange(nreg, dtype=np.uint64) * np.uint64(1 << 32)
        tables = RegionTables(base, stride, size, np.cumsum(size) - size)
        slot_bytes = int(size.sum()) + int(rng.choice([0, 256]))
        factor = int(rng.choice([1, 4]))
        block_stride = factor * slot_bytes + int(rng.choice([0, 1 << 20]))
        n = int(rng.integers(0, 40))
        if rng.random() < 0.5:  # an allocator's run on both sides: long merges
            start = int(rng.integers(0, 100))
            cache = np.arange(start, start + n, dtype=np.int64)
            slots = np.arange(start * 2, start * 2 + n, dtype=np.int64)
        else:
            cache = rng.choice(200, size=n, replace=False).astype(np.int64)
            slots = rng.choice(400, size=n, replace=False).astype(np.int64)
        direction = Direction.STORE if rng.random() < 0.5 else Direction.LOAD
        want = chunk_descriptors(
            tables,
            cache,
            slots,
            tier_base=1 << 36,
            slot_bytes=slot_bytes,
            direction=direction,
            factor=factor,
            block_stride=block_stride,
        )
        program.begin()
        program.descriptors(*(np.arange(3, dtype=np.uint64),) * 3)  # an earlier batch
        geometry = (1 << 36, slot_bytes, factor, block_stride)
        d, s_, z, k = program.chunk_descriptors(
            tables, cache, slots, geometry, direction is Direction.STORE
        )
        desc = program.descriptor_array
        assert k == want[2].shape[0]
        for at, column in zip((d, s_, z), want, strict=True):
            np.testing.assert_array_equal(desc[at : at + k], column)
        np.testing.assert_array_equal(desc[:3], np.arange(3))


@needs_cc
def test_native_staged_planning_of_large_jobs() -> None:
    """Jobs of hundreds of blocks (many pieces, the planner's sort over many runs of
    its merges) make the same calls on both paths."""
    layout = build_layout("cross-layer", lambda s, d: torch.empty(s, dtype=d), num_blocks=600)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 1200)
    rng = np.random.default_rng(7)
    todo = []
    for k in range(8):
        n = int(rng.integers(300, 601))
        cache = [int(x) for x in rng.choice(600, size=n, replace=False)]
        if k % 2:  # runs of consecutive slots in shuffled order, as an allocator's reuse
            runs = np.split(np.arange(n) + int(rng.integers(0, 1200 - n)), np.arange(40, n, 40))
            order = rng.permutation(len(runs))
            slots = np.concatenate([runs[i][:: int(rng.choice([1, -1]))] for i in order])
        else:
            slots = rng.choice(1200, size=n, replace=False)
        todo.append((k % 4 < 2, cache, [int(x) for x in slots]))
    logs = []
    for native in (False, True):
        driver, store, load = handlers(layout, tier, native, rows=64, buffers=3)
        with SyncOffloadingEngine([store, load]) as engine:
            assert all(r.success for r in run_jobs(engine, todo))
        logs.append(driver.calls)
    assert len(logs[0]) == len(logs[1])
    for i, (a, b) in enumerate(zip(*logs, strict=True)):
        assert a == b, f"call {i}"


@needs_cc
@pytest.mark.parametrize(("blocks", "how"), [(8, "_held"), (100, "_released")])
def test_a_2d_copy_of_many_rows_runs_without_the_gil(blocks: int, how: str) -> None:
    """A layer-wise part over consecutive slots is one piece with one 2D copy: a few
    ops, no descriptors. Its rows still cost the driver CPU, so a program whose 2D
    copies move more rows than HOLD_GIL_DESCRIPTORS runs releasing the GIL."""
    empty = lambda s, d: torch.empty(s, dtype=d)  # noqa: E731
    layout = build_layout("flash-attention", empty, num_blocks=200, num_layers=4)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 200)
    driver, store, load = handlers(layout, tier, True, rows=64)  # 128 half-slot rows a buffer
    taken: list[str] = []
    program = load._native
    for name in ("_held", "_released"):
        run = getattr(program, name)
        setattr(program, name, lambda *a, run=run, name=name: (taken.append(name), run(*a))[1])
    with SyncOffloadingEngine([store, load]) as engine:
        spec = TransferSpec(cpu_blocks(range(blocks)), gpu_blocks(range(blocks)), tensors=[0, 1])
        [r] = engine.wait([engine.submit(spec)])
        assert r.success, r.error
    assert [c[4] for c in driver.calls if c[0] == "copy2d"] == [blocks]  # one 2D copy, its rows
    assert taken == [how]


@needs_cc
@pytest.mark.parametrize(
    ("kind", "rows", "strategy"),
    [
        ("cross-layer", 3, CopyStrategy.STAGED),
        ("groups", 2, CopyStrategy.STAGED),
        ("mla", 5, CopyStrategy.STAGED),
        ("cross-layer", 3, CopyStrategy.DMA),
        ("groups", 2, CopyStrategy.DMA),
    ],
)
def test_native_planning_on_a_tier_of_several_slots_per_block(
    kind: str, rows: int, strategy: CopyStrategy
) -> None:
    """Blocks of a job that starts mid tier block (factor 4: several cache blocks per
    tier block, the first slots skipped) are planned alike on both paths."""
    layout = build_layout(kind, lambda s, d: torch.empty(s, dtype=d), num_blocks=24)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 12, factor=4)
    groups = len(layout.groups)
    rng = np.random.default_rng(rows)
    todo = []
    for _ in range(30):
        n = int(rng.integers(1, 24 // groups + 1))
        start = int(rng.integers(0, 4))
        per_group = -(-(n + start) // 4)
        cache = [int(x) for x in rng.choice(24, size=n * groups, replace=False)]
        tier_ids = rng.choice(12, size=per_group * groups, replace=False)
        if rng.random() < 0.5:  # an allocator's run, maybe handed back last-in first-out
            first = int(rng.integers(0, 12 - per_group * groups + 1))
            tier_ids = np.arange(first, first + per_group * groups)[:: int(rng.choice([1, -1]))]
        todo.append((rng.random() < 0.5, cache, [int(x) for x in tier_ids], n, start))
    logs = []
    for native in (False, True):
        driver, store, load = handlers(layout, tier, native, rows=rows, strategy=strategy)
        with SyncOffloadingEngine([store, load]) as engine:
            for is_store, cache, tier_ids, n, start in todo:
                blocks = gpu_blocks(
                    cache, group_sizes=(n,) * groups, block_indices=(start,) * groups
                )
                spec = (
                    TransferSpec(blocks, cpu_blocks(tier_ids))
                    if is_store
                    else TransferSpec(cpu_blocks(tier_ids), blocks)
                )
                [r] = engine.wait([engine.submit(spec)])
                assert r.success, r.error
        logs.append(driver.calls)
    kinds = {"batch"} if strategy is CopyStrategy.DMA else {"launch", "batch", "htod"}
    assert kinds <= {c[0] for c in logs[0]}
    assert len(logs[0]) == len(logs[1])
    for i, (a, b) in enumerate(zip(*logs, strict=True)):
        assert a == b, f"call {i}"


@needs_cc
def test_a_failing_call_fails_its_job_as_on_the_python_path_and_the_engine_serves_on() -> None:
    layout = build_layout("cross-layer", lambda s, d: torch.empty(s, dtype=d), num_blocks=16)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 16)
    todo = [(True, [1, 2, 3, 4, 5], [9, 8, 7, 3, 1]), (False, [6, 7], [9, 8])] * 2
    for kind, nth in (("batch", 1), ("launch", 0), ("record", 2), ("wait", 1), ("htod", 0)):
        errors = []
        for native in (False, True):
            driver, store, load = handlers(layout, tier, native, rows=2)
            with SyncOffloadingEngine([store, load]) as engine:
                driver.fail(kind, nth, 700 + nth)
                results = run_jobs(engine, todo)
            bad = results[0]
            assert not bad.success and isinstance(bad.error, TransferError)
            assert all(r.success for r in results[1:])
            errors.append(str(bad.error))
        assert errors[0] == errors[1]
        assert errors[0].endswith(f"failed: CUDA_ERROR_{700 + nth}")


@needs_cc
def test_a_failing_per_descriptor_copy_is_named_as_on_the_python_path() -> None:
    layout = build_layout("flash-attention", lambda s, d: torch.empty(s, dtype=d), num_blocks=8)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 8)
    driver, store, _ = handlers(layout, tier, True, rows=2, batched=False)
    with SyncOffloadingEngine([store]) as engine:
        driver.fail("memcpy", 1, 1)
        [bad, good] = run_jobs(engine, [(True, [1, 2, 3], [4, 5, 6])] * 2)
    assert str(bad.error) == "cuMemcpyAsync failed: CUDA_ERROR_1"
    assert good.success


def test_without_a_compiler_auto_falls_back_and_true_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("OFFLOAD_ENGINE_CACHE_DIR", str(tmp_path))
    _native.reset_library()
    layout = build_layout("cross-layer", lambda s, d: torch.empty(s, dtype=d), num_blocks=8)
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, 8)
    runtime = DriverlessCuda(Driver())
    store = DeviceCopyHandler(
        runtime, layout, tier, direction=Direction.STORE, config=DeviceHandlerConfig()
    )
    assert store._native is None and store._ops is runtime
    assert store.native_note is not None and "no-such-compiler-here" in store.native_note
    assert any("native launch unavailable" in n for n in runtime.notes)
    with pytest.raises(ConfigError, match=r"native_launch is True, but .*no C compiler"):
        DeviceCopyHandler(
            runtime,
            layout,
            tier,
            direction=Direction.STORE,
            config=DeviceHandlerConfig(native_launch=True),
        )
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind


@needs_cc
def test_a_failed_build_is_reported_and_leaves_no_partial_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with pytest.raises(subprocess.CalledProcessError):
        _native.build_library(broken, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    good = _native.build_library(directory=tmp_path / "cache")
    assert good.exists() and _native.build_library(directory=tmp_path / "cache") == good


def test_native_launch_option_is_checked() -> None:
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(ConfigError, match="native_launch"):
            DeviceHandlerConfig(native_launch=bad)  # type: ignore[arg-type]
    fake = FakeRuntime(inline=True)
    layout = build_layout("cross-layer", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 8)
    with pytest.raises(ConfigError, match="fake runtime launches its jobs from Python"):
        make_device_handlers(fake, layout, tier, DeviceHandlerConfig(native_launch=True))
    store, _ = make_device_handlers(fake, layout, tier, DeviceHandlerConfig(native_launch="auto"))
    assert store._native is None and store.native_note is not None
    tier.release()
    fake.close()


@needs_cc
def test_a_malformed_program_is_refused() -> None:
    found = _native.native_library()
    assert not isinstance(found, str), found
    released = found[0]
    fail = (ctypes.c_int64 * 3)()
    entries = (ctypes.c_void_p * 6)()
    for words in ([9], [1, 5], [3, 0, 0, 1, 0, 0, 7], [4] + [0] * 9 + [40]):
        prog = (ctypes.c_int64 * len(words))(*words)
        assert released(ctypes.addressof(prog), len(words), None, entries, fail) == -1
    assert released(None, 0, None, entries, fail) == 0


@needs_cc
@pytest.mark.parametrize(
    ("kind", "rows", "buffers", "batched", "factor", "blocks"),
    [
        ("cross-layer", 3, 2, True, 1, 24),
        ("cross-layer", 64, 3, True, 1, 600),
        ("groups", 5, 4, True, 1, 24),
        ("flash-attention", 5, 2, False, 1, 24),
        ("mla", 4, 3, True, 1, 24),
        ("cross-layer", 3, 2, True, 4, 24),
        ("groups", 2, 2, True, 4, 24),
    ],
)
def test_the_native_planner_makes_the_reference_plans_calls(
    kind: str, rows: int, buffers: int, batched: bool, factor: int, blocks: int
) -> None:
    """The library's one staged planner (``oe_staged_build``, on the native launch and
    behind the Python launch alike) against the slow Python reference
    (``tests/staged_reference.py``): random stores and loads, over random slots and
    an allocator's runs, several pieces and tier blocks of several slots, make the
    same driver calls with the same arguments in the same order."""
    layout = build_layout(kind, lambda s, d: torch.empty(s, dtype=d), num_blocks=blocks)
    n_tier = 2 * blocks // factor
    tier = pinned_host_tier(DriverlessCuda(Driver()), layout, n_tier, factor=factor)
    groups = len(layout.groups)
    rng = np.random.default_rng(rows + factor + blocks)
    todo = []
    for store, cache, slots, sizes in jobs(rng, blocks, n_tier, 30, groups):
        per = sizes[0]
        start = int(rng.integers(0, factor)) if factor > 1 and per else 0
        need = -(-(per + start) // factor)  # tier blocks per group
        tier_ids = slots[: need * groups] if len(slots) >= need * groups else []
        if len(tier_ids) < need * groups:
            continue
        todo.append((store, cache, tier_ids, per, start))
    logs = {}
    for how in ("reference", "python", "native"):
        with pytest.MonkeyPatch.context() as mp:
            if how == "reference":
                use_reference(mp)
            driver, store_h, load_h = handlers(
                layout, tier, how == "native", rows=rows, buffers=buffers, batched=batched
            )
            with SyncOffloadingEngine([store_h, load_h]) as engine:
                for is_store, cache, tier_ids, per, start in todo:
                    cache_blocks = gpu_blocks(
                        cache, group_sizes=(per,) * groups, block_indices=(start,) * groups
                    )
                    spec = (
                        TransferSpec(cache_blocks, cpu_blocks(tier_ids))
                        if is_store
                        else TransferSpec(cpu_blocks(tier_ids), cache_blocks)
                    )
                    [r] = engine.wait([engine.submit(spec)])
                    assert r.success, r.error
        logs[how] = driver.calls
    assert {"launch", "htod"} <= {c[0] for c in logs["reference"]}
    if kind == "groups" and rows >= 4:  # groups smaller than a slot: runs go as 2D copies
        assert "copy2d" in {c[0] for c in logs["reference"]}
    for how in ("python", "native"):
        assert len(logs[how]) == len(logs["reference"]), how
        for i, (a, b) in enumerate(zip(logs["reference"], logs[how], strict=True)):
            assert a == b, f"{how}: call {i}"


def test_without_a_compiler_there_is_no_staged_strategy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The staged planner is the native library's: without a compiler ``AUTO`` copies
    with dma (and the bytes still arrive) and an explicit ``STAGED`` is refused."""
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("OFFLOAD_ENGINE_CACHE_DIR", str(tmp_path))
    _native.reset_library()
    fake = FakeRuntime(inline=True)
    layout = build_layout("cross-layer", fake.empty, num_blocks=8)
    tier = pinned_host_tier(fake, layout, 8)
    auto = DeviceHandlerConfig(staging_bytes=2 * layout.slot_bytes)
    store, load = make_device_handlers(fake, layout, tier, auto)
    assert store._strategy is CopyStrategy.DMA and store._planner is None
    with SyncOffloadingEngine([store, load]) as engine:
        results = run_jobs(engine, [(True, [1, 2, 3], [4, 5, 6]), (False, [4, 5, 6], [4, 5, 6])])
    assert all(r.success for r in results)
    assert fake.block_copies == 0
    with pytest.raises(ConfigError, match=r"staged strategy .*native library.*no C compiler"):
        make_device_handlers(fake, layout, tier, DeviceHandlerConfig(strategy=CopyStrategy.STAGED))
    tier.release()
    fake.close()
