"""Fuzzing the public entry points with invalid values.

Every invalid input gets a typed error (an ``OffloadError`` subclass, or ``TypeError`` /
``ValueError`` where documented), never a crash or a hang, and the engine keeps serving valid
jobs afterwards.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator

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
    EngineClosedError,
    EngineNotStartedError,
    HandlerRegistrationError,
    HostCopyHandler,
    HostTier,
    JobFailedError,
    KVLayout,
    Medium,
    OffloadError,
    OffloadingQueueManager,
    Region,
    SyncOffloadingEngine,
    TierBlocks,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
    npu_blocks,
)
from offload_engine.completions import check_wait_timeout
from offload_engine.handlers.device import (
    DeviceCopyHandler,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.testing import FakeHandler, FakeRuntime, assert_exactly_once, build_layout
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
    "streams",
    "max_inflight",
    "close_timeout",
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
