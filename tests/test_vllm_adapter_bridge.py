"""The worker core: vLLM's submit/get_finished/wait/shutdown over a real engine.

Every job's result must reach vLLM exactly once, whether the engine's
``get_finished`` or the adapter's ``wait`` collected it; refusals and failures
are logged with their typed error, never swallowed into a bare bool.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from offload_engine import (
    EngineClosedError,
    LayoutError,
    Medium,
    SyncOffloadingEngine,
    TransferResult,
)
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.connectors.vllm.build import build_bridge
from offload_engine.connectors.vllm.config import parse_extra_config
from offload_engine.connectors.vllm.testing import (
    FakeCanonicalKVCaches,
    fake_canonical_kv_caches,
    page_bytes,
)
from offload_engine.testing import FakeHandler


class CpuPlatform:
    device_type = "cpu"


def make_bridge(
    kv: FakeCanonicalKVCaches, num_tier_blocks: int, factor: int = 1, **extra: object
) -> EngineBridge:
    config = parse_extra_config({"cpu_bytes_to_use": 1 << 20, **extra}, blocks_per_chunk=factor)
    return build_bridge(kv, CpuPlatform(), config, num_tier_blocks)


def ids(results: list[TransferResult]) -> list[int]:
    return [r.job_id for r in results]


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_store_then_load_elsewhere_is_bit_exact(factor: int) -> None:
    rng = np.random.default_rng(factor)
    kv = fake_canonical_kv_caches(num_blocks=48, groups=(((0, 240), (1, 256)), ((2, 160),)))
    bridge = make_bridge(kv, num_tier_blocks=32, factor=factor)
    try:
        job = 0
        for _ in range(4):
            # one run of n blocks per group, starting at logical index `first`
            n, first = int(rng.integers(1, 9)), int(rng.integers(0, 9))
            src = rng.choice(24, size=2 * n, replace=False)  # blocks 0..23 hold the originals
            dst = rng.choice(np.arange(24, 48), size=2 * n, replace=False)
            chunks = 2 * -(-(n + first % factor) // factor)
            tier = rng.choice(32, size=chunks, replace=False)
            want = [page_bytes(kv, 0, int(b)) for b in src[:n]] + [
                page_bytes(kv, 1, int(b)) for b in src[n:]
            ]
            assert bridge.submit_store(job, src, [n, n], [first, first], tier)
            assert bridge.submit_load(job + 1, tier, dst, [n, n], [first, first])
            bridge.wait({job + 1})  # stores and loads run in order: both done
            done = bridge.get_finished()
            assert sorted(ids(done)) == [job, job + 1]
            assert all(r.success for r in done)
            got = [page_bytes(kv, 0, int(b)) for b in dst[:n]] + [
                page_bytes(kv, 1, int(b)) for b in dst[n:]
            ]
            assert got == want
            job += 2
    finally:
        bridge.shutdown()


def test_waited_results_come_out_of_the_next_get_finished_exactly_once() -> None:
    kv = fake_canonical_kv_caches(num_blocks=16)
    bridge = make_bridge(kv, num_tier_blocks=16)
    try:
        for j in range(6):
            assert bridge.submit_store(j, [j], [1, 0], [0, 0], [j])
        # 99 was never submitted here (vLLM flushes ids of other workers, stale ids...)
        bridge.wait([1, 3, 99])
        assert bridge.stashed_results == 2
        # the handler delivers in launch order, so once 5 is in, 0, 2 and 4 are too
        bridge.wait([5])
        assert bridge.live_jobs == 3
        first = bridge.get_finished()
        assert ids(first)[:3] == [1, 3, 5]  # stashed ones first
        assert sorted(ids(first)) == list(range(6))
        assert all(r.success for r in first)
        assert bridge.get_finished() == []
        # ids already handed out are no longer live: waiting on them is a no-op
        bridge.wait([0, 1, 5])
        assert bridge.get_finished() == []
        assert bridge.live_jobs == 0
        assert bridge.stashed_results == 0
        stats = bridge.stats()["adapter"]
        assert stats["results_delivered"] == stats["stores_submitted"] == 6
        assert stats["waited_jobs"] == 3
    finally:
        bridge.shutdown()


def test_interleaved_waits_and_polls_deliver_each_result_once() -> None:
    rng = np.random.default_rng(11)
    kv = fake_canonical_kv_caches(num_blocks=64, groups=(((0, 256),),))
    bridge = make_bridge(kv, num_tier_blocks=64)
    delivered: list[int] = []
    submitted: list[int] = []
    try:
        for step in range(40):
            for _ in range(int(rng.integers(0, 4))):
                j = len(submitted)
                b = int(rng.integers(0, 64))
                assert bridge.submit_store(j, [b], [1], [0], [j % 64])
                submitted.append(j)
            if step % 3 == 0 and submitted:
                pick = rng.choice(len(submitted), size=min(3, len(submitted)), replace=False)
                bridge.wait({submitted[int(i)] for i in pick} | {10_000 + step})
            delivered += ids(bridge.get_finished())
        bridge.wait(submitted)
        delivered += ids(bridge.get_finished())
    finally:
        bridge.shutdown()
    assert sorted(delivered) == submitted  # none lost, none twice


def test_refused_submits_are_logged_with_their_typed_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = fake_canonical_kv_caches(num_blocks=8)
    bridge = make_bridge(kv, num_tier_blocks=4)
    caplog.set_level(logging.ERROR, logger="offload_engine.connectors.vllm.bridge")
    try:
        assert not bridge.submit_store(7, [1, 2], [2, 0], [0, 0], [1, 9])
        assert "store job 7" in caplog.text
        assert "InvalidBlockIdsError: tier block id 9 is out of range" in caplog.text
        assert not bridge.submit_load(8, [0], [1, 2], [3, 0], [0, 0])
        assert "load job 8" in caplog.text
        assert "InvalidTransferError: group_sizes (3, 0) sum to 3" in caplog.text
        assert not bridge.submit_load(9, [0, 1], [1], [1, 0], [0, 0])
        assert "BlockCountMismatchError" in caplog.text
        assert bridge.submit_store(10, [1], [1, 0], [0, 0], [0])
        assert not bridge.submit_store(10, [2], [1, 0], [0, 0], [1])  # still live
        assert "DuplicateJobIdError" in caplog.text
        assert bridge.stats()["adapter"]["submits_refused"] == 4
        bridge.wait([10])
        assert ids(bridge.get_finished()) == [10]
    finally:
        bridge.shutdown()


def test_queue_full_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    engine = SyncOffloadingEngine([FakeHandler(Medium.CPU, Medium.CPU, latency=1.0)], capacity=1)
    bridge = EngineBridge(engine, Medium.CPU)
    caplog.set_level(logging.ERROR, logger="offload_engine.connectors.vllm.bridge")
    try:
        assert bridge.submit_store(0, [0], [1], [0], [0])
        assert not bridge.submit_store(1, [1], [1], [0], [1])
        assert "QueueFullError" in caplog.text
        bridge.wait([0, 1])
        assert ids(bridge.get_finished()) == [0]
    finally:
        bridge.shutdown()


def test_failed_results_are_delivered_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    engine = SyncOffloadingEngine([FakeHandler(Medium.CPU, Medium.CPU, fail={2})])
    bridge = EngineBridge(engine, Medium.CPU)
    caplog.set_level(logging.ERROR, logger="offload_engine.connectors.vllm.bridge")
    try:
        for j in range(4):
            assert bridge.submit_load(j, [j], [j], [1], [0])
        bridge.wait([1, 3])
        results = {r.job_id: r for r in bridge.get_finished()}
        assert sorted(results) == [0, 1, 2, 3]
        assert [results[j].success for j in range(4)] == [True, True, False, True]
        assert "load job 2 failed" in caplog.text
        assert "TransferError" in caplog.text
        assert bridge.stats()["adapter"]["failures_delivered"] == 1
    finally:
        bridge.shutdown()


def test_the_stats_say_where_each_directions_job_time_went() -> None:
    """Submit to done, and done to collected: a load collected as soon as it is done
    waited little; loads left uncollected for a while show that wait, by ``wait`` and
    by ``get_finished`` alike; stores are counted apart."""
    engine = SyncOffloadingEngine([FakeHandler(Medium.CPU, Medium.CPU, latency=0.02)])
    bridge = EngineBridge(engine, Medium.CPU)
    try:
        assert bridge.submit_load(0, [0], [0], [1], [0])
        bridge.wait([0])
        assert ids(bridge.get_finished()) == [0]
        prompt = bridge.stats()["adapter"]["timings"]["load"]
        assert prompt["jobs"] == 1 and prompt["submit_to_done_ms_p50"] >= 19.0
        assert prompt["done_to_collected_ms_max"] < 60.0
        for j in (1, 2):
            assert bridge.submit_load(j, [j], [j], [1], [0])
        assert bridge.submit_store(3, [3], [1], [0], [3])
        time.sleep(0.12)  # every job is done by now, none collected
        bridge.wait([1])
        time.sleep(0.05)
        assert sorted(ids(bridge.get_finished())) == [1, 2, 3]
        timings = bridge.stats()["adapter"]["timings"]
        late = timings["load"]
        assert late["jobs"] == 3
        assert late["done_to_collected_ms_max"] >= 100.0  # load 2, collected last
        assert late["done_to_collected_ms_p50"] >= 50.0  # load 1, collected by wait
        assert timings["store"]["jobs"] == 1
        assert timings["store"]["done_to_collected_ms_p50"] >= 100.0
    finally:
        bridge.shutdown()


def test_shutdown_closes_releases_and_writes_stats(tmp_path: Path) -> None:
    kv = fake_canonical_kv_caches(num_blocks=8)
    path = tmp_path / "stats-{rank}.json"
    config = parse_extra_config({"cpu_bytes_to_use": 1 << 20, "stats_path": str(path)})
    bridge = build_bridge(kv, CpuPlatform(), config, 4, rank=3)
    handler = bridge.engine.manager.handlers[0]
    assert bridge.submit_store(0, [1, 2], [2, 0], [0, 0], [0, 1])
    bridge.wait([0])
    assert bridge.submit_load(1, [0, 1], [5, 6], [2, 0], [0, 0])  # never collected
    bridge.shutdown()
    assert bridge.engine.closed
    with pytest.raises(LayoutError, match="released"):
        _ = handler.tier.memory
    with pytest.raises(EngineClosedError):
        bridge.get_finished()
    data = json.loads((tmp_path / "stats-3.json").read_text())
    engine, adapter = data["engine"], data["adapter"]
    assert engine["state"] == "closed"
    assert (engine["stores_succeeded"], engine["loads_succeeded"]) == (1, 1)
    assert engine["bytes_loaded"] == engine["bytes_stored"] == 2 * 480 + 0
    assert engine["handlers"][0]["handler"] == "HostCopyHandler[CPU->CPU]"
    # the store's result was collected by wait() but never handed to vLLM; the
    # load's result was never collected at all
    assert adapter["undelivered_at_shutdown"] == 2
    assert data["final"] is True
    bridge.shutdown()  # idempotent


def test_stats_are_written_while_serving_so_a_killed_worker_leaves_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from offload_engine.connectors.vllm import stats_file

    monkeypatch.setattr(stats_file, "STATS_INTERVAL_S", 0.0)  # every get_finished
    path = tmp_path / "stats.json"
    bridge = make_bridge(fake_canonical_kv_caches(num_blocks=8), 4, stats_path=str(path))
    try:
        assert bridge.submit_store(0, [1, 2], [2, 0], [0, 0], [0, 1])
        bridge.wait([0])
        assert not path.exists()  # nothing before the first get_finished
        assert ids(bridge.get_finished()) == [0]
        first = json.loads(path.read_text())
        assert first["final"] is False
        assert "undelivered_at_shutdown" not in first["adapter"]
        assert first["adapter"]["stores_submitted"] == 1
        assert first["engine"]["stores_succeeded"] == 1
        assert bridge.get_finished() == []  # the next step writes the delivery
        assert json.loads(path.read_text())["adapter"]["results_delivered"] == 1
        assert list(tmp_path.iterdir()) == [path]  # replaced atomically, no temporary left
    finally:
        bridge.shutdown()
    last = json.loads(path.read_text())
    assert last["final"] is True and last["adapter"]["undelivered_at_shutdown"] == 0


def test_a_stats_file_that_cannot_be_written_is_logged_once_and_serving_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from offload_engine.connectors.vllm import stats_file

    monkeypatch.setattr(stats_file, "STATS_INTERVAL_S", 0.0)
    path = tmp_path / "missing" / "stats.json"
    bridge = make_bridge(fake_canonical_kv_caches(num_blocks=8), 4, stats_path=str(path))
    caplog.set_level(logging.WARNING)
    try:
        assert bridge.submit_store(0, [1, 2], [2, 0], [0, 0], [0, 1])
        bridge.wait([0])
        assert ids(bridge.get_finished()) == [0]
        assert bridge.get_finished() == []
        assert caplog.text.count("could not write stats") == 1
    finally:
        with pytest.raises(OSError):
            bridge.shutdown()  # the final write still reports its failure
