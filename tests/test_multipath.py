"""Borrowing peers' host links on the fake runtime: a staged job split over the own
link and peers' (device/multipath.py), and the fake's several devices it runs on."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from offload_engine import (
    ConfigError,
    HostTier,
    KVLayout,
    RuntimeUnavailableError,
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
from offload_engine.device.peers import PeerLedger
from offload_engine.device.plan import DevicePlan
from offload_engine.device.pools import JobResources, PathResources
from offload_engine.testing import FakeDeviceError, FakeRuntime, build_layout, cache_block_bytes
from offload_engine.vocabulary import Direction

POISON = 0xA5
BOUND = 20.0


@pytest.fixture
def four() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime(devices=4)
    yield runtime
    runtime.close()


# --------------------------------------------------------------------------- the fake's devices


def test_a_fake_of_several_devices_offers_its_peers_and_their_memory(four: FakeRuntime) -> None:
    assert four.device_index == 0 and four.peer_devices() == (1, 2, 3)
    staging = four.alloc_device_on(2, 64)
    assert four.memory_of(staging.data_ptr(), staging.data_ptr() + 64) == 2
    assert not four.is_device_tensor(staging)  # a peer's memory is not this device's
    assert four.new_stream_on(3).device == 3 and four.new_stream().device == 0
    narrow = FakeRuntime(devices=4, device_index=1, peer_access=(2,))
    try:
        assert narrow.device_index == 1 and narrow.peer_devices() == (2,)
        with pytest.raises(RuntimeUnavailableError, match="no peer access to device 3"):
            narrow.alloc_device_on(3, 64)
        with pytest.raises(RuntimeUnavailableError, match="no peer access to device 1"):
            narrow.new_stream_on(1)
    finally:
        narrow.close()
    single = FakeRuntime()
    try:
        assert single.peer_devices() == ()
    finally:
        single.close()
    with pytest.raises(ValueError, match="not in"):
        FakeRuntime(devices=2, peer_access=(0,))


def test_a_fake_dma_moves_only_its_streams_devices_memory(four: FakeRuntime) -> None:
    host = torch.zeros(64, dtype=torch.uint8)
    release = four.pin_host(host)
    peer = four.alloc_device_on(1, 64)
    peer.fill_(7)
    one = np.array([64], dtype=np.uint64)
    dst = np.array([host.data_ptr()], dtype=np.uint64)
    src = np.array([peer.data_ptr()], dtype=np.uint64)
    with pytest.raises(FakeDeviceError, match="stream of device 0"):
        four.memcpy_batch(four.new_stream(), dst, src, one, Direction.STORE)
    stream = four.new_stream_on(1)
    four.memcpy_batch(stream, dst, src, one, Direction.STORE)
    with pytest.raises(TransferError, match=r"event of device 0 recorded on .* of device 1"):
        four.record(four.new_event(), stream)  # as in CUDA: only on its own device's streams
    event = four.new_event_on(1)
    four.record(event, stream)
    four.synchronize(event)
    assert bytes(host.numpy()) == bytes([7]) * 64 and four.batch_calls[-1].device == 1
    own = four.new_stream()
    four.wait_event(own, event)  # any stream may wait on any device's event
    done = four.new_event()
    four.record(done, own)
    four.synchronize(done)
    release()
    lone = FakeRuntime(devices=2, peer_access=())
    try:
        with pytest.raises(RuntimeUnavailableError, match="no peer access"):
            lone.new_event_on(1)
    finally:
        lone.close()


def test_fake_faults_aimed_at_a_device(four: FakeRuntime) -> None:
    four.fail_allocations_on(2)
    with pytest.raises(FakeDeviceError, match="out of memory on fake device 2"):
        four.alloc_device_on(2, 8)
    four.alloc_device_on(1, 8)
    four.fail_next("copy", device=3)
    assert four._faults("copy", 1) == (None, False)
    error, hang = four._faults("copy", 3)
    assert isinstance(error, FakeDeviceError) and not hang
    four.hang_next("copy", device=1)
    assert four._faults("copy", 0) == (None, False)
    assert four._faults("copy", 1)[1]


def test_a_paths_events_come_from_the_device_of_the_stream_they_are_recorded_on(
    four: FakeRuntime,
) -> None:
    """A staged piece's first half's event and its second half's, each from its own
    pool, and back to it when the job is done; the own link's pool is any event."""
    assert JobResources.staged_events is JobResources.events  # the own link: unchanged
    pools = PathResources(four, 2, first=four.new_event, second=lambda: four.new_event_on(2))
    pools.add_events(3)
    taken = pools.staged_events(2 * 4)  # four pieces: more than the pools hold
    assert [e.device for e in taken] == [0, 2] * 4
    assert [e.device for e in pools.staged_events(1)] == [2]  # an empty job's
    plan = DevicePlan([], 0, CopyStrategy.STAGED, None, events=list(taken))
    pools.recycle(plan)
    assert plan.events == []
    again = pools.staged_events(2 * 4)
    assert [e.device for e in again] == [0, 2] * 4
    assert {id(e) for e in again} == {id(e) for e in taken}  # reused, none made
    with pytest.raises(TypeError, match="per half"):
        pools.events(2)
    with pytest.raises(TypeError, match="per half"):
        pools.event()


# --------------------------------------------------------------------------- split jobs

#: blocks per job: with four paths of equal weight, parts of 12 (at least PEER_MIN_PART_BLOCKS)
N = 48
ROWS = 4  # slot rows per staging buffer (own and peers'): a part spans several pieces


@dataclass
class Rig:
    runtime: FakeRuntime
    layout: KVLayout
    tier: HostTier
    store: DeviceCopyHandler
    load: DeviceCopyHandler

    def engine(self) -> SyncOffloadingEngine:
        return SyncOffloadingEngine([self.store, self.load])

    def close(self) -> None:
        self.tier.release()
        self.runtime.close()


def make_rig(
    kind: str = "flash-attention",
    *,
    peers: tuple[int, ...] | str | None = (1, 2, 3),
    devices: int = 4,
    strategy: CopyStrategy = CopyStrategy.STAGED,
    fail_alloc: tuple[int, ...] = (),
    ledger: PeerLedger | None = None,
    host_indices: tuple[int | None, ...] | None = None,
    **config: Any,
) -> Rig:
    runtime = FakeRuntime(devices=devices, host_indices=host_indices)
    for device in fail_alloc:
        runtime.fail_allocations_on(device)
    layout = build_layout(kind, runtime.empty, num_blocks=4 * N, seed=len(kind))
    tier = pinned_host_tier(runtime, layout, 2 * N)
    tier.memory.fill_(POISON)
    staging = 2 * ROWS * layout.slot_bytes
    config.setdefault("peer_staging_bytes", staging)
    try:
        cfg = DeviceHandlerConfig(
            strategy=strategy,
            staging_bytes=staging,
            peers=peers,  # type: ignore[arg-type]
            peer_min_blocks=16,
            **config,
        )
        store, load = make_device_handlers(runtime, layout, tier, cfg, ledger=ledger)
    except BaseException:
        tier.release()
        runtime.close()
        raise
    return Rig(runtime, layout, tier, store, load)


def slots_for(order: str, count: int, rng: np.random.Generator) -> list[int]:
    if order == "contiguous":
        return list(range(3, 3 + count))
    if order == "descending":
        return list(range(2 + count, 2, -1))
    return [int(x) for x in rng.choice(2 * N, size=count, replace=False)]


def round_trip(rig: Rig, engine: SyncOffloadingEngine, order: str, seed: int = 0) -> None:
    """Store N blocks of each KV group, load them into other blocks, compare bit for bit."""
    rng = np.random.default_rng(seed)
    groups = len(rig.layout.groups)
    n = N // groups
    sizes = (n,) * groups
    src = [int(x) for x in rng.choice(2 * N, size=n * groups, replace=False)]
    dst = [2 * N + int(x) for x in rng.choice(2 * N, size=n * groups, replace=False)]
    tier_ids = slots_for(order, n * groups, rng)
    want = {b: cache_block_bytes(rig.layout, b, i // n) for i, b in enumerate(src)}
    store = TransferSpec(gpu_blocks(src, group_sizes=sizes), cpu_blocks(tier_ids))
    [r] = engine.wait([engine.submit(store)], timeout=BOUND)
    assert r.success, r.error
    assert r.bytes_moved == n * sum(rig.layout.group_bytes)
    load = TransferSpec(cpu_blocks(tier_ids), gpu_blocks(dst, group_sizes=sizes))
    [r] = engine.wait([engine.submit(load)], timeout=BOUND)
    assert r.success, r.error
    got = {
        s: cache_block_bytes(rig.layout, d, i // n)
        for i, (s, d) in enumerate(zip(src, dst, strict=True))
    }
    assert got == want


def dma_devices(rig: Rig, since: int = 0) -> collections.Counter[int]:
    return collections.Counter(c.device for c in rig.runtime.batch_calls[since:])


@pytest.mark.parametrize("order", ["random", "contiguous", "descending"])
@pytest.mark.parametrize("kind", ["flash-attention", "cross-layer", "groups"])
@pytest.mark.parametrize("peers", [(1,), (1, 2), (1, 2, 3)])
def test_split_jobs_round_trip_bit_exact(peers: tuple[int, ...], kind: str, order: str) -> None:
    rig = make_rig(kind, peers=peers)
    try:
        with rig.engine() as engine:
            assert rig.store.borrowed == rig.load.borrowed == peers
            round_trip(rig, engine, order)
        # every path moved bytes: the own link and each peer's, in both directions
        assert set(dma_devices(rig)) == {0, *peers}
        for direction in (Direction.STORE, Direction.LOAD):
            assert {c.device for c in rig.runtime.batch_calls if c.kind is direction} == {
                0,
                *peers,
            }
        # the gathers and scatters ran on this device, reaching each peer's staging,
        # each path on an SM stream of its own (its parts run at once)
        kernels = rig.runtime.kernel_calls
        assert {k.device for k in kernels} == {0}
        assert {k.rows_on for k in kernels} == {0, *peers}
        streams: dict[int, set[str]] = collections.defaultdict(set)
        for k in kernels:
            streams[k.rows_on].add(k.stream)
        assert all(len(s) == 2 for s in streams.values())  # the store's and the load's
        assert len(set.union(*streams.values())) == 2 * (len(peers) + 1)
    finally:
        rig.close()


def store_spec(src: list[int], tier_ids: list[int]) -> TransferSpec:
    return TransferSpec(gpu_blocks(src), cpu_blocks(tier_ids))


def test_consecutive_split_jobs_take_effect_in_submission_order() -> None:
    """Two stores over the same slots, in flight together and cut differently over the
    paths (the second's peers cover slots the first's own link covers): the later
    one's bytes win, and a load then reads them, while the first one's own-link DMAs
    are held back until the second is launched."""
    rig = make_rig(inline_launch_blocks=N, submitter_launch=True)
    try:
        gate = threading.Event()
        with rig.engine() as engine:
            _, dmas = rig.store._pool[0]
            for stream in dmas:  # the own link's DMAs wait until the gate opens
                rig.runtime.enqueue(stream, gate.wait)
            first = engine.submit(store_spec(list(range(N, N + 40)), list(range(8, N))))
            second = engine.submit(store_spec(list(range(N)), list(range(N))))
            gate.set()
            results = engine.wait([first, second], timeout=BOUND)
            assert all(r.success for r in results), results
            load = TransferSpec(cpu_blocks(list(range(N))), gpu_blocks(list(range(2 * N, 3 * N))))
            [r] = engine.wait([engine.submit(load)], timeout=BOUND)
            assert r.success, r.error
        for slot in range(N):
            want = cache_block_bytes(rig.layout, slot)
            assert rig.tier.memory[slot].numpy().tobytes() == want, slot
            assert cache_block_bytes(rig.layout, 2 * N + slot) == want, slot
        assert set(dma_devices(rig)) == {0, 1, 2, 3}
    finally:
        rig.close()


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_every_part_of_a_job_waits_for_every_part_of_the_previous_one(
    direction: Direction,
) -> None:
    """Each stream a job's part writes from (a store's DMA streams, a load's SM
    streams) waits for each part's last write of the job before it, on the record
    that job made. The first job's own-link writes are held back, so it is still in
    flight (its pooled events not yet handed back) when the second launches."""
    rig = make_rig(inline_launch_blocks=N, submitter_launch=True)
    store = direction is Direction.STORE
    handler = rig.store if store else rig.load

    def job(tier: list[int], cache: list[int]) -> TransferSpec:
        if store:
            return store_spec(cache, tier)
        return TransferSpec(cpu_blocks(tier), gpu_blocks(cache))

    try:
        with rig.engine() as engine:
            round_trip(rig, engine, "contiguous")  # the tier holds slots 3 .. N + 2
            gate = threading.Event()
            sm, dmas = handler._pool[0]
            for stream in dmas if store else (sm,):
                rig.runtime.enqueue(stream, gate.wait)
            first = engine.submit(job(list(range(3, 43)), list(range(2 * N, 2 * N + 40))))
            before = [(id(e), on.name, e.recorded) for e, on in handler._order.last_effect]
            assert len({on for _, on, _ in before}) == (8 if store else 4)  # every path's
            since = (len(rig.runtime.batch_calls), len(rig.runtime.kernel_calls))
            second = engine.submit(job(list(range(3, N + 3)), list(range(3 * N, 4 * N))))
            gate.set()
            results = engine.wait([first, second], timeout=BOUND)
            assert all(r.success for r in results), results
        if store:
            writers = {c.stream for c in rig.runtime.batch_calls[since[0] :]}
        else:
            writers = {k.stream for k in rig.runtime.kernel_calls[since[1] :]}
        assert len(writers) == (8 if store else 4)
        waits = set(rig.runtime.wait_calls)
        for stream in writers:
            for event, on, generation in before:
                if on != stream:
                    assert (stream, event, generation) in waits, (stream, on)
    finally:
        rig.close()


def test_a_failed_peer_copy_fails_only_its_job() -> None:
    rig = make_rig()
    try:
        with rig.engine() as engine:
            rig.runtime.fail_next("copy", device=2)
            bad = engine.submit(store_spec(list(range(N)), list(range(N))))
            good = engine.submit(store_spec(list(range(N, 2 * N)), list(range(N, 2 * N))))
            r_bad, r_good = engine.wait([bad, good], timeout=BOUND)
            assert not r_bad.success and isinstance(r_bad.error, TransferError)
            assert isinstance(r_bad.error.__cause__, FakeDeviceError)
            assert r_good.success, r_good.error
            for slot in range(N, 2 * N):
                want = cache_block_bytes(rig.layout, slot)
                assert rig.tier.memory[slot].numpy().tobytes() == want
            round_trip(rig, engine, "random", seed=3)  # the paths keep serving
    finally:
        rig.close()


def test_a_failed_peer_copy_fails_a_load_too() -> None:
    rig = make_rig()
    try:
        with rig.engine() as engine:
            round_trip(rig, engine, "contiguous")
            rig.runtime.fail_next("copy", device=3)
            # into blocks the next round trip loads into (a failed job's destinations
            # are undefined; the next load of the handler waits for all its parts)
            dst = list(range(2 * N, 3 * N))
            load = TransferSpec(cpu_blocks(list(range(N))), gpu_blocks(dst))
            [r] = engine.wait([engine.submit(load)], timeout=BOUND)
            assert not r.success and isinstance(r.error, TransferError)
            round_trip(rig, engine, "random", seed=5)
    finally:
        rig.close()


def test_a_peer_without_memory_for_staging_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="offload_engine.device"):
        rig = make_rig(fail_alloc=(2,))
        try:
            with rig.engine() as engine:
                assert rig.store.borrowed == rig.load.borrowed == (1, 3)
                round_trip(rig, engine, "random")
            assert set(dma_devices(rig)) == {0, 1, 3}
        finally:
            rig.close()
    assert "does not borrow device 2's host link: out of memory on fake device 2" in caplog.text
    rig = make_rig(fail_alloc=(1, 2, 3))
    try:
        with rig.engine() as engine:
            assert rig.store.borrowed == ()
            round_trip(rig, engine, "random")
        assert set(dma_devices(rig)) == {0}
    finally:
        rig.close()


def test_small_jobs_and_other_strategies_stay_on_the_own_link() -> None:
    rig = make_rig()
    try:
        with rig.engine() as engine:
            [r] = engine.wait([engine.submit(store_spec(list(range(15)), list(range(15))))])
            assert r.success, r.error
            assert set(dma_devices(rig)) == {0}
            # 16 blocks: a part of 4 per path, each below PEER_MIN_PART_BLOCKS, folds
            [r] = engine.wait([engine.submit(store_spec(list(range(16)), list(range(16))))])
            assert r.success, r.error
            assert set(dma_devices(rig)) == {0}
            [r] = engine.wait([engine.submit(store_spec(list(range(32)), list(range(32))))])
            assert r.success, r.error
            assert set(dma_devices(rig)) == {0, 1, 2, 3}
    finally:
        rig.close()
    rig = make_rig(strategy=CopyStrategy.DMA)
    try:
        assert rig.store.borrowed == ()
        with rig.engine() as engine:
            round_trip(rig, engine, "random")
        assert set(dma_devices(rig)) == {0}
    finally:
        rig.close()


def test_auto_splits_the_jobs_it_stages() -> None:
    rig = make_rig(strategy=CopyStrategy.AUTO, dma_max_descriptors=8)
    try:
        with rig.engine() as engine:
            round_trip(rig, engine, "random")
            stats = engine.stats()
        assert set(dma_devices(rig)) == {0, 1, 2, 3}
        assert all(h.jobs_by("staged") == 1 for h in stats.handlers)
    finally:
        rig.close()


@pytest.mark.parametrize("peers", [None, ()])
def test_without_peers_nothing_is_borrowed(peers: tuple[int, ...] | None) -> None:
    rig = make_rig(peers=peers)
    try:
        with rig.engine() as engine:
            assert rig.store.borrowed == ()
            round_trip(rig, engine, "random")
        assert set(dma_devices(rig)) == {0}
        assert {k.rows_on for k in rig.runtime.kernel_calls} == {0}
    finally:
        rig.close()


def test_auto_borrows_every_peer_the_runtime_offers() -> None:
    rig = make_rig(peers="auto")
    try:
        with rig.engine():
            assert rig.store.borrowed == (1, 2, 3)
    finally:
        rig.close()
    rig = make_rig(peers="auto", devices=1)
    try:
        with rig.engine():
            assert rig.store.borrowed == ()
    finally:
        rig.close()


def test_a_busy_peer_in_the_ledger_is_skipped(tmp_path: Any) -> None:
    with PeerLedger(tmp_path / "ledger", ttl=60.0) as ledger:
        rig = make_rig(ledger=ledger)
        try:
            with rig.engine() as engine:
                ledger.announce(2, 1 << 20)
                round_trip(rig, engine, "random")
                assert set(dma_devices(rig)) == {0, 1, 3}
                ledger.announce(2, 0)  # idle again
                since = len(rig.runtime.batch_calls)
                round_trip(rig, engine, "random", seed=1)
                assert set(dma_devices(rig, since)) == {0, 1, 2, 3}
        finally:
            rig.close()
    with pytest.raises(TypeError, match="ledger must be a PeerLedger"):
        make_rig(ledger="ledger")  # type: ignore[arg-type]


def test_a_handler_that_may_borrow_launches_from_python() -> None:
    """The native launch does not split jobs: with peers, ``native_launch="auto"`` (the
    default) launches from Python, and ``True`` is a ConfigError."""
    rig = make_rig()
    try:
        assert rig.store.native_note == "jobs split over peers' links launch from Python"
        assert rig.store.borrowed == ()  # paths open at start
    finally:
        rig.close()
    with pytest.raises(ConfigError, match="peers' links launches from Python so far"):
        make_rig(native_launch=True)


def test_an_owner_busy_with_its_own_jobs_keeps_borrowers_off_its_link(tmp_path: Any) -> None:
    """Two processes' worth of handlers on one ledger file: while the owner of host
    device 0 has a job of its own in flight, the borrower, to which that device is
    its peer 1 (its devices reordered, as CUDA_VISIBLE_DEVICES does), splits over its
    other peers only; once the owner's job is done, over all of them again."""
    path = tmp_path / "ledger"
    with PeerLedger(path) as owner_ledger, PeerLedger(path) as borrower_ledger:
        owner = make_rig(peers=None, devices=1, ledger=owner_ledger)
        # the borrower is host device 1; its peer 1 is host device 0, the owner's
        borrower = make_rig(ledger=borrower_ledger, host_indices=(1, 0, 2, 3))
        try:
            with owner.engine() as mine, borrower.engine() as other:
                owner.runtime.hang_next("copy")
                ids = list(range(N))
                held = mine.submit(TransferSpec(gpu_blocks(ids), cpu_blocks(ids)))
                deadline = time.monotonic() + BOUND
                while not borrower_ledger.busy(0):
                    assert time.monotonic() < deadline, "the owner never announced its job"
                    time.sleep(0.01)
                [a] = borrower_ledger.announcements(0)
                assert a.inflight_bytes == N * owner.layout.slot_bytes
                round_trip(borrower, other, "random")
                assert set(dma_devices(borrower)) == {0, 2, 3}
                owner.runtime.release_hangs()  # the held copy fails: its job is done
                [r] = mine.wait([held], timeout=BOUND)
                assert r.job_id == held
                # announced idle as the job is handed back, well before the ttl (1 s)
                idle_by = time.monotonic() + 0.5
                while borrower_ledger.busy(0):
                    assert time.monotonic() < idle_by, "the owner's link stayed busy"
                    time.sleep(0.005)
                since = len(borrower.runtime.batch_calls)
                round_trip(borrower, other, "random", seed=1)
                assert set(dma_devices(borrower, since)) == {0, 1, 2, 3}
        finally:
            owner.close()
            borrower.close()


def test_a_device_the_host_index_of_which_is_unknown_is_neither_announced_nor_skipped(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with PeerLedger(tmp_path / "ledger") as ledger:
        ledger.announce(5, 1 << 20)  # whatever this is, nobody here can tell it is peer 1
        rig = make_rig(ledger=ledger, host_indices=(None, 5, 2, 3))
        try:
            assert "does not announce its traffic" in caplog.text
            with rig.engine() as engine:
                round_trip(rig, engine, "random")
            assert set(dma_devices(rig)) == {0, 2, 3}  # host device 5 is busy
            assert [a.inflight_bytes for a in ledger.announcements(0)] == []
        finally:
            rig.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"peers": (5,)}, "peers names device 5, which the fake runtime does not offer"),
        ({"peers": (1, 0)}, "peers names device 0, the handler's own device"),
        ({"peers": (1,), "devices": 1}, "peers names device 1, .*it offers \\[\\]"),
        ({"peer_staging_bytes": 1}, "peer_staging_bytes must hold one tier slot"),
    ],
)
def test_peers_the_handler_cannot_borrow_are_config_errors(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_rig(**kw)


def test_peer_min_blocks_is_checked() -> None:
    with pytest.raises(ConfigError, match="peer_min_blocks must be a positive int"):
        DeviceHandlerConfig(peer_min_blocks=0)
    assert DeviceHandlerConfig().peer_min_blocks == 64
