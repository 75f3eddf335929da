"""The disk tier moves real bytes: bit-exact, verified, capped, and safe across restarts."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from offload_engine import (
    ConfigError,
    EngineClosedError,
    InvalidTransferError,
    KeyMissError,
    LayoutDigest,
    LayoutError,
    LayoutMismatchError,
    OffloadingQueueManager,
    SyncOffloadingEngine,
    TierFullError,
    TierUnavailableError,
    TransferError,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
)
from offload_engine.disk import _io
from offload_engine.disk.handler import disk_handlers, page_aligned_tier
from offload_engine.disk.store import PAGE, DiskStore
from offload_engine.host.tier import HostTier

BLOCK = 2 * PAGE  # small objects: the machine is shared
OBJECT = BLOCK + PAGE  # payload + padded trailer: one slot
SEG1 = PAGE + PAGE + OBJECT  # a segment of one record of one object: head, header, slot

# These tests give every object a segment of its own (records of one object), so the
# cap and LRU eviction act per object; tests/test_disk_segments.py covers records of
# many objects, segments shared and recycled, and the on-disk format.
OneStore = functools.partial(DiskStore, pack_bytes=0, segment_bytes=SEG1)


def digest(**over: object) -> LayoutDigest:
    base: dict[str, object] = dict(
        model="test-model", dtype="bfloat16", block_size=16, chunk_blocks=1, page_bytes=BLOCK
    )
    base.update(over)
    return LayoutDigest(**base)  # type: ignore[arg-type]


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def fill_random(tier: HostTier, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    tier.memory.copy_(torch.randint(0, 256, tier.memory.shape, dtype=torch.uint8, generator=g))


def block_bytes(tier: HostTier, b: int) -> bytes:
    return tier.memory[b].numpy().tobytes()


@contextlib.contextmanager
def disk_engine(
    path: Path, tier: HostTier, **store_args: object
) -> Iterator[tuple[DiskStore, SyncOffloadingEngine]]:
    store_args.setdefault("capacity_bytes", 64 * SEG1)
    with (
        OneStore(path, digest(), **store_args) as store,  # type: ignore[arg-type]
        SyncOffloadingEngine(disk_handlers(store, tier)) as engine,
    ):
        yield store, engine


def run(engine: SyncOffloadingEngine, spec: TransferSpec) -> object:
    [result] = engine.wait([engine.submit(spec)], timeout=30)
    return result


def store_spec(ids: list[int], keys: list[bytes]) -> TransferSpec:
    return TransferSpec(cpu_blocks(ids), disk_blocks(keys))


def load_spec(keys: list[bytes], ids: list[int]) -> TransferSpec:
    return TransferSpec(disk_blocks(keys), cpu_blocks(ids))


@contextlib.contextmanager
def gated(
    monkeypatch: pytest.MonkeyPatch, call: str
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold the store's ``pwritev`` or ``preadv`` until ``release`` is set;
    ``entered`` is set once a thread is inside it."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(_io, call)

    def held(fd: int, bufs: list[memoryview], offset: int) -> int:
        entered.set()
        release.wait(10)
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(_io, call, held)
    try:
        yield entered, release
    finally:
        release.set()
        monkeypatch.setattr(_io, call, real)


@pytest.fixture
def tier() -> HostTier:
    t = page_aligned_tier(16, BLOCK)
    fill_random(t)
    return t


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("direct", [None, False])
def test_round_trip_is_bit_exact_and_contains_is_the_longest_prefix(
    tmp_path: Path, tier: HostTier, direct: bool | None
) -> None:
    keys = [key(i) for i in range(8)]
    originals = [block_bytes(tier, b) for b in range(8)]
    with disk_engine(tmp_path, tier, direct=direct) as (store, engine):
        r = run(engine, store_spec(list(range(8)), keys))
        assert r.success and r.bytes_moved == 8 * BLOCK  # type: ignore[attr-defined]
        assert store.contains(keys) == 8
        assert store.contains([keys[0], keys[1], key(99), keys[2]]) == 2
        assert store.contains([key(99), *keys]) == 0
        tier.memory[8:].fill_(0)
        r = run(engine, load_spec(keys[::-1], list(range(8, 16))))
        assert r.success  # type: ignore[attr-defined]
        for i in range(8):
            assert block_bytes(tier, 15 - i) == originals[i]
        stats = store.stats()
        assert (stats.stored, stats.hits, stats.objects) == (8, 8, 8)
        assert stats.used_bytes == 8 * SEG1 == on_disk(tmp_path)
        assert stats.direct is (direct is None)  # /tmp takes O_DIRECT; False forces buffered


def test_an_idle_route_launches_on_the_submitting_thread(tmp_path: Path, tier: HostTier) -> None:
    """A disk job goes to the I/O pool from the thread that submits it, with no
    hop through the engine's loop; the bytes still round-trip exactly."""
    seen: list[str] = []
    with disk_engine(tmp_path, tier) as (store, engine):
        for name in ("start_store", "start_load"):
            started = getattr(store, name)

            def spy(*args: object, _started: Callable[..., None] = started, **kw: object) -> None:
                seen.append(threading.current_thread().name)
                _started(*args, **kw)

            setattr(store, name, spy)
        want = block_bytes(tier, 2)
        assert run(engine, store_spec([2], [key(2)])).success  # type: ignore[attr-defined]
        tier.memory[6].fill_(0)
        assert run(engine, load_spec([key(2)], [6])).success  # type: ignore[attr-defined]
        assert block_bytes(tier, 6) == want
    assert seen == [threading.current_thread().name] * 2


@pytest.mark.anyio
async def test_round_trip_on_the_callers_loop(tmp_path: Path, tier: HostTier) -> None:
    with OneStore(tmp_path, digest(), capacity_bytes=8 * SEG1) as store:
        async with OffloadingQueueManager(disk_handlers(store, tier)) as mgr:
            want = block_bytes(tier, 3)
            [r] = await mgr.wait([mgr.submit_nowait(store_spec([3], [b"k3"]))])
            assert r.success
            tier.memory[5].fill_(7)
            [r] = await mgr.wait([mgr.submit_nowait(load_spec([b"k3"], [5]))])
            assert r.success and block_bytes(tier, 5) == want


def test_a_misaligned_tier_falls_back_to_buffered_io(tmp_path: Path) -> None:
    raw = torch.empty(4 * BLOCK + 2 * 64, dtype=torch.uint8)
    off = 64 if (raw.data_ptr() + 64) % PAGE else 128  # inside a page, on purpose
    tier = HostTier(4, BLOCK, memory=raw[off : off + 4 * BLOCK].view(4, BLOCK))
    fill_random(tier, 3)
    want = block_bytes(tier, 0)
    with disk_engine(tmp_path, tier) as (store, engine):
        store_handler, _ = engine.manager.handlers
        assert store.direct and not store_handler.direct  # type: ignore[attr-defined]
        assert run(engine, store_spec([0], [b"a"])).success  # type: ignore[attr-defined]
        tier.memory[1].fill_(0)
        assert run(engine, load_spec([b"a"], [1])).success  # type: ignore[attr-defined]
        assert block_bytes(tier, 1) == want


def test_bad_jobs_are_refused_at_submit(tmp_path: Path, tier: HostTier) -> None:
    with disk_engine(tmp_path, tier) as (_store, engine):
        with pytest.raises(InvalidTransferError, match="1 host-tier blocks for 2 keys"):
            engine.submit_nowait(store_spec([0], [b"a", b"b"]))
        with pytest.raises(InvalidTransferError, match="outside"):
            engine.submit_nowait(load_spec([b"a"], [16]))
    with (
        pytest.raises(LayoutError, match="page_bytes"),
        OneStore(tmp_path, digest(), capacity_bytes=SEG1) as store,
    ):
        disk_handlers(store, page_aligned_tier(2, PAGE))


# ------------------------------------------------------------------ misses are never data


def _stored(tmp_path: Path, tier: HostTier, n: int) -> list[bytes]:
    keys = [key(i) for i in range(n)]
    with disk_engine(tmp_path, tier) as (_store, engine):
        assert run(engine, store_spec(list(range(n)), keys)).success  # type: ignore[attr-defined]
    return keys


def _load_miss(tmp_path: Path, tier: HostTier, keys: list[bytes]) -> tuple[KeyMissError, DiskStore]:
    with disk_engine(tmp_path, tier) as (store, engine):
        tier.memory[8:].fill_(0xEE)
        r = run(engine, load_spec(keys, list(range(8, 8 + len(keys)))))
        assert not r.success  # type: ignore[attr-defined]
        error = r.error  # type: ignore[attr-defined]
        assert isinstance(error, KeyMissError)
        # every missed slot is zeroed; every loaded one holds verified bytes
        for i, k in enumerate(keys):
            if k in error.missing:
                assert block_bytes(tier, 8 + i) == bytes(BLOCK)
            else:
                assert block_bytes(tier, 8 + i) == block_bytes(tier, i)
        # the engine keeps serving
        assert run(engine, store_spec([0], [b"after"])).success  # type: ignore[attr-defined]
        return error, store


def _slot(path: Path, k: bytes) -> tuple[Path, int]:
    """The segment file and offset of stored ``k``'s slot."""
    with OneStore(path, digest(), capacity_bytes=64 * SEG1) as probe:
        where = probe.location(k)
    assert where is not None
    return where[0], where[1]


def _patch(file: Path, at: int, new: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(new)


def _flip(file: Path, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.seg"))


def test_corrupted_truncated_and_swapped_objects_are_misses(tmp_path: Path, tier: HostTier) -> None:
    keys = _stored(tmp_path, tier, 4)
    slots = [_slot(tmp_path, k) for k in keys]
    _flip(slots[0][0], slots[0][1] + 100)  # one flipped payload bit
    with open(slots[1][0], "r+b") as f:  # its segment truncated: restart drops it, a miss
        f.truncate(SEG1 - PAGE)
    with open(slots[3][0], "rb") as f:  # key 3's object in key 2's slot: foreign key
        f.seek(slots[3][1])
        _patch(slots[2][0], slots[2][1], f.read(OBJECT))
    os.unlink(slots[3][0])  # moved, as it were: key 3 is gone from its own place
    error, store = _load_miss(tmp_path, tier, keys)
    assert set(error.missing) == {keys[0], keys[1], keys[2], keys[3]}
    assert error.loaded == ()
    stats = store.stats()
    assert stats.corrupt == 2  # the bit flip and the swap; the truncated segment went at start
    assert stats.removed_at_start == 1
    assert not slots[1][0].exists()
    # never served again: dropped from the index, their segments free for reuse
    assert store.location(keys[0]) is None and store.location(keys[2]) is None


def test_an_object_changed_under_a_running_store_is_a_miss(tmp_path: Path, tier: HostTier) -> None:
    keys = [key(i) for i in range(3)]
    with disk_engine(tmp_path, tier) as (store, engine):
        assert run(engine, store_spec([0, 1, 2], keys)).success  # type: ignore[attr-defined]
        where = store.location(keys[1])
        assert where is not None
        _flip(where[0], where[1] + where[2] - PAGE + 40)  # the trailer's key
        tier.memory[8:11].fill_(0xEE)
        r = run(engine, load_spec(keys, [8, 9, 10]))
        assert isinstance(r.error, KeyMissError)  # type: ignore[attr-defined]
        assert r.error.missing == (keys[1],) and r.error.loaded == (keys[0], keys[2])  # type: ignore[attr-defined]
        assert block_bytes(tier, 9) == bytes(BLOCK)
        assert block_bytes(tier, 8) == block_bytes(tier, 0)
        assert store.contains(keys) == 1
        os.unlink(store.location(keys[2])[0])  # type: ignore[index]  # deleted behind its back
        r = run(engine, load_spec([keys[2]], [10]))
        assert isinstance(r.error, KeyMissError)  # type: ignore[attr-defined]
        assert store.stats().corrupt == 1 and store.contains([keys[2]]) == 0


# ------------------------------------------------------------------ restart, config


def test_restart_rebuilds_the_index_and_accounting_exactly(tmp_path: Path, tier: HostTier) -> None:
    keys = _stored(tmp_path, tier, 6)
    segments = tmp_path / "segments"
    (segments / "00000063.seg").write_bytes(b"half")  # preallocation never finished
    (segments / "not-a-segment").write_bytes(b"junk")
    with disk_engine(tmp_path, tier) as (store, engine):
        stats = store.stats()
        assert (stats.recovered, stats.removed_at_start) == (6, 2)
        assert stats.used_bytes == 6 * SEG1 == on_disk(tmp_path) and store.contains(keys) == 6
        tier.memory[8:14].fill_(0)
        assert run(engine, load_spec(keys, list(range(8, 14)))).success  # type: ignore[attr-defined]
        assert all(block_bytes(tier, 8 + i) == block_bytes(tier, i) for i in range(6))
    assert sorted(p.name for p in segments.iterdir()) == [f"{i:08x}.seg" for i in range(6)]


def test_a_directory_of_another_layout_is_never_read(tmp_path: Path) -> None:
    OneStore(tmp_path, digest(), capacity_bytes=SEG1).close()
    with pytest.raises(LayoutMismatchError, match="model: 'test-model' != 'other'"):
        OneStore(tmp_path, digest(model="other"), capacity_bytes=SEG1)
    (tmp_path / "config.json").write_text("{garbage")
    with pytest.raises(LayoutMismatchError, match="not a disk tier config"):
        OneStore(tmp_path, digest(), capacity_bytes=SEG1)


def test_missing_busy_and_read_only_directories_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TierUnavailableError, match="does not exist"):
        OneStore(tmp_path / "nope", digest(), capacity_bytes=SEG1)
    with (
        OneStore(tmp_path, digest(), capacity_bytes=SEG1),
        pytest.raises(TierUnavailableError, match="in use"),
    ):
        OneStore(tmp_path, digest(), capacity_bytes=SEG1)
    ro = tmp_path / "ro"
    ro.mkdir()
    with _mounted(ro, "ro,size=64k") as mounted:
        if not mounted:
            os.chmod(ro, 0o500)
            if os.access(ro, os.W_OK):  # root without mount rights: nothing to test with
                pytest.skip("cannot make a read-only directory here (root, no mount)")
        with pytest.raises(TierUnavailableError, match="not writable"):
            OneStore(ro, digest(), capacity_bytes=SEG1)


def test_closed_store_refuses_jobs(tmp_path: Path, tier: HostTier) -> None:
    store = OneStore(tmp_path, digest(), capacity_bytes=SEG1)
    handlers = disk_handlers(store, tier)
    store.close()
    store.close()
    assert store.closed and "closed" in repr(store)
    with SyncOffloadingEngine(handlers) as engine, pytest.raises(EngineClosedError):
        engine.submit_nowait(store_spec([0], [b"a"]))


# ------------------------------------------------------------------ capacity


def test_the_cap_is_enforced_with_lru_eviction(tmp_path: Path, tier: HostTier) -> None:
    keys = [key(i) for i in range(5)]
    with disk_engine(tmp_path, tier, capacity_bytes=3 * SEG1) as (store, engine):
        assert run(engine, store_spec([0, 1, 2], keys[:3])).success  # type: ignore[attr-defined]
        assert run(engine, load_spec([keys[0]], [8])).success  # type: ignore[attr-defined]
        assert run(engine, store_spec([3], [keys[3]])).success  # type: ignore[attr-defined]
        # keys[1] was least recently used (keys[0] was loaded since)
        assert [store.contains([k]) for k in keys[:4]] == [1, 0, 1, 1]
        store.touch([keys[2]])
        assert run(engine, store_spec([4], [keys[4]])).success  # type: ignore[attr-defined]
        assert [store.contains([k]) for k in keys] == [0, 0, 1, 1, 1]
        stats = store.stats()
        assert stats.used_bytes == 3 * SEG1 and stats.evictions == 2 and stats.objects == 3
        assert on_disk(tmp_path) == 3 * SEG1
        files = [store.location(k)[0] for k in keys[2:]]  # type: ignore[index]
    # a restart orders segments by mtime, which the kernel keeps at a coarse tick:
    # stores a few ms apart may share it, so the test spells the order out
    for age, file in enumerate(files):
        os.utime(file, (1e9 + age, 1e9 + age))
    with OneStore(tmp_path, digest(), capacity_bytes=2 * SEG1) as store:  # a smaller cap
        assert store.stats().used_bytes == 2 * SEG1 == on_disk(tmp_path)
        assert [store.contains([k]) for k in keys] == [0, 0, 0, 1, 1]  # oldest mtime went


def test_a_store_with_no_idle_segment_fails_and_the_engine_serves_on(
    tmp_path: Path, tier: HostTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    with disk_engine(tmp_path, tier, capacity_bytes=SEG1) as (store, engine):
        assert run(engine, store_spec([0], [b"a"])).success  # type: ignore[attr-defined]
        with gated(monkeypatch, "preadv") as (entered, release):
            loading = engine.submit(load_spec([b"a"], [8]))
            assert entered.wait(10)  # the only segment has an object being read
            r = run(engine, store_spec([1], [b"big"]))
            assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
            assert store.stats().used_bytes == SEG1 and store.contains([b"big"]) == 0
            release.set()
            [done] = engine.wait([loading], timeout=10)
            assert done.success
        assert run(engine, store_spec([1], [b"big"])).success  # type: ignore[attr-defined]
        assert store.contains([b"a"]) == 0 and store.contains([b"big"]) == 1


# ------------------------------------------------------------------ disk full


@contextlib.contextmanager
def _mounted(where: Path, options: str) -> Iterator[bool]:
    """A tmpfs at ``where`` if this process may mount one (else False)."""
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            check=False,
        )
        ok = done.returncode == 0
    except FileNotFoundError:
        ok = False
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", str(where)], check=True)


def test_disk_full_injected(
    tmp_path: Path, tier: HostTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = [0]
    real = _io.pwritev

    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        writes[0] += 1
        # each object: its segment's head, its slot, its record header
        if writes[0] > 3 * 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(_io, "pwritev", pwritev)
    with disk_engine(tmp_path, tier, queue_depth=1) as (store, engine):
        keys = [key(i) for i in range(6)]
        r = run(engine, store_spec(list(range(6)), keys))
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        stored = [k for k in keys if store.contains([k])]
        assert stored == keys[:3] and store.stats().store_failures == 3
        assert store.stats().used_bytes == on_disk(tmp_path)
        tier.memory[8:].fill_(0)
        assert run(engine, load_spec(stored, [8, 9, 10])).success  # type: ignore[attr-defined]
        assert [block_bytes(tier, b) for b in (8, 9, 10)] == [
            block_bytes(tier, b) for b in range(3)
        ]


def test_an_io_error_is_a_failed_store(
    tmp_path: Path, tier: HostTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_io, "pwritev", pwritev)
    with disk_engine(tmp_path, tier) as (store, engine):
        r = run(engine, store_spec([0], [b"a"]))
        assert type(r.error) is TransferError and "not stored" in str(r.error)  # type: ignore[attr-defined]
        assert store.contains([b"a"]) == 0 and store.stats().store_failures == 1
        # the segment was preallocated before its head failed: counted as on disk
        assert store.stats().used_bytes == on_disk(tmp_path) == SEG1


# ------------------------------------------------------------------ concurrency


def test_the_same_key_stored_twice_at_once(
    tmp_path: Path, tier: HostTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        gated(monkeypatch, "pwritev") as (entered, release),
        disk_engine(tmp_path, tier) as (store, engine),
    ):
        first = engine.submit(store_spec([0], [b"same"]))
        assert entered.wait(10)  # the first write is under way
        second = engine.submit(store_spec([1], [b"same"]))
        [r2] = engine.wait([second], timeout=10)  # skipped: the key is being written
        assert r2.success and store.contains([b"same"]) == 0
        release.set()
        [r1] = engine.wait([first], timeout=10)
        assert r1.success and store.contains([b"same"]) == 1
        assert (store.stats().stored, store.stats().already_stored) == (1, 1)
        tier.memory[9].fill_(0)
        assert run(engine, load_spec([b"same"], [9])).success  # type: ignore[attr-defined]
        assert block_bytes(tier, 9) == block_bytes(tier, 0)  # the first writer's bytes


def test_a_load_racing_an_eviction_gets_whole_bytes_or_a_miss(
    tmp_path: Path, tier: HostTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [key(i) for i in range(3)]
    with disk_engine(tmp_path, tier, capacity_bytes=2 * SEG1) as (store, engine):
        assert run(engine, store_spec([0, 1], keys[:2])).success  # type: ignore[attr-defined]
        with gated(monkeypatch, "preadv") as (entered, release):
            loading = engine.submit(load_spec([keys[0]], [8]))  # keys[0] is the LRU victim
            assert entered.wait(10)
            # the load pinned keys[0]: the eviction this store needs takes keys[1] instead.
            # (The store is started on the store directly: its eviction happens at start,
            # and its write waits for the load, which has priority.)
            stored: list[object] = []
            finished = threading.Event()

            def done(nbytes: int, error: BaseException | None) -> None:
                stored.append(error)
                finished.set()

            payload = memoryview(tier.memory[2].numpy())  # type: ignore[arg-type]
            store.start_store([keys[2]], [payload], direct=False, done=done)
            assert [store.contains([k]) for k in keys] == [1, 0, 0]  # keys[2] is being written
            assert not finished.is_set()  # held back while the load runs
            release.set()
            [r] = engine.wait([loading], timeout=10)
            assert r.success and block_bytes(tier, 8) == block_bytes(tier, 0)
            assert finished.wait(10) and stored == [None]
            assert [store.contains([k]) for k in keys] == [1, 0, 1]
        # evicted first, loaded after: a miss, never stale bytes
        r = run(engine, load_spec([keys[1]], [9]))
        assert isinstance(r.error, KeyMissError)  # type: ignore[attr-defined]
        assert block_bytes(tier, 9) == bytes(BLOCK)


def in_threads(work: Callable[[int], None], n: int) -> None:
    """Run ``work(0) .. work(n - 1)`` on ``n`` threads at once; re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize(
    "layout",
    [
        {"pack_bytes": 0},
        {"pack_bytes": 0, "segment_bytes": 20 * OBJECT},
        {"pack_bytes": 3 * OBJECT, "segment_bytes": 20 * OBJECT},
    ],
    ids=["one-per-segment", "records", "records-of-3"],
)
def test_concurrent_stores_and_loads_from_several_threads(
    tmp_path: Path, layout: dict[str, int]
) -> None:
    tier = page_aligned_tier(64, BLOCK)
    fill_random(tier, 7)
    originals = {b: block_bytes(tier, b) for b in range(32)}
    with disk_engine(tmp_path, tier, queue_depth=3, **layout) as (store, engine):

        def worker(t: int) -> None:
            ids = list(range(t * 8, t * 8 + 8))  # host blocks 0..31 hold the originals
            keys = [key(1000 + b) for b in ids]
            for rnd in range(5):
                for ks, bs in ((keys[:5], ids[:5]), (keys[3:], ids[3:])):  # overlapping
                    r = run(engine, store_spec(bs, ks))
                    assert r.success, r  # type: ignore[attr-defined]
                dest = [32 + t * 8 + i for i in range(8)]
                order = keys[rnd % 8 :] + keys[: rnd % 8]
                r = run(engine, load_spec(order, dest))
                assert r.success, r  # type: ignore[attr-defined]
                for k, d in zip(order, dest, strict=True):
                    assert block_bytes(tier, d) == originals[ids[keys.index(k)]]

        in_threads(worker, 4)
        stats = store.stats()
        assert stats.stored == 32 and stats.hits == 4 * 5 * 8 and stats.corrupt == 0
        assert stats.used_bytes == on_disk(tmp_path) > 0
        assert store.segment_bytes == layout.get("segment_bytes", SEG1)


# ------------------------------------------------------------------ crash mid-write


@contextlib.contextmanager
def killed_mid_write(script: str, *argv: str) -> Iterator[None]:
    """Run ``script`` in a fresh interpreter until it prints ``MID-WRITE`` (it then
    waits), run the body, then SIGKILL it."""
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, env=env, cwd=root
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"MID-WRITE\n"
        yield
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# ------------------------------------------------------------------ options


@pytest.mark.parametrize("fsync", ["data", "always"])
def test_fsync_policies_round_trip(tmp_path: Path, tier: HostTier, fsync: str) -> None:
    with disk_engine(tmp_path, tier, fsync=fsync) as (store, engine):
        assert run(engine, store_spec([0, 1], [b"a", b"b"])).success  # type: ignore[attr-defined]
        assert run(engine, load_spec([b"b", b"a"], [9, 8])).success  # type: ignore[attr-defined]
        assert block_bytes(tier, 8) == block_bytes(tier, 0)
        assert block_bytes(tier, 9) == block_bytes(tier, 1)
        assert store.fsync == fsync


def test_the_eviction_policy_is_pluggable(tmp_path: Path, tier: HostTier) -> None:
    class NewestFirst:
        """Evicts the most recently stored object (not LRU), to show the store obeys it."""

        def __init__(self) -> None:
            self.order: list[bytes] = []

        def inserted(self, key: bytes) -> None:
            self.order.append(key)

        def touched(self, key: bytes) -> None:
            pass

        def removed(self, key: bytes) -> None:
            self.order.remove(key)

        def victims(self) -> Iterator[bytes]:
            return iter(self.order[::-1])

    keys = [key(i) for i in range(3)]
    with disk_engine(tmp_path, tier, capacity_bytes=2 * SEG1, policy=NewestFirst()) as (
        store,
        engine,
    ):
        assert run(engine, store_spec([0, 1], keys[:2])).success  # type: ignore[attr-defined]
        assert run(engine, store_spec([2], keys[2:])).success  # type: ignore[attr-defined]
        assert [store.contains([k]) for k in keys] == [1, 0, 1]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": SEG1, "queue_depth": 0}, "queue_depth"),
        ({"capacity_bytes": SEG1, "fsync": "sometimes"}, "fsync"),
        ({"capacity_bytes": SEG1, "direct": "yes"}, "direct"),
        ({"capacity_bytes": SEG1, "on_foreign_layout": "keep"}, "on_foreign_layout"),
        ({"capacity_bytes": OBJECT}, "less than one segment"),
    ],
)
def test_bad_store_options_are_config_errors(
    tmp_path: Path, args: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        OneStore(tmp_path, digest(), **args)  # type: ignore[arg-type]


def test_a_tier_with_gaps_between_blocks_round_trips(tmp_path: Path) -> None:
    """A host tier inside someone else's buffer (HostTier.over), blocks 3 pages apart."""
    stride = BLOCK + PAGE
    buffer = page_aligned_tier(1, 4 * stride).memory.view(-1)
    buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8))
    tier = HostTier.over(buffer, num_blocks=4, slot_bytes=BLOCK, block_stride=stride)
    gaps = [buffer[b * stride + BLOCK : (b + 1) * stride].clone() for b in range(4)]
    want = [tier.memory[b].numpy().tobytes() for b in range(2)]
    with disk_engine(tmp_path, tier) as (_store, engine):
        assert engine.manager.handlers[0].direct  # type: ignore[attr-defined]
        assert run(engine, store_spec([0, 1], [b"a", b"b"])).success  # type: ignore[attr-defined]
        tier.memory[2:].fill_(0)
        assert run(engine, load_spec([b"b", b"a"], [2, 3])).success  # type: ignore[attr-defined]
    assert [tier.memory[b].numpy().tobytes() for b in (3, 2)] == want
    for b in range(4):  # the bytes between blocks are not the tier's: untouched
        assert torch.equal(buffer[b * stride + BLOCK : (b + 1) * stride], gaps[b])
