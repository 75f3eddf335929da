"""``EngineRemoteTier`` driven through vLLM's ``SecondaryTierManager`` API on a memoryview,
as vLLM's tiering manager drives it: two instances (two primary tiers) share one real server."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

with warnings.catch_warnings():
    # importing vLLM's tiering layer imports torch modules that warn at import time
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
    pytest.importorskip("vllm.v1.kv_offload.base")
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadKey,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

    from offload_engine.connectors.vllm import EngineRemoteTier

from offload_engine import ConfigError
from tests.remote.conftest import Backend

pytestmark = pytest.mark.vllm

ROWS, ROW_BYTES = 16, 32 << 10


def spec(model: str = "tiny-llama") -> SimpleNamespace:
    """The parts of vLLM's OffloadingSpec the tier reads (vLLM's FileMapper digest)."""
    parallel = SimpleNamespace(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        is_parallelism_agnostic=True,
    )  # fmt: skip
    config = SimpleNamespace(
        model=SimpleNamespace(name=model, dtype="float32;offload-engine-slots-v1"),
        cache=SimpleNamespace(tokens_per_hash=16),
        groups=(SimpleNamespace(tokens_per_block=16, layer_names=("l0", "l1")),),
        parallel=parallel,
        canonical_layout=False,
        replicated_layout=False,
        kv_cache_layout=None,
    )
    return SimpleNamespace(config=config, blocks_per_chunk=1)


def primary(seed: int) -> tuple[np.ndarray, memoryview]:
    rows = np.random.default_rng(seed).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    return rows, memoryview(rows)


def tier(backend: Backend, view: memoryview, model: str = "tiny-llama") -> EngineRemoteTier:
    if backend.name == "redis":
        where = {"url": backend.server.url}  # type: ignore[union-attr]
    else:
        where = {"master": backend.server.address, "segment_bytes": 64 << 20}  # type: ignore[union-attr]
    return EngineRemoteTier(spec(model), view, "remote", backend=backend.name, **where)  # type: ignore[arg-type]


@pytest.fixture
def ctx() -> ReqContext:
    return ReqContext(req_id="req-1")


def keys(n: int) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(32, "little"), 0) for i in range(n)]


def job(job_id: int, ks: list[OffloadKey], chunks: list[int], ctx: ReqContext) -> TransferJob:
    return TransferJob(job_id, ks, np.array(chunks, dtype=np.int64), False, ctx)


def finish(t: EngineRemoteTier) -> dict[int, JobResult]:
    """As vLLM's reset_cache does: drain, then collect."""
    t.drain_jobs()
    return {r.job_id: r for r in t.get_finished_jobs()}


def settle(t: EngineRemoteTier, key: OffloadKey, ctx: ReqContext) -> LookupResult:
    """Step the scheduler until the lookup resolves (RETRY while it is in flight)."""
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    deadline = time.monotonic() + 30
    while (r := t.lookup(key, ctx)) is LookupResult.RETRY:
        assert time.monotonic() < deadline, "a lookup never resolved"
        t.on_schedule_end(end)
        time.sleep(0.005)  # one scheduler step
    return r


@pytest.fixture
def two(
    backend: Backend,
) -> Iterator[tuple[EngineRemoteTier, EngineRemoteTier, np.ndarray, np.ndarray]]:
    a_rows, a_view = primary(1)
    b_rows, b_view = primary(2)
    a, b = tier(backend, a_view), tier(backend, b_view)
    try:
        yield a, b, a_rows, b_rows
    finally:
        a.shutdown()
        b.shutdown()
        a.shutdown()  # idempotent


def test_instance_b_loads_what_instance_a_stored(two: tuple, ctx: ReqContext) -> None:
    a, b, a_rows, b_rows = two
    ks = keys(6)
    first = b.lookup(ks[0], ctx)
    assert first is LookupResult.RETRY  # in flight, never a blocking call
    a.submit_store(job(1, ks, [0, 1, 2, 3, 4, 5], ctx))
    assert finish(a)[1].success
    # b's first probe may have run before a stored: a new request probes again
    b.on_request_finished(ctx)
    ctx2 = ReqContext(req_id="req-2")
    assert settle(b, ks[0], ctx2) is LookupResult.HIT
    assert settle(b, make_offload_key(b"\xff" * 32, 0), ctx2) is LookupResult.MISS
    b.submit_load(job(7, ks, [10, 11, 12, 13, 14, 15], ctx2))
    [r] = finish(b).values()
    assert r.success and r.job_id == 7 and r.transfer_bytes == 6 * ROW_BYTES
    assert np.array_equal(b_rows[10:16], a_rows[0:6])


def test_partial_load_reports_loaded_keys_and_marks_the_rest_missed(
    two: tuple, ctx: ReqContext
) -> None:
    a, b, a_rows, b_rows = two
    ks = keys(4)
    a.submit_store(job(1, ks, [0, 1, 2, 3], ctx))
    assert finish(a)[1].success
    assert all(settle(b, k, ctx) is LookupResult.HIT for k in ks)
    b.remote.store().remove(b.remote.names(ks[2:]))  # evicted after the lookup said HIT
    b.submit_load(job(2, ks, [4, 5, 6, 7], ctx))
    r = finish(b)[2]
    assert not r.success
    assert r.successful_keys is not None and set(r.successful_keys) == set(ks[:2])
    assert np.array_equal(b_rows[4:6], a_rows[0:2])
    # the missed keys are cached as misses, so the scheduler stops promoting them
    assert b.lookup(ks[2], ctx) is LookupResult.MISS
    assert b.lookup(ks[0], ctx) is LookupResult.HIT


def test_a_bad_job_is_a_failed_result_not_a_raise(two: tuple, ctx: ReqContext) -> None:
    a, _b, _, _ = two
    a.submit_store(job(3, keys(2), [0, ROWS + 5], ctx))  # a chunk outside the primary tier
    assert not a.get_finished_jobs().__iter__().__next__().success
    assert not a.has_pending_work()


def test_options_are_checked_at_the_boundary(redis_backend: Backend) -> None:
    _, view = primary(0)
    with pytest.raises(ConfigError, match="backend"):
        EngineRemoteTier(spec(), view, "remote", backend="memcached")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="url"):
        EngineRemoteTier(spec(), view, "remote", backend="redis")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="password_env"):
        EngineRemoteTier(
            spec(), view, "remote", backend="redis",  # type: ignore[arg-type]
            url=redis_backend.server.url, password_env="OE_TEST_UNSET_VARIABLE",  # type: ignore[union-attr]
        )  # fmt: skip
