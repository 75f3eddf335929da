"""Records: several objects written into a segment with one request each way
(``pack_bytes`` the least a record holds and the most a read covers), each object
still verified alone. Shared helpers for tests/test_disk_segments.py."""

from __future__ import annotations

import contextlib
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
    TrailerError,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
)
from offload_engine.disk import _io, _record
from offload_engine.disk.handler import disk_handlers, page_aligned_tier
from offload_engine.disk.store import PAGE, DiskStore
from offload_engine.host.tier import HostTier

BLOCK = 64 * 1024  # 64 KiB objects
PACK = 256 * 1024  # records of >= 256 KiB keep the tests small
SLOT = BLOCK + PAGE
SLOTS = -(-PACK // SLOT)  # 4 objects per record
SEG = 2**20  # 1 MiB segments: page 0 is the head, 1020 KiB for records


def digest(block: int = BLOCK) -> LayoutDigest:
    return LayoutDigest(
        model="test-model", dtype="bfloat16", block_size=16, chunk_blocks=1, page_bytes=block
    )


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def record_size(n: int) -> int:
    return _record.header_bytes([key(0)] * n) + n * SLOT


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
    args.setdefault("capacity_bytes", 8 * SEG)
    args.setdefault("segment_bytes", SEG)
    args.setdefault("pack_bytes", PACK)
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


@contextlib.contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, call: str) -> Iterator[list[int]]:
    """Count the store's ``pwritev``/``preadv`` calls and the bytes each one asked for."""
    sizes: list[int] = []
    real = getattr(_io, call)

    def counted(fd: int, bufs: list[memoryview], offset: int) -> int:
        sizes.append(sum(memoryview(b).nbytes for b in bufs))
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(_io, call, counted)
    yield sizes
    monkeypatch.setattr(_io, call, real)


def flip_byte(disk: DiskStore, k: bytes, at: int = 1000) -> None:
    """Flip one byte of stored ``k``'s slot, ``at`` bytes into it."""
    where = disk.location(k)
    assert where is not None
    file, offset, _length = where
    with open(file, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def load_with_one_flipped_byte(
    disk: DiskStore, engine: SyncOffloadingEngine, tier: HostTier, keys: list[bytes], bad: int
) -> Path:
    """Flip a byte of stored ``keys[bad]``'s payload, load ``keys`` (stored from host
    blocks 0.. ) into blocks 8..: only that key misses, its block zeroed, the others
    whole. Returns the file that held it."""
    where = disk.location(keys[bad])
    assert where is not None
    flip_byte(disk, keys[bad])
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
    return where[0]


def load_held_in_flight(
    engine: SyncOffloadingEngine, monkeypatch: pytest.MonkeyPatch, k: bytes, block: int
) -> tuple[int, threading.Event]:
    """Submit a load of ``k`` into ``block`` whose read is held inside ``preadv``;
    return once the read has started: the job id and the event that releases it."""
    entered, release = threading.Event(), threading.Event()
    real = _io.preadv

    def held(fd: int, bufs: list[memoryview], offset: int) -> int:
        entered.set()
        release.wait(10)
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(_io, "preadv", held)
    job = engine.submit(TransferSpec(disk_blocks([k]), cpu_blocks([block])))
    assert entered.wait(10)
    return job, release


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("direct", [None, False])
def test_small_objects_round_trip_bit_exact_one_request_per_record(
    tmp_path: Path, direct: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(10)]
    originals = [data(tier, b) for b in range(10)]
    with engine_on(tmp_path, tier, direct=direct) as (disk, engine):
        with counting(monkeypatch, "pwritev") as writes:
            r = store(engine, list(range(10)), keys)
        assert r.success and r.bytes_moved == 10 * BLOCK  # type: ignore[attr-defined]
        # 10 objects in records of 4, 4 and 2: one request of slots each (the full
        # ones >= PACK bytes), one of its header page, the segment's head page
        slots = [w for w in writes if w > PAGE]
        assert sorted(slots) == sorted([4 * SLOT, 4 * SLOT, 2 * SLOT])
        assert min(slots) < PACK <= max(slots)
        assert len(writes) == 1 + 2 * 3
        assert disk.contains(keys) == 10
        where = [disk.location(k) for k in keys]
        assert all(w is not None and w[2] == SLOT for w in where)
        offsets = [w[1] for w in where]  # type: ignore[index]
        assert offsets[3] - offsets[0] == 3 * SLOT  # one record's consecutive slots
        assert offsets[4] - offsets[3] == SLOT + PAGE  # the next record's header between
        tier.memory[10:].zero_()
        with counting(monkeypatch, "preadv") as reads:
            assert load(engine, keys, list(range(10, 20))).success  # type: ignore[attr-defined]
        assert len(reads) == 3  # consecutive slots of a record: one preadv
        assert [data(tier, 10 + i) for i in range(10)] == originals
        tier.memory[10:].zero_()
        order = [9, 2, 0, 1, 5, 4, 3, 8, 6, 7]
        assert load(engine, [keys[i] for i in order], list(range(10, 20))).success  # type: ignore[attr-defined]
        assert [data(tier, 10 + j) for j in range(10)] == [originals[i] for i in order]
        stats = disk.stats()
        assert (stats.stored, stats.hits, stats.objects, stats.corrupt) == (10, 20, 10, 0)


def test_objects_that_are_not_whole_pages_are_records_in_buffered_io(tmp_path: Path) -> None:
    block = 5000
    tier = make_tier(16, block)
    keys = [key(i) for i in range(6)]
    slot = 3 * PAGE  # 5000 payload bytes, a page of trailer, padding to a page
    with engine_on(tmp_path, tier, block, pack_bytes=3 * slot, queue_depth=2) as (disk, engine):
        assert not disk.direct
        assert store(engine, list(range(6)), keys).success  # type: ignore[attr-defined]
        tier.memory[8:14].zero_()
        assert load(engine, keys, list(range(8, 14))).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(6))
        where = [disk.location(k) for k in keys]
        assert [w[1] for w in where] == [  # type: ignore[index]
            2 * PAGE, 2 * PAGE + slot, 2 * PAGE + 2 * slot,  # record of 3
            3 * PAGE + 3 * slot, 3 * PAGE + 4 * slot, 3 * PAGE + 5 * slot,  # and another
        ]  # fmt: skip


def test_bad_pack_bytes_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pack_bytes"):
        DiskStore(tmp_path, digest(), capacity_bytes=2**20, pack_bytes=-1)


# ------------------------------------------------------------------ the format


def test_a_header_is_as_long_as_its_size_says_at_every_key_count() -> None:
    # around a page boundary (110 keys of 36 bytes) the header needs one more page
    for n in range(1, _record.MAX_RECORD_SLOTS + 1):
        header = _record.RecordHeader(tuple(key(i) for i in range(n)), SLOT, 7)
        raw = header.encode()
        assert len(raw) == header.size(), n
        assert _record.RecordHeader.decode(raw) == header


@pytest.mark.parametrize(
    ("change", "reason"),
    [((0, b"OEPK"), "magic"), ((4, b"\x09\x00"), "version"), ((40, b"\xff"), "checksum")],
)
def test_a_damaged_record_header_is_refused(change: tuple[int, bytes], reason: str) -> None:
    raw = bytearray(_record.RecordHeader((key(1), key(2)), SLOT, 7).encode())
    at, new = change
    raw[at : at + len(new)] = new
    with pytest.raises(TrailerError) as info:
        _record.RecordHeader.decode(bytes(raw))
    assert info.value.reason == reason


# ------------------------------------------------------------------ verification


def test_a_segment_whose_objects_all_went_bad_is_reused_without_evicting(
    tmp_path: Path,
) -> None:
    tier = make_tier(48)
    full = [key(i) for i in range(14)]  # a record of 14 fills a segment
    assert SEG - PAGE - record_size(14) < record_size(1)
    with engine_on(tmp_path, tier, capacity_bytes=2 * SEG, pack_bytes=0, queue_depth=1) as (
        disk,
        engine,
    ):
        assert store(engine, list(range(14)), full).success  # type: ignore[attr-defined]
        assert store(engine, [14], [key(50)]).success  # type: ignore[attr-defined]
        seg0 = disk.location(full[0])[0]  # type: ignore[index]
        assert disk.location(key(50))[0] != seg0  # type: ignore[index]
        for k in full:
            flip_byte(disk, k)
        r = load(engine, full, list(range(20, 34)))
        assert set(r.error.missing) == set(full)  # type: ignore[attr-defined]
        stats = disk.stats()
        assert (stats.corrupt, stats.objects, stats.used_bytes) == (14, 1, 2 * SEG)
        # the emptied segment is free: the record that does not fit the rest of the
        # second segment (13 do) goes there, and nothing is evicted
        new = [key(100 + i) for i in range(14)]
        assert store(engine, list(range(14)), new).success  # type: ignore[attr-defined]
        assert disk.location(new[12])[0] != seg0  # type: ignore[index]
        assert disk.location(new[13]) == (seg0, 2 * PAGE, SLOT)
        assert disk.contains([key(50)]) == 1 and disk.stats().evictions == 0
        tier.memory[20:34].zero_()
        assert load(engine, new, list(range(20, 34))).success  # type: ignore[attr-defined]
        assert all(data(tier, 20 + i) == data(tier, i) for i in range(14))
