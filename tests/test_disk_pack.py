"""Objects smaller than ``pack_bytes`` are written several to a pack file: one request each
way, each object still verified alone, packs evicted whole, recovered from their headers.
(Concurrent stores and loads of packs: tests/test_disk.py, parametrized over both layouts.)"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offload_engine import (
    ConfigError,
    KeyMissError,
    LayoutDigest,
    SyncOffloadingEngine,
    TierFullError,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
)
from offload_engine.disk import _pack
from offload_engine.disk import store as disk_mod
from offload_engine.disk.handler import disk_handlers, page_aligned_tier
from offload_engine.disk.store import PAGE, DiskStore
from offload_engine.host.tier import HostTier
from tests.test_disk import killed_mid_write

BLOCK = 64 * 1024  # 64 KiB objects
PACK = 256 * 1024  # packs of >= 256 KiB keep the tests small
SLOT = BLOCK + PAGE
SLOTS = -(-PACK // SLOT)  # 4 objects per pack


def digest(block: int = BLOCK) -> LayoutDigest:
    return LayoutDigest(
        model="test-model", dtype="bfloat16", block_size=16, chunk_blocks=1, page_bytes=block
    )


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def pack_size(n: int) -> int:
    return _pack.header_bytes([key(0)] * n, PAGE) + n * SLOT


def make_tier(blocks: int = 32, block: int = BLOCK, seed: int = 0) -> HostTier:
    t = page_aligned_tier(blocks, block)
    g = torch.Generator().manual_seed(seed)
    t.memory.copy_(torch.randint(0, 256, t.memory.shape, dtype=torch.uint8, generator=g))
    return t


def data(tier: HostTier, b: int) -> bytes:
    return tier.memory[b].numpy().tobytes()


@contextlib.contextmanager
def engine_on(
    path: Path, tier: HostTier, block: int = BLOCK, **args: object
) -> Iterator[tuple[DiskStore, SyncOffloadingEngine]]:
    args.setdefault("capacity_bytes", 64 * 2**20)
    args.setdefault("pack_bytes", PACK)
    args.setdefault("segment_bytes", 0)
    with (
        DiskStore(path, digest(block), **args) as store,  # type: ignore[arg-type]
        SyncOffloadingEngine(disk_handlers(store, tier)) as engine,
    ):
        yield store, engine


def run(engine: SyncOffloadingEngine, spec: TransferSpec) -> object:
    [result] = engine.wait([engine.submit(spec)], timeout=30)
    return result


def store(engine: SyncOffloadingEngine, ids: list[int], keys: list[bytes]) -> object:
    return run(engine, TransferSpec(cpu_blocks(ids), disk_blocks(keys)))


def load(engine: SyncOffloadingEngine, keys: list[bytes], ids: list[int]) -> object:
    return run(engine, TransferSpec(disk_blocks(keys), cpu_blocks(ids)))


def packs(path: Path) -> list[Path]:
    return sorted((path / "packs").rglob("*.pk"))


@contextlib.contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, call: str) -> Iterator[list[int]]:
    """Count the store's ``_pwritev``/``_preadv`` calls and the bytes each one asked for."""
    sizes: list[int] = []
    real = getattr(disk_mod, call)

    def counted(fd: int, bufs: list[memoryview], offset: int) -> int:
        sizes.append(sum(memoryview(b).nbytes for b in bufs))
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(disk_mod, call, counted)
    yield sizes
    monkeypatch.setattr(disk_mod, call, real)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("direct", [None, False])
def test_small_objects_round_trip_bit_exact_one_request_per_pack(
    tmp_path: Path, direct: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(10)]
    originals = [data(tier, b) for b in range(10)]
    with engine_on(tmp_path, tier, direct=direct) as (disk, engine):
        assert disk.pack_slots == SLOTS
        with counting(monkeypatch, "_pwritev") as writes:
            r = store(engine, list(range(10)), keys)
        assert r.success and r.bytes_moved == 10 * BLOCK  # type: ignore[attr-defined]
        # 10 objects in packs of 4, 4 and 2: three requests, the full ones >= PACK bytes
        assert sorted(writes) == sorted([pack_size(4), pack_size(4), pack_size(2)])
        assert min(writes) < PACK <= max(writes)
        assert len(packs(tmp_path)) == 3 and not (tmp_path / "objects").exists()
        assert disk.stats().used_bytes == sum(p.stat().st_size for p in packs(tmp_path))
        assert disk.contains(keys) == 10
        where = [disk.location(k) for k in keys]
        assert all(w is not None and w[2] == SLOT for w in where)
        assert where[0][0] == where[3][0] != where[4][0]  # type: ignore[index]
        tier.memory[10:].zero_()
        with counting(monkeypatch, "_preadv") as reads:
            assert load(engine, keys, list(range(10, 20))).success  # type: ignore[attr-defined]
        assert len(reads) == 3  # consecutive slots of a pack: one preadv
        assert [data(tier, 10 + i) for i in range(10)] == originals
        tier.memory[10:].zero_()
        order = [9, 2, 0, 1, 5, 4, 3, 8, 6, 7]
        assert load(engine, [keys[i] for i in order], list(range(10, 20))).success  # type: ignore[attr-defined]
        assert [data(tier, 10 + j) for j in range(10)] == [originals[i] for i in order]
        stats = disk.stats()
        assert (stats.stored, stats.hits, stats.objects, stats.corrupt) == (10, 20, 10, 0)


def test_objects_that_are_not_whole_pages_pack_in_buffered_io(tmp_path: Path) -> None:
    block = 5000
    tier = make_tier(16, block)
    keys = [key(i) for i in range(6)]
    slot = 3 * PAGE  # 5000 payload bytes, a page of trailer, padding to a page
    with engine_on(tmp_path, tier, block, pack_bytes=3 * slot) as (disk, engine):
        assert not disk.direct and disk.pack_slots == 3
        assert store(engine, list(range(6)), keys).success  # type: ignore[attr-defined]
        tier.memory[8:14].zero_()
        assert load(engine, keys, list(range(8, 14))).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(6))
        assert len(packs(tmp_path)) == 2


def test_objects_of_pack_bytes_or_more_keep_one_file_each(tmp_path: Path) -> None:
    tier = make_tier(4)
    with engine_on(tmp_path, tier, pack_bytes=BLOCK) as (disk, engine):
        assert disk.pack_slots == 0
        assert store(engine, [0, 1], [key(0), key(1)]).success  # type: ignore[attr-defined]
        assert len(list((tmp_path / "objects").rglob("*.kv"))) == 2 and not packs(tmp_path)


def test_bad_pack_bytes_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pack_bytes"):
        DiskStore(tmp_path, digest(), capacity_bytes=2**20, pack_bytes=-1, segment_bytes=0)


# ------------------------------------------------------------------ restart


def test_restart_rebuilds_packs_from_their_headers(tmp_path: Path) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(9)]
    with engine_on(tmp_path, tier) as (_disk, engine):
        assert store(engine, list(range(9)), keys).success  # type: ignore[attr-defined]
    written = packs(tmp_path)
    assert len(written) == 3
    # leftovers: a half-written pack, a pack cut short, a pack whose header is damaged
    shard = written[0].parent
    (shard / "0000000000ff.pk.tmp").write_bytes(b"\0" * PAGE)
    short = shard / "0000000000fe.pk"
    short.write_bytes(written[0].read_bytes()[:-PAGE])
    bad = shard / "0000000000fd.pk"
    raw = bytearray(written[1].read_bytes())
    raw[30] ^= 1  # inside the keys area: the header's checksum fails
    bad.write_bytes(bytes(raw))
    tier.memory[16:].zero_()
    with engine_on(tmp_path, tier) as (disk, engine):
        stats = disk.stats()
        assert (stats.recovered, stats.removed_at_start) == (9, 3)
        assert stats.used_bytes == sum(p.stat().st_size for p in packs(tmp_path))
        assert packs(tmp_path) == written and not list(tmp_path.rglob("*.tmp"))
        assert load(engine, keys, list(range(16, 25))).success  # type: ignore[attr-defined]
        assert all(data(tier, 16 + i) == data(tier, i) for i in range(9))
        # new packs are numbered after the recovered ones
        assert store(engine, [9], [key(9)]).success  # type: ignore[attr-defined]
        new = disk.location(key(9))
        assert new is not None and new[0] not in written


def test_packs_are_read_after_packing_is_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(8)]
    with engine_on(tmp_path, tier) as (_disk, engine):
        assert store(engine, list(range(8)), keys).success  # type: ignore[attr-defined]
    with engine_on(tmp_path, tier, pack_bytes=0) as (disk, engine):
        assert disk.pack_slots == 0 and disk.stats().recovered == 8
        with counting(monkeypatch, "_preadv") as reads:
            assert load(engine, keys, list(range(16, 24))).success  # type: ignore[attr-defined]
        assert len(reads) == 8  # one slot per request: the read scratch holds one trailer
        assert all(data(tier, 16 + i) == data(tier, i) for i in range(8))
        assert store(engine, [8], [key(8)]).success  # type: ignore[attr-defined]
        assert disk.location(key(8)) == (disk.file_of(key(8)), 0, SLOT)


# ------------------------------------------------------------------ verification


def load_with_one_flipped_byte(
    disk: DiskStore, engine: SyncOffloadingEngine, tier: HostTier, keys: list[bytes], bad: int
) -> Path:
    """Flip a byte of stored ``keys[bad]``'s payload, load ``keys`` (stored from host
    blocks 0.. ) into blocks 8..: only that key misses, its block zeroed, the others
    whole. Returns the file that held it."""
    where = disk.location(keys[bad])
    assert where is not None
    file, offset, _length = where
    with open(file, "r+b") as f:
        f.seek(offset + 1000)
        byte = f.read(1)
        f.seek(offset + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    dest = [8 + i for i in range(len(keys))]
    tier.memory[dest[0] : dest[-1] + 1].fill_(7)
    r = load(engine, keys, dest)
    err = r.error  # type: ignore[attr-defined]
    assert isinstance(err, KeyMissError)
    assert err.missing == (keys[bad],)
    assert err.loaded == tuple(k for i, k in enumerate(keys) if i != bad)
    assert data(tier, dest[bad]) == bytes(BLOCK)  # zeroed, never the corrupted bytes
    good = [i for i in range(len(keys)) if i != bad]
    assert [data(tier, dest[i]) for i in good] == [data(tier, i) for i in good]
    return file


def test_a_corrupted_object_inside_a_pack_is_a_miss_for_it_alone(tmp_path: Path) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(4)]
    with engine_on(tmp_path, tier) as (disk, engine):
        assert store(engine, [0, 1, 2, 3], keys).success  # type: ignore[attr-defined]
        file = load_with_one_flipped_byte(disk, engine, tier, keys, 1)
        stats = disk.stats()
        assert (stats.corrupt, stats.objects, stats.hits) == (1, 3, 3)
        assert disk.contains([keys[1]]) == 0 and file.exists()  # the others still live there
        assert stats.used_bytes == pack_size(4)  # the pack's bytes stay until it goes
        # stored again: a new pack, which wins over the stale slot after a restart too
        assert store(engine, [1], [keys[1]]).success  # type: ignore[attr-defined]
    with engine_on(tmp_path, tier) as (disk, engine):
        assert disk.stats().recovered == 4
        tier.memory[8:12].zero_()
        assert load(engine, keys, [8, 9, 10, 11]).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(4))


def test_a_pack_whose_objects_all_went_bad_is_deleted(tmp_path: Path) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(2)]
    with engine_on(tmp_path, tier) as (disk, engine):
        assert store(engine, [0, 1], keys).success  # type: ignore[attr-defined]
        [file] = packs(tmp_path)
        with open(file, "r+b") as f:
            f.truncate(file.stat().st_size - PAGE)  # the last slot's trailer is gone
        r = load(engine, [keys[1]], [8])
        assert r.error.missing == (keys[1],)  # type: ignore[attr-defined]
        assert file.exists() and disk.stats().objects == 1
        raw = bytearray(file.read_bytes())
        raw[PAGE + 10] ^= 1  # slot 0's payload
        file.write_bytes(bytes(raw))
        r = load(engine, [keys[0]], [8])
        assert r.error.missing == (keys[0],)  # type: ignore[attr-defined]
        assert not file.exists()
        assert (disk.stats().used_bytes, disk.stats().objects, disk.stats().corrupt) == (0, 0, 2)


# ------------------------------------------------------------------ capacity


def test_packs_are_evicted_whole_and_the_accounting_stays_exact(tmp_path: Path) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(12)]
    with engine_on(tmp_path, tier, capacity_bytes=2 * pack_size(4)) as (disk, engine):
        assert store(engine, [0, 1, 2, 3], keys[0:4]).success  # type: ignore[attr-defined]
        assert store(engine, [4, 5, 6, 7], keys[4:8]).success  # type: ignore[attr-defined]
        assert load(engine, [keys[1]], [20]).success  # type: ignore[attr-defined]
        # a third pack needs room: the least recently used object is keys[0], so its
        # whole pack goes, keys[1] (used just now) with it
        assert store(engine, [8, 9, 10, 11], keys[8:12]).success  # type: ignore[attr-defined]
        assert [disk.contains([k]) for k in keys] == [0] * 4 + [1] * 8
        stats = disk.stats()
        assert stats.evictions == 4 and stats.objects == 8
        assert (
            stats.used_bytes == 2 * pack_size(4) == sum(p.stat().st_size for p in packs(tmp_path))
        )
        # a job bigger than the cap: the packs that fit are stored, the rest fail as full
        r = store(engine, list(range(12)), [key(100 + i) for i in range(12)])
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        assert disk.stats().used_bytes == sum(p.stat().st_size for p in packs(tmp_path))
    with engine_on(tmp_path, tier, capacity_bytes=pack_size(4)) as (disk, _engine):
        assert disk.stats().used_bytes == pack_size(4)  # a smaller cap: whole packs went
        assert disk.stats().used_bytes == sum(p.stat().st_size for p in packs(tmp_path))


def load_held_in_flight(
    engine: SyncOffloadingEngine, monkeypatch: pytest.MonkeyPatch, k: bytes, block: int
) -> tuple[int, threading.Event]:
    """Submit a load of ``k`` into ``block`` whose read is held inside ``_preadv``;
    return once the read has started: the job id and the event that releases it."""
    entered, release = threading.Event(), threading.Event()
    real = disk_mod._preadv

    def held(fd: int, bufs: list[memoryview], offset: int) -> int:
        entered.set()
        release.wait(10)
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(disk_mod, "_preadv", held)
    job = engine.submit(TransferSpec(disk_blocks([k]), cpu_blocks([block])))
    assert entered.wait(10)
    return job, release


def test_a_pack_with_an_object_being_read_is_not_evicted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    with engine_on(tmp_path, tier, capacity_bytes=pack_size(4)) as (disk, engine):
        assert store(engine, [0, 1, 2, 3], [key(i) for i in range(4)]).success  # type: ignore[attr-defined]
        job, release = load_held_in_flight(engine, monkeypatch, key(2), 20)
        r = store(engine, [4, 5, 6, 7], [key(4 + i) for i in range(4)])
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        release.set()
        [done] = engine.wait([job], timeout=30)
        assert done.success and data(tier, 20) == data(tier, 2)  # type: ignore[attr-defined]
        assert disk.contains([key(i) for i in range(4)]) == 4


def test_disk_full_while_writing_a_pack_fails_its_objects_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    writes = [0]
    real = disk_mod._pwritev

    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        writes[0] += 1
        if writes[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(disk_mod, "_pwritev", pwritev)
    keys = [key(i) for i in range(8)]
    with engine_on(tmp_path, tier, queue_depth=1) as (disk, engine):
        r = store(engine, list(range(8)), keys)
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        assert [disk.contains([k]) for k in keys] == [1] * 4 + [0] * 4
        stats = disk.stats()
        assert (stats.store_failures, stats.stored) == (4, 4)
        assert stats.used_bytes == pack_size(4) == sum(p.stat().st_size for p in packs(tmp_path))
        assert not list(tmp_path.rglob("*.tmp"))
        assert store(engine, list(range(4, 8)), keys[4:]).success  # type: ignore[attr-defined]


# ------------------------------------------------------------------ crash mid-write

_WRITER = r"""
import os, sys, threading
from offload_engine.disk.handler import disk_handlers
from offload_engine.disk import store as disk_mod
from offload_engine.disk.store import DiskStore
from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, disk_blocks
from tests.test_disk_pack import BLOCK, PACK, PAGE, digest, key, make_tier

real = disk_mod._pwritev
count = [0]

def pwritev(fd, bufs, offset):
    count[0] += 1
    if count[0] == 2:  # the second pack: write its header and half a payload, then wait
        os.pwritev(fd, [bufs[0], bufs[1][: BLOCK // 2]], 0)
        sys.stdout.write("MID-WRITE\n")
        sys.stdout.flush()
        threading.Event().wait()  # until SIGKILL
    return real(fd, bufs, offset)

disk_mod._pwritev = pwritev
tier = make_tier(8, seed=11)
store = DiskStore(
    sys.argv[1], digest(), capacity_bytes=2**24, queue_depth=1, pack_bytes=PACK, segment_bytes=0
)
engine = SyncOffloadingEngine(disk_handlers(store, tier))
spec = TransferSpec(cpu_blocks(range(8)), disk_blocks([key(i) for i in range(8)]))
engine.wait([engine.submit(spec)])
"""


def test_a_writer_killed_mid_pack_leaves_no_half_pack_in_the_index(tmp_path: Path) -> None:
    with killed_mid_write(_WRITER, str(tmp_path)):
        assert len(list(tmp_path.rglob("*.pk.tmp"))) == 1
    tier = make_tier(16, seed=11)  # the writer's data in blocks 0..7
    with engine_on(tmp_path, tier) as (disk, engine):
        stats = disk.stats()
        assert (stats.recovered, stats.removed_at_start, stats.used_bytes) == (4, 1, pack_size(4))
        assert disk.contains([key(i) for i in range(8)]) == 4
        assert load(engine, [key(i) for i in range(4)], [8, 9, 10, 11]).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(4))
    assert not list(tmp_path.rglob("*.tmp"))
