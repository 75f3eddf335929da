"""Fuzzing the public entry points with invalid values.

Every invalid input gets a typed error (an ``OffloadError`` subclass, or ``TypeError`` /
``ValueError`` where documented), never a crash or a hang, and the engine keeps serving valid
jobs afterwards.
"""

from __future__ import annotations

import array
import collections
import gc
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.from_thread
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_engine import (
    BlockSpec,
    CacheBlocks,
    ConfigError,
    EngineBrokenError,
    EngineClosedError,
    EngineNotStartedError,
    HandlerRegistrationError,
    HostCopyHandler,
    HostTier,
    JobFailedError,
    KVLayout,
    Medium,
    NoHandlerError,
    OffloadError,
    OffloadingQueueManager,
    Region,
    SyncOffloadingEngine,
    TierBlocks,
    TransferResult,
    TransferSpec,
    WrongThreadError,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
    npu_blocks,
)
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.connectors.vllm.config import parse_extra_config
from offload_engine.device import (
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.engine.completions import check_wait_timeout
from offload_engine.testing import (
    FakeHandler,
    FakeRuntime,
    assert_exactly_once,
    build_layout,
    call_in_thread,
)
from offload_engine.vocabulary import Direction

STORE = TransferSpec(gpu_blocks([1, 2]), cpu_blocks([3, 4]))
BOUND = 10.0


@pytest.mark.parametrize(
    ("bad", "error"),
    [(math.nan, ValueError), ("1", TypeError), (True, TypeError), (object(), TypeError)],
)
def test_bad_wait_timeouts_are_refused_instead_of_hanging(bad: object, error: type) -> None:
    """Regression: ``wait(ids, timeout=nan)`` and ``submit(..., wait_timeout=nan)`` blocked
    forever (NaN compares false with every deadline); ``True`` waited one second."""
    fake = FakeHandler(manual=True)
    with SyncOffloadingEngine([fake], capacity=1) as engine:
        j = engine.submit_nowait(STORE)
        fake.wait_launched_blocking(1)
        with pytest.raises(error):
            engine.wait([j], timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(error):
            engine.submit(STORE, wait_timeout=bad)  # type: ignore[arg-type]
        fake.complete(j)
        [r] = engine.wait([j], timeout=BOUND)  # the refused wait left no claim behind
        assert r.success


@pytest.mark.parametrize(("bad", "error"), [(math.nan, ValueError), ("x", TypeError)])
def test_a_bad_close_timeout_is_refused_before_the_engine_closes(bad: object, error: type) -> None:
    """Regression: ``close(timeout="x")`` closed the engine, failed its jobs, then raised, so
    their results were never delivered to anyone."""
    fake = FakeHandler(manual=True, max_inflight=1)
    engine = SyncOffloadingEngine([fake])
    ids = [engine.submit_nowait(STORE) for _ in range(3)]
    fake.wait_launched_blocking(1)
    with pytest.raises(error):
        engine.close(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(error):
        engine.manager.wait_blocking(ids, timeout=bad)  # type: ignore[arg-type]
    assert not engine.closed and engine.stats().state == "running"
    fake.complete(ids[0])
    fake.wait_launched_blocking(2)
    fake.complete(ids[1])
    leftovers = engine.close(cancel_queued=True, timeout=0.01)
    assert_exactly_once(ids, leftovers)
    assert [r.success for r in leftovers] == [True, True, False]


@pytest.mark.anyio
async def test_aclose_refuses_a_bad_timeout_and_stays_usable() -> None:
    fake = FakeHandler(manual=True)
    async with OffloadingQueueManager([fake]) as mgr:
        j = mgr.submit_nowait(STORE)
        for bad in (math.nan, "soon", True):
            with pytest.raises((TypeError, ValueError)):
                await mgr.aclose(timeout=bad)  # type: ignore[arg-type]
            with pytest.raises((TypeError, ValueError)):
                await mgr.wait([j], timeout=bad)  # type: ignore[arg-type]
        assert mgr.state == "running"
        await fake.wait_launched(1)
        fake.complete(j)
        [r] = await mgr.wait([j], timeout=BOUND)
        assert r.success


@pytest.mark.anyio
async def test_calls_in_the_wrong_state_get_state_errors() -> None:
    """Regression: ``cancel`` on a closed (or never started) manager raised
    ``UnknownJobError`` instead of the state error every other call raises."""
    mgr = OffloadingQueueManager([FakeHandler()])
    for call in (lambda: mgr.submit_nowait(STORE), mgr.get_finished, lambda: mgr.cancel(0)):
        with pytest.raises(EngineNotStartedError):
            call()
    async with mgr:
        [r] = await mgr.wait([mgr.submit_nowait(STORE)], timeout=BOUND)
        assert r.success
    for call in (
        lambda: mgr.submit_nowait(STORE),
        lambda: mgr.submit_blocking(STORE),
        mgr.get_finished,
        lambda: mgr.wait_blocking([0]),
        lambda: mgr.cancel(0),
    ):
        with pytest.raises(EngineClosedError):
            await anyio.to_thread.run_sync(call)  # blocking calls refuse the loop thread
    with pytest.raises(EngineClosedError):
        await mgr.submit(STORE)
    with pytest.raises(EngineClosedError):
        await mgr.wait([0])


# --------------------------------------------------------------------------- hypothesis fuzzing

TYPED = (OffloadError, TypeError, ValueError)  # what an invalid input may raise

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-5, 5), max_size=3),
    st.tuples(st.integers(-2, 2)),
    st.sampled_from([object(), Medium.GPU, Medium.CPU, {}, set(), 1j, b"", ...]),
)
block_ids = st.one_of(
    st.lists(st.integers(0, 40), max_size=6),
    st.lists(st.integers(-(2**65), 2**65), max_size=4),
    st.lists(st.floats(allow_nan=True), max_size=3),
    st.lists(st.booleans(), max_size=3),
    st.sampled_from(
        [
            np.array([1, 2], dtype=np.uint64),
            np.array([2**63 + 1], dtype=np.uint64),
            np.array([[1, 2]]),
            np.array(3),
            np.array([1.0, 2.0]),
            np.array([True]),
            np.array(["1"]),
            np.array([-1], dtype=np.int8),
            np.array([], dtype=np.float32),
            [[1], [2]],
            "12",
            range(3),
        ]
    ),
    junk,
)
counts = st.one_of(st.lists(st.integers(-2, 6), max_size=3), junk)


@st.composite
def specs(draw: st.DrawFn) -> object:
    """Block specs and transfer specs, mostly malformed in one way or another."""

    def side() -> object:
        medium = draw(st.sampled_from(list(Medium)) | junk)
        ids = draw(block_ids)
        kind = draw(st.sampled_from(["cache", "tier", "base", "helper", "junk"]))
        if kind == "cache":
            return CacheBlocks(medium, ids, draw(counts), draw(counts))  # type: ignore[arg-type]
        if kind == "tier":
            return TierBlocks(medium, ids)  # type: ignore[arg-type]
        if kind == "base":
            return BlockSpec(medium, ids)  # type: ignore[arg-type]
        if kind == "helper":
            helper = draw(st.sampled_from([gpu_blocks, npu_blocks, host_cache_blocks]))
            return helper(ids, group_sizes=draw(counts), block_indices=draw(counts))  # type: ignore[arg-type]
        return draw(junk)

    return TransferSpec(side(), side())  # type: ignore[arg-type]


@st.composite
def near_valid(draw: st.DrawFn) -> TransferSpec:
    """Well-formed specs for the fuzz rig's routes that are wrong in what only the engine
    and its handlers can see: counts, ranges, groups, duplicates, directions, media pairs.
    Some are valid."""
    cache_medium = draw(st.sampled_from([Medium.CPU, Medium.GPU, Medium.GPU, Medium.NPU]))
    tier_medium = draw(st.sampled_from([Medium.CPU, Medium.CPU, Medium.CPU, Medium.GPU]))
    ids = draw(st.lists(st.integers(0, 17), max_size=5))
    groups = draw(st.integers(1, 3))
    cuts = sorted(
        draw(st.lists(st.integers(0, len(ids)), min_size=groups - 1, max_size=groups - 1))
    )
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    indices = draw(st.lists(st.integers(0, 5), min_size=groups, max_size=groups))
    cache = CacheBlocks(cache_medium, ids, tuple(sizes), tuple(indices))  # type: ignore[arg-type]
    tier = TierBlocks(tier_medium, draw(st.lists(st.integers(0, 17), max_size=6)))  # type: ignore[arg-type]
    shape = draw(st.sampled_from(["store", "load", "store", "load", "cache-cache", "tier-tier"]))
    if shape == "store":
        return TransferSpec(cache, tier)
    if shape == "load":
        return TransferSpec(tier, cache)
    if shape == "cache-cache":
        return TransferSpec(cache, cache)
    return TransferSpec(tier, tier)


def build(strategy: st.SearchStrategy[object], data: st.DataObject) -> tuple[object, bool]:
    """Draw from ``strategy``; a constructor may refuse, with a typed error only."""
    try:
        return data.draw(strategy), True
    except TYPED:
        return None, False


@pytest.fixture(scope="module")
def fuzz_rig() -> Iterator[tuple[SyncOffloadingEngine, dict[str, TransferSpec]]]:
    """One engine serving every kind of handler: host (CPU->CPU), device store and load on
    the fake runtime (GPU<->CPU), and a fake (NPU->CPU). And one valid spec for each."""
    runtime = FakeRuntime()
    dev_layout = build_layout("groups", runtime.empty, num_blocks=16)
    dev_tier = pinned_host_tier(runtime, dev_layout, 16, factor=2)
    host_layout = build_layout("flash-attention", host_empty, num_blocks=16)
    host_tier = HostTier.for_layout(host_layout, 16, factor=2)
    store, load = make_device_handlers(
        runtime, dev_layout, dev_tier, DeviceHandlerConfig(staging_bytes=4 * dev_layout.slot_bytes)
    )
    handlers = [HostCopyHandler(host_layout, host_tier, workers=2), store, load]
    handlers.append(FakeHandler(Medium.NPU, Medium.CPU))  # type: ignore[arg-type]
    valid = {
        "host": TransferSpec(host_cache_blocks([1, 2]), cpu_blocks([3])),
        "store": TransferSpec(gpu_blocks([1, 2], group_sizes=(1, 1)), cpu_blocks([4, 5])),
        "load": TransferSpec(cpu_blocks([4, 5]), gpu_blocks([6, 7], group_sizes=(1, 1))),
        "fake": TransferSpec(npu_blocks([1]), cpu_blocks([1])),
    }
    engine = SyncOffloadingEngine(handlers, capacity=256)  # type: ignore[arg-type]
    try:
        yield engine, valid
    finally:
        engine.close(timeout=BOUND)
        dev_tier.release()
        runtime.close()


def still_serving(engine: SyncOffloadingEngine, valid: dict[str, TransferSpec]) -> None:
    ids = [engine.submit_nowait(spec) for spec in valid.values()]
    for r in engine.wait(ids, timeout=BOUND):
        assert r.success, r.error


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@pytest.fixture
def fuzz(request: pytest.FixtureRequest) -> settings:
    """200 examples per fuzz test in CI; 3,000 with --run-slow (or OFFLOAD_ENGINE_SLOW=1)."""
    slow = request.config.getoption("--run-slow") or os.environ.get("OFFLOAD_ENGINE_SLOW") == "1"
    return settings(
        max_examples=3000 if slow else 200,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


def test_fuzz_spec_constructors_raise_typed_errors(fuzz: settings) -> None:
    @fuzz
    @given(st.data())
    def check(data: st.DataObject) -> None:
        build(specs(), data)  # anything but a typed error fails the test

    check()


def test_fuzz_submit_refuses_bad_jobs_and_keeps_serving(
    fuzz: settings,
    fuzz_rig: tuple[SyncOffloadingEngine, dict[str, TransferSpec]],
) -> None:
    engine, valid = fuzz_rig

    accepted = [0]

    @fuzz
    @given(st.data())
    def check(data: st.DataObject) -> None:
        spec, ok = build(specs() | near_valid() | near_valid(), data)
        submitted = sum(h.submitted for h in engine.stats().handlers)
        if ok:
            try:
                jid = engine.submit_nowait(spec)  # type: ignore[arg-type]
            except TYPED:
                after = sum(h.submitted for h in engine.stats().handlers)
                assert after == submitted, "a refused job was queued"
            else:  # a valid job (or one only its transfer can refuse): it gets its result
                accepted[0] += 1
                [r] = engine.wait([jid], timeout=BOUND)
                assert r.success or isinstance(r.error, JobFailedError)
        still_serving(engine, valid)

    check()
    assert accepted[0] > 0, "no fuzzed job was valid: the fuzzer never reached a transfer"


def test_fuzz_job_ids_and_timeouts(
    fuzz: settings,
    fuzz_rig: tuple[SyncOffloadingEngine, dict[str, TransferSpec]],
) -> None:
    engine, valid = fuzz_rig
    ids = st.one_of(junk, st.integers(-3, 3), st.just(2**63), st.just(2**63 - 1))
    timeouts = st.one_of(junk, st.floats(-1, 0.01))
    many = st.one_of(junk, st.lists(st.one_of(junk, st.integers(10**12, 10**12 + 3)), max_size=3))
    spec = valid["fake"]

    @fuzz
    @given(jid=ids, timeout=timeouts, wait_ids=many, wait_timeout=timeouts)
    def check(jid: object, timeout: object, wait_ids: object, wait_timeout: object) -> None:
        calls = [
            lambda: engine.submit_nowait(spec, job_id=jid, timeout=timeout),  # type: ignore[arg-type]
            lambda: engine.submit(spec, job_id=jid, wait_timeout=wait_timeout),  # type: ignore[arg-type]
            lambda: engine.cancel(jid),  # type: ignore[arg-type]
            lambda: engine.wait(wait_ids, timeout=wait_timeout),  # type: ignore[arg-type]
            lambda: engine.manager.wait_blocking(wait_ids, timeout=wait_timeout),  # type: ignore[arg-type]
        ]
        accepted, collected = set(), set()
        for call in calls:
            try:
                out = call()
            except (*TYPED, TimeoutError):
                continue
            if isinstance(out, list):
                collected.update(r.job_id for r in out)
            elif isinstance(out, int) and not isinstance(out, bool):
                accepted.add(out)  # a submit took a valid id and timeout
        if accepted - collected:
            engine.wait(sorted(accepted - collected), timeout=BOUND)
        engine.get_finished()
        still_serving(engine, valid)

    check()


def test_fuzz_configs_and_constructors_raise_typed_errors(
    fuzz: settings, fake_runtime: FakeRuntime
) -> None:
    runtime = fake_runtime
    tensors = [runtime.empty((4, 2, 8), torch.bfloat16)]
    layout = KVLayout.from_block_tensors(tensors)
    tier = HostTier.for_layout(layout, 4)
    regions = st.one_of(
        junk,
        st.builds(
            Region,
            st.integers(-1, 2),
            st.integers(-64, 64),
            st.integers(-64, 64),
            st.integers(-8, 64),
        ),
    )

    @fuzz
    @given(a=junk, b=junk, c=junk, d=junk, region=regions, data=st.data())
    def check(
        a: object, b: object, c: object, d: object, region: object, data: st.DataObject
    ) -> None:
        attempts: list[Callable[[], object]] = [
            lambda: OffloadingQueueManager(capacity=a),  # type: ignore[arg-type]
            lambda: OffloadingQueueManager(default_timeout=a),  # type: ignore[arg-type]
            lambda: HostTier(*small(a, b, c)),
            lambda: HostTier(
                4, 64, memory=torch.zeros(d if isinstance(d, int) and 0 <= d < 9 else 3)
            ),
            lambda: HostCopyHandler(layout, tier, workers=a),  # type: ignore[arg-type]
            lambda: HostCopyHandler(layout, tier, close_timeout=a),  # type: ignore[arg-type]
            lambda: HostCopyHandler(a, tier),  # type: ignore[arg-type]
            lambda: DeviceHandlerConfig(
                **{data.draw(st.sampled_from(CONFIG_FIELDS)): a}  # type: ignore[arg-type]
            ),
            lambda: KVLayout(tensors, [[region]], *small(a)),  # type: ignore[arg-type, list-item]
            lambda: KVLayout(tensors, a, 4),  # type: ignore[arg-type]
            lambda: KVLayout(tensors, [a], 4),  # type: ignore[list-item]
            lambda: KVLayout.flash_attention([a, b]),  # type: ignore[list-item]
            lambda: KVLayout.mla(a),  # type: ignore[arg-type]
            lambda: KVLayout.cross_layer(a),  # type: ignore[arg-type]
            lambda: KVLayout.separate_kv(a, b),  # type: ignore[arg-type]
            lambda: KVLayout.combine([layout, a]),  # type: ignore[list-item]
            lambda: HostTier.for_layout(a, 4),  # type: ignore[arg-type]
            lambda: HostTier(4, 64, memory=a),  # type: ignore[arg-type]
            lambda: HostCopyHandler(layout, a),  # type: ignore[arg-type]
            lambda: DeviceCopyHandler(a, layout, tier, direction=Direction.STORE),  # type: ignore[arg-type]
            lambda: DeviceCopyHandler(runtime, layout, tier, direction=a),  # type: ignore[arg-type]
            lambda: DeviceCopyHandler(
                runtime,
                layout,
                tier,
                direction=Direction.STORE,
                config=a,  # type: ignore[arg-type]
            ),
            lambda: pinned_host_tier(runtime, layout, *small(a, b)).release(),  # type: ignore[arg-type]
            lambda: pinned_host_tier(a, layout, 4),  # type: ignore[arg-type]
            lambda: KVLayout(a, [[Region(0, 0, 32, 32)]], 4),  # type: ignore[arg-type]
            lambda: KVLayout.from_block_tensors(a),  # type: ignore[arg-type]
            lambda: FaultyManagerRegistration(a),
        ]
        for attempt in attempts:
            try:
                attempt()
            except TYPED:
                pass

    check()
    # a facade that starts must be closable; a bad one leaves no thread behind
    for kw in ({"capacity": 0}, {"backend": "curio"}, {"default_timeout": -1}, {"capacity": 2}):
        try:
            SyncOffloadingEngine([FakeHandler()], **kw).close()  # type: ignore[arg-type]
        except TYPED:
            pass


def small(*values: object) -> tuple[object, ...]:
    """Fuzzed sizes, except that valid ones stay small (a valid 25 GB tier is not a fuzz
    finding: its allocation fails for want of memory)."""
    return tuple(
        v % 64 if isinstance(v, int) and not isinstance(v, bool) and v > 0 else v for v in values
    )


CONFIG_FIELDS = [
    "strategy",
    "staging_bytes",
    "staging_buffers",
    "dma_min_chunk_bytes",
    "dma_max_descriptors",
    "dma_backlog_bytes",
    "dma_backlog_descriptors",
    "dma_backlog_min_region_bytes",
    "streams",
    "max_inflight",
    "close_timeout",
    "peers",
    "peer_staging_bytes",
    "peer_min_blocks",
]


@pytest.fixture
def fake_runtime() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


def FaultyManagerRegistration(value: object) -> None:
    """Register a handler whose attributes are ``value``: refused with a typed error."""
    fake = FakeHandler()
    for attr in ("max_inflight", "src"):
        bad = FakeHandler()
        setattr(bad, attr, value)
        try:
            OffloadingQueueManager([bad])
        except TYPED:
            continue
    OffloadingQueueManager([fake, value])  # type: ignore[list-item]


def test_fuzz_the_async_api_through_a_portal(fuzz: settings) -> None:
    """``await submit`` and ``await wait`` and ``aclose`` on the engine's own loop."""
    fake = FakeHandler()
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        mgr = OffloadingQueueManager([fake])
        with portal.wrap_async_context_manager(mgr):

            @fuzz
            @given(jid=junk, timeout=junk, ids=junk, data=st.data())
            def check(jid: object, timeout: object, ids: object, data: st.DataObject) -> None:
                spec, _ = build(specs() | junk, data)

                async def calls() -> None:
                    with anyio.fail_after(BOUND):
                        for call in (
                            lambda: mgr.submit(spec, job_id=jid, timeout=timeout),  # type: ignore[arg-type]
                            lambda: mgr.submit(STORE, job_id=jid),  # type: ignore[arg-type]
                            lambda: mgr.wait(ids, timeout=timeout),  # type: ignore[arg-type]
                        ):
                            try:
                                await call()
                            except (*TYPED, TimeoutError):
                                pass
                        try:  # a valid timeout would really close the engine
                            check_wait_timeout(timeout)
                        except TYPED:
                            with pytest.raises(TYPED):
                                await mgr.aclose(timeout=timeout)  # type: ignore[arg-type]
                        for r in mgr.get_finished():
                            assert r.success

                portal.call(calls)
                assert mgr.state == "running", "a fuzzed aclose closed the engine"
                [r] = portal.call(mgr.wait, [mgr.submit_nowait(STORE)])
                assert r.success

            check()


@pytest.mark.parametrize("attr", ["src", "dst"])
@pytest.mark.parametrize("bad", [None, "GPU", 3])
def test_a_handler_without_media_is_refused_with_a_registration_error(
    attr: str, bad: object
) -> None:
    """Regression: building the HandlerRegistrationError's message formatted the handler's
    repr, which formats its media, so an AttributeError escaped instead."""
    handler = FakeHandler()
    setattr(handler, attr, bad)
    with pytest.raises(HandlerRegistrationError, match="must be Medium members"):
        OffloadingQueueManager([handler])


# --------------------------------------------------------------------------- issue 16's classes
#
# Each test below covers one class of defect the black-box probe of issue 16 found, beyond
# the instance pinned in tests/test_hardening.py.


def _buffer(kind: str, values: list[int], strided: bool) -> tuple[object, Callable[[], None]]:
    """An id buffer of ``kind`` holding ``values``, and a function that rewrites it."""
    if strided:
        values = [v for pair in zip(values, values, strict=True) for v in pair]
    if kind.startswith("numpy"):
        arr = np.array(values, dtype=kind.split()[1])
        buf: object = arr[::2] if strided else arr
        return buf, lambda: arr.fill(9)
    if kind.startswith("torch"):
        t = torch.tensor(values, dtype=getattr(torch, kind.split()[1]))
        buf = t[::2] if strided else t
        return buf, lambda: t.fill_(9)
    if kind.startswith("array"):
        a = array.array(kind.split()[1], values)
        if strided:
            return memoryview(a)[::2], lambda: a.__setitem__(
                slice(None), array.array(a.typecode, [9] * len(a))
            )
        return a, lambda: a.__setitem__(slice(None), array.array(a.typecode, [9] * len(a)))
    if kind == "memoryview":
        raw = bytearray(np.array(values, dtype=np.int64).tobytes())
        mv = memoryview(raw).cast("q")
        return (mv[::2] if strided else mv), lambda: raw.__setitem__(
            slice(None), bytes([9]) * len(raw)
        )
    lst = list(values)
    seq = tuple(lst) if kind == "tuple" else lst
    buf = seq[::2] if strided else seq
    return buf, lambda: lst.__setitem__(slice(None), [9] * len(lst))


ID_KINDS = [
    "list",
    "tuple",
    "memoryview",
    *(
        f"numpy {d}"
        for d in ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
    ),
    *(f"torch {d}" for d in ("int64", "int32", "int16", "int8", "uint8")),
    *(f"array {t}" for t in ("q", "l", "i", "h", "b", "Q", "L", "I", "H", "B")),
]
SPEC_BUILDERS: list[Callable[[object], BlockSpec]] = [
    host_cache_blocks,  # type: ignore[list-item]
    gpu_blocks,  # type: ignore[list-item]
    npu_blocks,  # type: ignore[list-item]
    cpu_blocks,  # type: ignore[list-item]
    lambda ids: CacheBlocks(Medium.GPU, ids),  # type: ignore[arg-type]
    lambda ids: TierBlocks(Medium.CPU, ids),  # type: ignore[arg-type]
    lambda ids: BlockSpec(Medium.DISK, ids),  # type: ignore[arg-type]
]


def test_fuzz_specs_never_alias_any_id_buffer(fuzz: settings) -> None:
    """Class of defect 1: a spec that keeps a view of the caller's id buffer changes when
    the caller reuses the buffer. Every accepted buffer kind, strided or not, is copied."""

    @fuzz
    @given(
        kind=st.sampled_from(ID_KINDS),
        values=st.lists(st.integers(0, 100), min_size=1, max_size=8),
        strided=st.booleans(),
        build=st.sampled_from(SPEC_BUILDERS),
    )
    def check(
        kind: str, values: list[int], strided: bool, build: Callable[[object], BlockSpec]
    ) -> None:
        buf, rewrite = _buffer(kind, values, strided)
        try:
            spec = build(buf)
        except TYPED:
            return  # a kind the vocabulary refuses, with a typed error
        assert spec.block_ids.tolist() == values
        rewrite()
        assert spec.block_ids.tolist() == values, f"{kind} aliased: {spec.block_ids}"
        assert not spec.block_ids.flags.writeable

    check()


class _Poker:
    """Calls that take the engine's lock; run from inside the caller's own objects."""

    def __init__(self, engine: SyncOffloadingEngine) -> None:
        self.engine = engine
        self.pokes = 0

    def __call__(self) -> None:
        self.pokes += 1
        self.engine.stats()
        repr(self.engine)
        try:
            self.engine.cancel(10**15)
        except TYPED:
            pass


def hostile_values(poke: Callable[[], None]) -> st.SearchStrategy[object]:
    """Values whose methods call back into the engine (a poke) when the engine uses them."""

    class HostileInt(int):
        def __hash__(self) -> int:
            poke()
            return int.__hash__(self)

        def __eq__(self, other: object) -> bool:
            poke()
            return int.__eq__(self, other)  # type: ignore[no-any-return]

        def __index__(self) -> int:
            poke()
            return int(self)

    class HostileFloat(float):
        def __gt__(self, other: object) -> bool:
            poke()
            return float.__gt__(self, other)  # type: ignore[no-any-return, operator]

        def __add__(self, other: object) -> float:
            poke()
            return float.__add__(self, other)  # type: ignore[no-any-return, operator]

        __radd__ = __add__

        def __float__(self) -> float:
            poke()
            return float.__float__(self)

    def ids_gen(ids: list[int]) -> object:
        def gen() -> Iterator[int]:
            for j in ids:
                poke()
                yield j

        return gen()

    return st.one_of(
        st.integers(0, 3).map(HostileInt),
        st.floats(0.001, 1e12).map(HostileFloat),
        st.lists(st.integers(0, 3), max_size=3).map(ids_gen),
        st.lists(st.integers(0, 3).map(HostileInt), max_size=3),
    )


def _bounded(call: Callable[[], object]) -> object:
    """``call()``, or None if it raised a typed error; fails the test if it hangs."""
    return call_in_thread(lambda: _typed(call), BOUND)


def _typed(call: Callable[[], object]) -> object:
    try:
        return call()
    except (*TYPED, TimeoutError):
        return None


def test_fuzz_caller_code_never_runs_under_the_engine_lock(
    fuzz: settings,
    fuzz_rig: tuple[SyncOffloadingEngine, dict[str, TransferSpec]],
) -> None:
    """Class of defect 2: ids, id iterables and timeouts whose methods call back into the
    engine. Every call returns (or raises a typed error) and the engine keeps serving."""
    engine, valid = fuzz_rig
    poke = _Poker(engine)
    spec = valid["fake"]

    @fuzz
    @given(a=hostile_values(poke), b=hostile_values(poke), c=hostile_values(poke))
    def check(a: object, b: object, c: object) -> None:
        accepted: list[object] = []
        for call in (
            lambda: engine.wait(a, timeout=0.01),  # type: ignore[arg-type]
            lambda: engine.manager.wait_blocking(b, timeout=c),  # type: ignore[arg-type]
            lambda: accepted.append(engine.submit_nowait(spec, job_id=a, timeout=b)),  # type: ignore[arg-type]
            lambda: accepted.append(engine.submit(spec, timeout=c, wait_timeout=b)),  # type: ignore[arg-type]
            lambda: engine.cancel(b),  # type: ignore[arg-type]
        ):
            _bounded(call)
        ids = [j for j in accepted if isinstance(j, int)]
        if ids:
            _bounded(lambda: engine.wait([int(j) for j in ids], timeout=BOUND))
        still_serving(engine, valid)

    check()
    assert poke.pokes > 0, "no hostile value was ever used"


class _StartRaises(FakeHandler):
    def __init__(self, error: BaseException, src: Medium) -> None:
        super().__init__(src, Medium.DISK)
        self.error = error

    def start(self, context: object) -> None:  # type: ignore[override]
        raise self.error


class _Stop(BaseException):
    pass


def test_fuzz_registration_on_a_running_engine_rolls_back(fuzz: settings) -> None:
    """Class of defect 3: a handler whose ``start`` raises (any exception, on any pair)
    leaves nothing registered: its pair gets NoHandlerError and close does not hang, and a
    working handler may take the pair afterwards."""
    with anyio.from_thread.start_blocking_portal("trio") as portal:
        mgr = OffloadingQueueManager([FakeHandler()])
        with portal.wrap_async_context_manager(mgr):
            registered: set[Medium] = set()

            @fuzz
            @given(
                src=st.sampled_from([Medium.NPU, Medium.REMOTE, Medium.DISK]),
                error=st.sampled_from([RuntimeError("x"), OSError(5, "io"), _Stop(), KeyError(1)]),
                then_works=st.booleans(),
            )
            def check(src: Medium, error: BaseException, then_works: bool) -> None:
                spec = TransferSpec(BlockSpec(src, [1]), BlockSpec(Medium.DISK, [1]))

                async def attempt() -> None:
                    with pytest.raises(type(error)):
                        mgr.register(_StartRaises(error, src))

                if src in registered:
                    with pytest.raises(HandlerRegistrationError):
                        portal.call(attempt)
                    return
                portal.call(attempt)
                with pytest.raises(NoHandlerError):
                    mgr.submit_nowait(spec)
                if then_works:

                    async def register() -> None:
                        mgr.register(FakeHandler(src, Medium.DISK))

                    portal.call(register)
                    registered.add(src)
                    [r] = portal.call(mgr.wait, [mgr.submit_nowait(spec)])
                    assert r.success

            check()
        assert mgr.closed


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_fuzz_concurrent_closes_in_every_state_return(fuzz: settings, backend: str) -> None:
    """Classes of defects 4 and 5: one to three concurrent ``aclose`` calls, on an engine
    never started, running, or broken by a crashed task, with handlers whose close
    awaits: every call returns within its bound, exactly one returns the results."""

    class SlowClose(FakeHandler):
        async def aclose(self) -> None:
            await anyio.sleep(0)
            await super().aclose()

    class Crashes(FakeHandler):
        def launch(self, job: object) -> None:  # type: ignore[override]
            raise _Stop("crash")

    @fuzz
    @given(
        state=st.sampled_from(["new", "running", "broken"]),
        closers=st.integers(1, 3),
        jobs=st.integers(0, 4),
        timeout=st.sampled_from([None, 0.0, 0.01, math.inf]),
    )
    def check(state: str, closers: int, jobs: int, timeout: float | None) -> None:
        async def scenario() -> None:
            # with no close timeout, the jobs must finish by themselves
            manual = timeout is not None and math.isfinite(timeout)
            handlers = [SlowClose(manual=manual), Crashes(Medium.NPU, Medium.CPU)]
            mgr = OffloadingQueueManager(handlers)
            submitted: list[int] = []
            out: list[list[object]] = []

            async def close() -> None:
                out.append(await mgr.aclose(timeout=timeout))  # type: ignore[arg-type]

            with anyio.fail_after(BOUND):  # outermost: the manager's scopes nest inside
                if state != "new":
                    await mgr.__aenter__()
                    submitted += [mgr.submit_nowait(STORE) for _ in range(jobs)]
                if state == "broken":
                    npu = TransferSpec(npu_blocks([1]), cpu_blocks([1]))
                    jid = mgr.submit_nowait(npu)
                    [r] = await mgr.wait([jid])
                    assert isinstance(r.error, JobFailedError)
                    with pytest.raises(EngineBrokenError):
                        mgr.submit_nowait(STORE)
                async with anyio.create_task_group() as tg:
                    for _ in range(closers):
                        tg.start_soon(close)
                if state != "new":
                    await mgr.__aexit__(None, None, None)
            assert mgr.closed
            assert sum(1 for o in out if o) <= 1
            assert_exactly_once(submitted, [r for o in out for r in o])  # type: ignore[misc]

        anyio.run(scenario, backend=backend)

    check()


def test_fuzz_handler_ownership(fuzz: settings) -> None:
    """Class of defect 7: a handler is accepted only while no live engine holds it and no
    engine has closed it, whatever the sequence of engines built, closed and dropped."""

    @fuzz
    @given(
        ops=st.lists(
            st.tuples(
                st.sampled_from(["facade", "manager", "close", "drop"]),
                st.sets(st.integers(0, 2), min_size=1),
                st.integers(0, 5),
            ),
            max_size=8,
        )
    )
    def check(ops: list[tuple[str, set[int], int]]) -> None:
        pool = [FakeHandler(m, Medium.CPU) for m in (Medium.GPU, Medium.NPU, Medium.DISK)]
        held: dict[int, int] = {}  # handler -> the slot of the engine holding it
        retired: set[int] = set()
        slots: list[tuple[object, set[int]]] = []
        try:
            for op, picked, which in ops:
                if op in ("facade", "manager"):
                    free = all(h not in held and h not in retired for h in picked)
                    handlers = [pool[h] for h in sorted(picked)]
                    try:
                        engine: object = (
                            SyncOffloadingEngine(handlers)
                            if op == "facade"
                            else OffloadingQueueManager(handlers)
                        )
                    except HandlerRegistrationError:
                        assert not free, "a free handler was refused"
                        continue
                    assert free, "a held or closed handler was accepted"
                    held.update((h, len(slots)) for h in picked)
                    slots.append((engine, picked))
                    continue
                if not slots:
                    continue
                k = which % len(slots)
                engine, owned = slots[k]
                mine = {h for h in owned if held.get(h) == k}
                if op == "close":
                    if isinstance(engine, SyncOffloadingEngine):
                        engine.close()
                    elif isinstance(engine, OffloadingQueueManager):
                        anyio.run(engine.aclose)
                    retired |= mine
                elif isinstance(engine, OffloadingQueueManager) and not engine.closed:
                    slots[k] = (None, owned)  # dropped without ever starting
                    del engine
                    gc.collect()
                else:
                    continue
                for h in mine:
                    del held[h]
        finally:
            for engine, _ in slots:
                if isinstance(engine, SyncOffloadingEngine):
                    engine.close()

    check()


HUGE = st.sampled_from([math.inf, 1e9, 1e10, 1e300, sys.float_info.max, 10**400, 2**63])


def test_fuzz_huge_and_infinite_timeouts_mean_no_bound(
    fuzz: settings,
    fuzz_rig: tuple[SyncOffloadingEngine, dict[str, TransferSpec]],
) -> None:
    """Class of defect 8: every timeout argument takes inf and huge values (floats and
    ints beyond a float) as "no bound": no OverflowError, and the jobs run to the end."""
    engine, valid = fuzz_rig
    spec = valid["host"]

    @fuzz
    @given(job=HUGE, wait=HUGE, room=HUGE, close=HUGE)
    def check(job: float, wait: float, room: float, close: float) -> None:
        ids = [
            engine.submit_nowait(spec, timeout=job),
            engine.submit(spec, timeout=job, wait_timeout=room),
        ]
        results = _bounded(lambda: engine.wait(ids, timeout=wait))
        assert isinstance(results, list) and all(r.success for r in results), results
        results = _bounded(
            lambda: engine.manager.wait_blocking([engine.submit_nowait(spec)], timeout=wait)
        )
        assert isinstance(results, list) and all(r.success for r in results), results
        assert check_wait_timeout(close) is None

    check()
    with SyncOffloadingEngine([FakeHandler()], default_timeout=math.inf) as inf_engine:
        assert [r.success for r in inf_engine.wait([inf_engine.submit_nowait(STORE)])] == [True]


class _CallsFromItsWorker(HostCopyHandler):
    """Runs ``call(engine)`` inside ``execute``, on the handler's own worker thread."""

    engine: SyncOffloadingEngine | None = None
    call: Callable[[SyncOffloadingEngine], object] = staticmethod(lambda e: None)  # type: ignore[assignment]
    outcome: object = None

    def execute(self, job: Any) -> int:
        assert self.engine is not None
        try:
            self.outcome = self.call(self.engine)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.outcome = exc
        return super().execute(job)


def test_fuzz_calls_from_a_handler_thread_are_bounded(fuzz: settings) -> None:
    """Class of defect 8: calls made from inside a handler's worker thread. ``close`` (any
    timeout) is refused with WrongThreadError at once; the non-blocking calls work."""
    host_layout = build_layout("flash-attention", host_empty, num_blocks=8)
    tier = HostTier.for_layout(host_layout, 8)
    spec = TransferSpec(host_cache_blocks([1]), cpu_blocks([2]))
    closes: list[Callable[[SyncOffloadingEngine], object]] = [
        lambda e: e.close(),
        lambda e: e.close(timeout=0.5),
        lambda e: e.close(timeout=0),
        lambda e: e.close(cancel_queued=True, timeout=math.inf),
        lambda e: e.__exit__(None, None, None),
    ]
    others: list[Callable[[SyncOffloadingEngine], object]] = [
        lambda e: e.stats(),
        lambda e: e.get_finished(),
        lambda e: e.cancel(10**12),
        repr,
    ]

    @fuzz
    @given(call=st.sampled_from(closes + others), workers=st.integers(1, 3))
    def check(call: Callable[[SyncOffloadingEngine], object], workers: int) -> None:
        handler = _CallsFromItsWorker(host_layout, tier, workers=workers)
        handler.call = call  # type: ignore[assignment]
        engine = SyncOffloadingEngine([handler])
        handler.engine = engine
        try:
            results = _bounded(lambda: engine.wait([engine.submit_nowait(spec)], timeout=BOUND))
            assert isinstance(results, list) and results[0].success
            if call in closes:
                assert isinstance(handler.outcome, WrongThreadError), handler.outcome
                assert not engine.closed
            else:
                assert not isinstance(handler.outcome, BaseException) or isinstance(
                    handler.outcome, TYPED
                ), handler.outcome
        finally:
            engine.close(timeout=BOUND)

    check()
    tier.release()


def test_fuzz_layouts_tiers_and_facade_arguments_raise_typed_errors(fuzz: settings) -> None:
    """Class of defect 9: shapes with zero or missing dimensions, bare tensors where
    sequences belong, sizes past any host's memory, and non-number timeouts all get a
    typed error that names the argument."""
    shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
    tensor = shapes.map(torch.zeros)
    layout = KVLayout.from_block_tensors([torch.zeros(4, 8)])

    @fuzz
    @given(
        t=tensor,
        u=tensor,
        many=st.lists(tensor, max_size=3),
        blocks=st.integers(2**36, 2**80),
        factor=st.integers(1, 2**20),
        timeout=junk,
    )
    def check(
        t: torch.Tensor,
        u: torch.Tensor,
        many: list[torch.Tensor],
        blocks: int,
        factor: int,
        timeout: object,
    ) -> None:
        for attempt in (
            lambda: KVLayout.from_block_tensors([t]),
            lambda: KVLayout.from_block_tensors(many),
            lambda: KVLayout.separate_kv(t, u),  # type: ignore[arg-type]
            lambda: KVLayout.separate_kv([t], [u]),
            lambda: KVLayout.separate_kv(many, many),
            lambda: KVLayout.flash_attention(many),
            lambda: KVLayout.mla(many),
            lambda: KVLayout.cross_layer(t),
            lambda: KVLayout.flashinfer([t, u]),
        ):
            try:
                attempt()
            except TYPED:
                pass
        with pytest.raises(TypeError):
            KVLayout.separate_kv(t, u)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="num_blocks"):
            HostTier.for_layout(layout, blocks, factor=factor)
        try:
            OffloadingQueueManager(default_timeout=timeout)  # type: ignore[arg-type]
        except (TypeError, ConfigError) as exc:
            assert "default_timeout" in str(exc)

    check()


def test_fuzz_every_public_await_is_a_checkpoint(fuzz: settings) -> None:
    """The checkpoint rule: on trio, each public ``await`` executes a checkpoint, whether
    it waits, finds its result ready, or fails at once."""
    import trio.testing

    fake = FakeHandler()
    with anyio.from_thread.start_blocking_portal("trio") as portal:
        mgr = OffloadingQueueManager([fake])
        with portal.wrap_async_context_manager(mgr):

            @fuzz
            @given(
                ops=st.lists(
                    st.sampled_from(["wait-ready", "wait-unknown", "wait-junk", "submit", "next"]),
                    min_size=1,
                    max_size=6,
                ),
                junk_ids=junk,
            )
            def check(ops: list[str], junk_ids: object) -> None:
                async def run() -> None:
                    for op in ops:
                        with trio.testing.assert_checkpoints():
                            try:
                                if op == "wait-ready":
                                    j = mgr.submit_nowait(STORE)
                                    await mgr.wait([j])
                                    k = mgr.submit_nowait(STORE)
                                    await mgr.wait([k])  # k's result may be in: still yields
                                elif op == "wait-unknown":
                                    await mgr.wait([10**12])
                                elif op == "wait-junk":
                                    await mgr.wait(junk_ids)  # type: ignore[arg-type]
                                elif op == "submit":
                                    await mgr.wait([await mgr.submit(STORE)])
                                else:
                                    mgr.submit_nowait(STORE)
                                    await mgr.results().__anext__()
                            except TYPED:
                                pass
                    mgr.get_finished()

                portal.call(run)

            check()


# --------------------------------------------------------------------------- the vLLM adapter

CONFIG_KEYS = [
    "cpu_bytes_to_use",
    "blocks_per_chunk",
    "block_size",
    "eviction_policy",
    "cache_policy_module_path",
    "store_threshold",
    "max_tracker_size",
    "offload_prompt_only",
    "canonical_layout",
    "strategy",
    "staging_bytes",
    "job_timeout_s",
    "queue_capacity",
    "host_workers",
    "stats_path",
]
config_values = st.one_of(
    junk,
    st.text(max_size=8),
    st.sampled_from(["4e9", "1_000", " 7 ", "dma", "{rank}", "{rank.x}", "{rank[0]}", "{0}"]),
    st.sampled_from(["{", "}", "{rank!z}", "{rank:q}", "1" * 5000, "nan", "-inf", "1e400"]),
    st.floats(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def test_fuzz_vllm_config_raises_only_config_errors(fuzz: settings) -> None:
    """``kv_connector_extra_config`` is untyped JSON from the user: any value of any key
    gives a parsed config or one ConfigError, never another exception."""

    @fuzz
    @given(
        extra=st.dictionaries(
            st.sampled_from(CONFIG_KEYS) | st.text(max_size=4), config_values, max_size=6
        ),
        cpu=st.integers(1, 2**40),
        bpc=st.none() | junk,
        mapping=st.booleans(),
    )
    def check(extra: dict[str, object], cpu: int, bpc: object, mapping: bool) -> None:
        if "cpu_bytes_to_use" not in extra and mapping:
            extra = {**extra, "cpu_bytes_to_use": cpu}
        try:
            parse_extra_config(extra if mapping else list(extra), blocks_per_chunk=bpc)  # type: ignore[arg-type]
        except ConfigError:
            pass

    check()


class _Pair(FakeHandler):
    """A fake that moves nothing and completes at once, for the bridge's GPU routes."""


def _bridge() -> EngineBridge:
    engine = SyncOffloadingEngine(
        [_Pair(Medium.GPU, Medium.CPU), _Pair(Medium.CPU, Medium.GPU)], capacity=64
    )
    log = logging.getLogger("offload_engine.fuzz_bridge")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    return EngineBridge(engine, Medium.GPU, log=log)


def test_fuzz_vllm_bridge_takes_any_call_and_delivers_each_job_once(fuzz: settings) -> None:
    """The bridge is vLLM's boundary: junk ids, groups, indices and job ids give False (a
    logged, typed refusal) or a typed error, never a crash of its bookkeeping, and every
    job it accepted comes out of ``get_finished`` exactly once."""
    ids = st.one_of(
        st.lists(st.integers(0, 8), max_size=3),
        st.lists(st.integers(0, 8), max_size=3).map(np.array),
        st.lists(st.integers(0, 8), max_size=3).map(lambda v: torch.tensor(v, dtype=torch.long)),
        block_ids,
    )
    call = st.one_of(
        st.tuples(
            st.sampled_from(["store", "load"]),
            st.one_of(st.integers(0, 20), junk),
            ids,
            st.one_of(st.lists(st.integers(-1, 3), max_size=2), junk),
            st.one_of(st.lists(st.integers(-1, 3), max_size=2), junk),
            ids,
        ),
        st.tuples(st.just("wait"), st.one_of(st.lists(st.integers(0, 20), max_size=4), junk)),
        st.tuples(st.just("drain")),
    )

    @fuzz
    @given(calls=st.lists(call, max_size=12))
    def check(calls: list[tuple[Any, ...]]) -> None:
        bridge = _bridge()
        accepted: list[int] = []
        delivered: list[TransferResult] = []
        try:
            for c in calls:
                kind = c[0]
                if kind in ("store", "load"):
                    _, jid, cache, sizes, idx, tier = c
                    submit = bridge.submit_store if kind == "store" else bridge.submit_load
                    args = (
                        (jid, cache, sizes, idx, tier)
                        if kind == "store"
                        else (jid, tier, cache, sizes, idx)
                    )
                    ok = _typed(lambda submit=submit, args=args: submit(*args))
                    if ok is True:
                        accepted.append(jid)
                    else:
                        assert ok in (False, None), ok
                elif kind == "wait":
                    _bounded(lambda c=c: bridge.wait(c[1]))
                else:
                    delivered += bridge.get_finished()
            _bounded(lambda: bridge.wait(list(accepted)))
            delivered += bridge.get_finished()
            assert bridge.live_jobs == 0 and bridge.stashed_results == 0
            counts = collections.Counter(r.job_id for r in delivered)
            assert counts == collections.Counter(accepted), (counts, accepted)
        finally:
            bridge.shutdown()

    check()


def test_a_bridge_refusal_with_unsized_ids_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the bridge fuzzer: the refusal's log line called ``len()`` on the ids, so
    ids without a length turned a logged refusal into a TypeError."""
    bridge = _bridge()
    try:
        with caplog.at_level(logging.ERROR, logger="offload_engine.fuzz_bridge"):
            bridge._log.propagate = True
            assert bridge.submit_store(1, 5, [1], [0], [1]) is False  # type: ignore[arg-type]
            assert bridge.submit_load(2, None, iter([1]), [1], [0]) is False  # type: ignore[arg-type]
            assert bridge.submit_store(3, [1], 7, [0], [1]) is False  # type: ignore[arg-type]
        assert "refused" in caplog.text
        # also found by it: a job id of None was passed on, the engine picked an id, and
        # the bridge recorded None as live forever
        for bad in (None, True, -1, "3"):
            with pytest.raises((TypeError, ValueError)):
                bridge.submit_store(bad, [1], [1], [0], [1])  # type: ignore[arg-type]
        assert bridge.live_jobs == 0
    finally:
        bridge.shutdown()
