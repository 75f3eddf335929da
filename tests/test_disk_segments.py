"""The segment layout (``DiskStore(segment_bytes=)``): records appended to preallocated
segment files, each object verified alone, a record indexed only once its header is
written after its slots, segments recycled whole under a new generation; a directory
of an older layout refused or wiped. (Concurrent stores and loads: tests/test_disk.py.)"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from offload_engine import (
    ConfigError,
    KeyMissError,
    LayoutMismatchError,
    SyncOffloadingEngine,
    TierFullError,
    TierUnavailableError,
    TrailerError,
)
from offload_engine.disk import _io, _record
from offload_engine.disk.handler import disk_handlers
from offload_engine.disk.store import PAGE, DiskStore
from offload_engine.host.tier import HostTier
from tests.test_disk import _mounted, in_threads, killed_mid_write
from tests.test_disk_pack import (
    BLOCK,
    PACK,
    SEG,
    SLOT,
    data,
    digest,
    key,
    load,
    load_held_in_flight,
    load_with_one_flipped_byte,
    make_tier,
    store,
)


def keys(a: int, b: int) -> list[bytes]:
    return [key(i) for i in range(a, b)]


def record(n: int) -> int:
    """Bytes of a record of ``n`` objects (a one-page header: short keys)."""
    return PAGE + n * SLOT


@contextlib.contextmanager
def engine_on(
    path: Path, tier: HostTier, block: int = BLOCK, **args: object
) -> Iterator[tuple[DiskStore, SyncOffloadingEngine]]:
    args.setdefault("capacity_bytes", 8 * SEG)
    args.setdefault("segment_bytes", SEG)
    args.setdefault("pack_bytes", 0)  # records sized by the job and queue depth alone
    args.setdefault("queue_depth", 1)
    with (
        DiskStore(path, digest(block), **args) as store,  # type: ignore[arg-type]
        SyncOffloadingEngine(disk_handlers(store, tier)) as engine,
    ):
        yield store, engine


def segments(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.seg"))


def on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in segments(path))


@contextlib.contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, call: str) -> Iterator[list[tuple[int, int]]]:
    """Record the store's ``pwritev``/``preadv`` calls as (offset, bytes)."""
    calls: list[tuple[int, int]] = []
    real = getattr(_io, call)

    def counted(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append((offset, sum(memoryview(b).nbytes for b in bufs)))
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(_io, call, counted)
    yield calls
    monkeypatch.setattr(_io, call, real)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("mib", [0.25, 1, 2, 8])
def test_round_trips_bit_exact_at_chunk_sizes(tmp_path: Path, mib: float) -> None:
    block = int(mib * 2**20)
    tier = make_tier(8, block, seed=int(mib * 4))
    seg = 32 * 2**20
    ks = keys(0, 4)
    with engine_on(
        tmp_path, tier, block, capacity_bytes=3 * seg, segment_bytes=seg, queue_depth=4
    ) as (disk, engine):
        assert store(engine, [0, 1, 2, 3], ks).success  # type: ignore[attr-defined]
        tier.memory[4:].zero_()
        assert load(engine, ks, [4, 5, 6, 7]).success  # type: ignore[attr-defined]
        assert [data(tier, 4 + i) for i in range(4)] == [data(tier, i) for i in range(4)]
        assert disk.stats().used_bytes == on_disk(tmp_path) == len(segments(tmp_path)) * seg
        assert not (tmp_path / "objects").exists() and not (tmp_path / "packs").exists()
    with engine_on(
        tmp_path, tier, block, capacity_bytes=3 * seg, segment_bytes=seg, queue_depth=4
    ) as (disk, engine):
        assert disk.stats().recovered == 4
        tier.memory[4:].zero_()
        assert load(engine, ks[::-1], [4, 5, 6, 7]).success  # type: ignore[attr-defined]
        assert [data(tier, 4 + i) for i in range(4)] == [data(tier, 3 - i) for i in range(4)]


def test_a_record_whose_header_crosses_a_page_by_its_generation_round_trips(
    tmp_path: Path,
) -> None:
    tier = make_tier(220, BLOCK, seed=3)
    ks = keys(0, 110)
    seg = 16 * 2**20
    with engine_on(tmp_path, tier, capacity_bytes=2 * seg, segment_bytes=seg) as (_, engine):
        assert store(engine, list(range(110)), ks).success  # type: ignore[attr-defined]
        assert load(engine, ks, list(range(110, 220))).success  # type: ignore[attr-defined]
    assert [data(tier, 110 + i) for i in range(110)] == [data(tier, i) for i in range(110)]
    with engine_on(tmp_path, tier, capacity_bytes=2 * seg, segment_bytes=seg) as (disk, _):
        assert disk.stats().recovered == 110


def test_a_record_is_cut_to_fill_the_rest_of_a_segment(tmp_path: Path) -> None:
    # jobs of 8 objects (records of 8): the second job's record does not fit
    # the first segment's rest, so 6 of its objects go there and 2 to the next
    tier = make_tier(48, seed=4)
    ks = keys(0, 24)
    assert record(8) + record(8) > SEG - PAGE >= record(8) + record(6)
    with engine_on(tmp_path, tier) as (disk, engine):
        for j in range(3):
            ids = list(range(8 * j, 8 * j + 8))
            assert store(engine, ids, ks[8 * j : 8 * j + 8]).success  # type: ignore[attr-defined]
        assert len(segments(tmp_path)) == 2
        assert disk.stats().used_bytes == on_disk(tmp_path) == 2 * SEG
        assert load(engine, ks, list(range(24, 48))).success  # type: ignore[attr-defined]
        assert [data(tier, 24 + i) for i in range(24)] == [data(tier, i) for i in range(24)]
    with engine_on(tmp_path, tier) as (disk, _):
        assert disk.stats().recovered == 24


@pytest.mark.parametrize(("fsync", "direct"), [("data", None), ("always", None), ("never", False)])
def test_fsync_policies_and_buffered_io_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str, direct: bool | None
) -> None:
    tier = make_tier()
    synced: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    with engine_on(tmp_path, tier, fsync=fsync, direct=direct) as (disk, engine):
        assert disk.direct is (direct is None)
        assert store(engine, list(range(4)), keys(0, 4)).success  # type: ignore[attr-defined]
        # data and always: after the head, after the record's slots, after its header
        assert len(synced) == (0 if fsync == "never" else 3)
    tier.memory[8:12].zero_()
    with engine_on(tmp_path, tier, fsync=fsync, direct=direct) as (disk, engine):
        assert load(engine, keys(0, 4), [8, 9, 10, 11]).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(4))


def test_a_record_is_slots_then_its_header_and_a_run_is_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    ks = keys(0, 8)
    # pack_bytes of 4 slots: a read request covers up to 4
    with engine_on(tmp_path, tier, queue_depth=2, pack_bytes=PACK) as (disk, engine):
        with counting(monkeypatch, "pwritev") as writes:
            assert store(engine, list(range(8)), ks).success  # type: ignore[attr-defined]
        # 8 objects, 2 threads: two records of 4, each slots first and then its header;
        # the segment's head before any of them
        assert writes[0] == (0, PAGE)
        records = sorted(writes[1:])
        assert records == sorted(
            [
                (2 * PAGE, 4 * SLOT),
                (PAGE, PAGE),
                (PAGE + record(4) + PAGE, 4 * SLOT),
                (PAGE + record(4), PAGE),
            ]
        )
        for base in (PAGE, PAGE + record(4)):
            slots = writes.index((base + PAGE, 4 * SLOT))
            assert writes.index((base, PAGE)) > slots
        assert disk.location(ks[5]) == (segments(tmp_path)[0], PAGE + record(4) + PAGE + SLOT, SLOT)
        tier.memory[8:].zero_()
        with counting(monkeypatch, "preadv") as reads:
            assert load(engine, ks, list(range(8, 16))).success  # type: ignore[attr-defined]
        assert sorted(reads) == [(2 * PAGE, 4 * SLOT), (PAGE + record(4) + PAGE, 4 * SLOT)]
        assert [data(tier, 8 + i) for i in range(8)] == [data(tier, i) for i in range(8)]


def test_a_read_request_stops_at_pack_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one record of 8 objects; pack_bytes of 2 slots: its run is read 2 slots a request
    tier = make_tier()
    ks = keys(0, 8)
    with engine_on(tmp_path, tier, pack_bytes=2 * SLOT) as (_, engine):
        assert store(engine, list(range(8)), ks).success  # type: ignore[attr-defined]
        tier.memory[8:].zero_()
        with counting(monkeypatch, "preadv") as reads:
            assert load(engine, ks, list(range(8, 16))).success  # type: ignore[attr-defined]
        assert sorted(reads) == [(2 * PAGE + i * 2 * SLOT, 2 * SLOT) for i in range(4)]
        assert [data(tier, 8 + i) for i in range(8)] == [data(tier, i) for i in range(8)]


def test_bad_segment_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="multiple of 4096"):
        DiskStore(tmp_path, digest(), capacity_bytes=8 * SEG, segment_bytes=SEG + 1)
    with pytest.raises(ConfigError, match="cannot hold one object"):
        DiskStore(tmp_path, digest(), capacity_bytes=8 * SEG, segment_bytes=SLOT)
    with pytest.raises(ConfigError, match="less than one segment"):
        DiskStore(tmp_path, digest(), capacity_bytes=SEG - PAGE, segment_bytes=SEG)
    with pytest.raises(ConfigError, match="segment_bytes"):
        DiskStore(tmp_path, digest(), capacity_bytes=SEG, segment_bytes=-1)
    with pytest.raises(ConfigError, match="segment_bytes"):  # 0 meant the older layout
        DiskStore(tmp_path, digest(), capacity_bytes=SEG, segment_bytes=0)


def test_a_directory_is_read_only_in_the_layout_it_was_written_in(tmp_path: Path) -> None:
    tier = make_tier(4)
    seg_dir, new_dir = tmp_path / "seg", tmp_path / "new"
    for d in (seg_dir, new_dir):
        d.mkdir()
    with engine_on(seg_dir, tier) as (_disk, engine):
        assert store(engine, [0], [key(0)]).success  # type: ignore[attr-defined]
    config = json.loads((seg_dir / "config.json").read_text())
    assert config["store"] == {"format": "segments", "segment_bytes": SEG}
    with pytest.raises(LayoutMismatchError, match="segment_bytes"):
        DiskStore(seg_dir, digest(), capacity_bytes=8 * SEG, segment_bytes=2 * SEG)
    with DiskStore(seg_dir, digest(), capacity_bytes=8 * SEG) as disk:  # its own size
        assert disk.segment_bytes == SEG and disk.contains([key(0)]) == 1
    # a new directory, no segment_bytes: segments of a 16th of the cap
    with DiskStore(new_dir, digest(), capacity_bytes=32 * SEG) as disk:
        assert disk.segment_bytes == 2 * SEG
    config = json.loads((new_dir / "config.json").read_text())
    assert config["store"] == {"format": "segments", "segment_bytes": 2 * SEG}
    config["store"] = {"format": "log"}
    (new_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(TierUnavailableError, match="unknown store layout"):
        DiskStore(new_dir, digest(), capacity_bytes=32 * SEG)


def _older_layout(path: Path) -> list[Path]:
    """What a directory of the files-and-packs layout held: a config.json without a
    "store" entry, object files and pack files. Returns those files."""
    config = {"layout": json.loads(digest().to_json())}
    (path / "config.json").write_text(json.dumps(config))
    shard = path / "objects" / "ab" / "cd"
    shard.mkdir(parents=True)
    (shard / f"{key(0).hex()}.kv").write_bytes(bytes(SLOT))
    packs = path / "packs" / "00"
    packs.mkdir(parents=True)
    (packs / "000000000000.pk").write_bytes(bytes(2 * SLOT))
    return [shard / f"{key(0).hex()}.kv", packs / "000000000000.pk"]


def test_a_directory_of_an_older_layout_is_refused_and_left_alone(tmp_path: Path) -> None:
    files = _older_layout(tmp_path)
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(TierUnavailableError) as info:
        DiskStore(tmp_path, digest(), capacity_bytes=8 * SEG)
    message = str(info.value)
    assert "files-and-packs layout" in message and "older offload-engine" in message
    assert "on_foreign_layout='wipe'" in message and str(tmp_path) in message
    assert all(f.exists() for f in files) and (tmp_path / "config.json").read_text() == before
    # the same with only the files of that layout and no config.json at all
    (tmp_path / "config.json").unlink()
    with pytest.raises(TierUnavailableError, match=r"files-and-packs layout \(objects/ and packs/"):
        DiskStore(tmp_path, digest(), capacity_bytes=8 * SEG, on_foreign_layout="error")
    assert all(f.exists() for f in files)


def test_a_directory_of_an_older_layout_is_wiped_when_asked(tmp_path: Path) -> None:
    files = _older_layout(tmp_path)
    (tmp_path / "notes.txt").write_text("not the tier's")
    tier = make_tier(4)
    with engine_on(tmp_path, tier, on_foreign_layout="wipe") as (disk, engine):
        assert not (tmp_path / "objects").exists() and not (tmp_path / "packs").exists()
        assert not any(f.exists() for f in files)
        assert (tmp_path / "notes.txt").read_text() == "not the tier's"  # only the tier's go
        stats = disk.stats()
        assert (stats.recovered, stats.objects, stats.used_bytes) == (0, 0, 0)
        assert disk.contains([key(0)]) == 0
        assert store(engine, [0, 1], keys(0, 2)).success  # type: ignore[attr-defined]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["store"] == {"format": "segments", "segment_bytes": SEG}
    # a directory in the segment layout is never wiped
    with engine_on(tmp_path, tier, on_foreign_layout="wipe") as (disk, _engine):
        assert disk.stats().recovered == 2


def test_on_foreign_layout_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"on_foreign_layout must be error\|wipe"):
        DiskStore(tmp_path, digest(), capacity_bytes=8 * SEG, on_foreign_layout="delete")  # type: ignore[arg-type]
    assert not (tmp_path / "config.json").exists()  # refused before the directory is touched


# ------------------------------------------------------------------ restart


def test_restart_walks_record_headers_and_appends_to_a_new_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    with engine_on(tmp_path, tier) as (_disk, engine):
        for j in range(3):
            assert store(engine, list(range(j * 4, j * 4 + 4)), keys(j * 4, j * 4 + 4)).success  # type: ignore[attr-defined]
    [seg0] = segments(tmp_path)
    (tmp_path / "segments" / "junk.seg").write_bytes(b"x")  # not ours: deleted
    tier.memory[16:].zero_()
    with engine_on(tmp_path, tier, pack_bytes=PACK) as (disk, engine):
        stats = disk.stats()
        assert (stats.recovered, stats.removed_at_start, stats.used_bytes) == (12, 1, SEG)
        with counting(monkeypatch, "preadv") as reads:
            assert load(engine, keys(0, 12), list(range(16, 28))).success  # type: ignore[attr-defined]
        assert len(reads) == 3  # a record's 4 consecutive slots (pack_bytes): one read
        assert all(data(tier, 16 + i) == data(tier, i) for i in range(12))
        # the recovered segment is closed: a new record goes into a second one
        assert store(engine, [12], [key(12)]).success  # type: ignore[attr-defined]
        where = disk.location(key(12))
        assert where is not None and where[0] != seg0
        assert disk.stats().used_bytes == 2 * SEG == on_disk(tmp_path)


def test_a_corrupted_object_inside_a_segment_is_a_miss_for_it_alone(tmp_path: Path) -> None:
    tier = make_tier()
    ks = keys(0, 4)
    with engine_on(tmp_path, tier) as (disk, engine):
        assert store(engine, [0, 1, 2, 3], ks).success  # type: ignore[attr-defined]
        load_with_one_flipped_byte(disk, engine, tier, ks, 2)
        stats = disk.stats()
        assert (stats.corrupt, stats.objects, stats.used_bytes) == (1, 3, SEG)
        # stored again, in a later record: it wins after a restart too
        assert store(engine, [2], [ks[2]]).success  # type: ignore[attr-defined]
    with engine_on(tmp_path, tier) as (disk, engine):
        assert disk.stats().recovered == 4
        tier.memory[8:12].zero_()
        assert load(engine, ks, [8, 9, 10, 11]).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(4))


# ------------------------------------------------------------------ capacity, recycling


def test_a_recycled_segment_never_serves_its_earlier_keys(tmp_path: Path) -> None:
    tier = make_tier(48)
    # a1 and a2 fill the first segment and b the second, each leaving less than one
    # object's record, so no record is cut to fill a rest
    a1, a2, b, c = keys(0, 7), keys(7, 14), keys(14, 28), keys(28, 35)
    assert SEG - PAGE - 2 * record(7) < record(1) and SEG - PAGE - record(14) < record(1)
    with engine_on(tmp_path, tier, capacity_bytes=2 * SEG) as (disk, engine):
        assert store(engine, list(range(7)), a1).success  # type: ignore[attr-defined]
        assert store(engine, list(range(7, 14)), a2).success  # type: ignore[attr-defined]
        assert store(engine, list(range(14, 28)), b).success  # type: ignore[attr-defined]
        seg0, seg1 = segments(tmp_path)
        # c does not fit the second segment: the least recently used segment (a1 and
        # a2) is emptied and reused under a new generation, from its first record
        assert store(engine, list(range(28, 35)), c).success  # type: ignore[attr-defined]
        assert disk.contains(a1) == disk.contains(a2) == 0
        assert disk.contains(b) == 14 and disk.contains(c) == 7
        assert disk.location(c[0]) == (seg0, 2 * PAGE, SLOT)
        stats = disk.stats()
        assert (stats.evictions, stats.objects, stats.used_bytes) == (14, 21, 2 * SEG)
        assert segments(tmp_path) == [seg0, seg1] and on_disk(tmp_path) == 2 * SEG
    # c is exactly as long as a1 was: the walk lands on a2's old header, whole and
    # valid but of the earlier generation, and must stop there
    raw = seg0.read_bytes()
    head = _record.SegmentHead.decode(raw[:PAGE])
    stale = _record.RecordHeader.decode(raw[PAGE + record(7) :][:PAGE])
    assert stale.keys == tuple(a2) and stale.generation != head.generation
    originals = [data(tier, 28 + i) for i in range(7)]
    tier.memory[35:].zero_()
    with engine_on(tmp_path, tier, capacity_bytes=2 * SEG) as (disk, engine):
        assert disk.stats().recovered == 21
        assert disk.contains(a1) == disk.contains(a2) == 0
        assert load(engine, c, list(range(35, 42))).success  # type: ignore[attr-defined]
        assert [data(tier, 35 + i) for i in range(7)] == originals
        assert disk.stats().used_bytes == 2 * SEG == on_disk(tmp_path)


def test_capacity_is_whole_segments_exact_across_restart(tmp_path: Path) -> None:
    tier = make_tier(48)
    with engine_on(tmp_path, tier, capacity_bytes=3 * SEG) as (disk, engine):
        for j in range(5):  # 12 objects a segment at most: 5 x 6 fill three segments
            assert store(engine, list(range(6)), keys(j * 6, j * 6 + 6)).success  # type: ignore[attr-defined]
        assert disk.stats().used_bytes == 3 * SEG == on_disk(tmp_path)
        # the five records were 6, 6, 2 | 4, 6, 4 | 2 (each cut to fill a segment's
        # rest). A job larger than the cap holds: records of 12 (the third segment's
        # rest), 14 and 14 (in the two segments it empties), then 8, which finds every
        # segment holding a record being written, and fails
        r = store(engine, list(range(48)), keys(100, 148))
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        assert disk.contains(keys(100, 148)) == 40 and disk.stats().store_failures == 8
        assert disk.stats().used_bytes == 3 * SEG == on_disk(tmp_path)
        live = [k for k in keys(0, 30) + keys(100, 148) if disk.contains([k])]
    with engine_on(tmp_path, tier, capacity_bytes=3 * SEG) as (disk, _engine):
        assert disk.stats().used_bytes == 3 * SEG == on_disk(tmp_path)
        assert [k for k in keys(0, 30) + keys(100, 148) if disk.contains([k])] == live
    with engine_on(tmp_path, tier, capacity_bytes=SEG) as (disk, _engine):
        # a smaller cap: whole segments went, their files with them
        assert disk.stats().used_bytes == SEG == on_disk(tmp_path)
        assert len(segments(tmp_path)) == 1


def test_recycling_under_concurrent_stores_and_loads_never_serves_wrong_bytes(
    tmp_path: Path,
) -> None:
    """Four threads store and load more than the cap holds, so segments are emptied
    and reused while loads run: every load gets each key's own bytes or a miss
    (its block zeroed), never another key's or an earlier use's."""
    tier = make_tier(64, seed=5)
    originals = {b: data(tier, b) for b in range(32)}
    with engine_on(tmp_path, tier, capacity_bytes=3 * SEG, queue_depth=2) as (disk, engine):

        def worker(t: int) -> None:
            for rnd in range(6):
                ids = list(range(t * 8, t * 8 + 8))  # blocks 0..31 hold the originals
                ks = keys(1000 * rnd + 100 * t, 1000 * rnd + 100 * t + 8)
                r = store(engine, ids, ks)
                assert r.success or isinstance(r.error, TierFullError), r  # type: ignore[attr-defined]
                dest = [32 + t * 8 + i for i in range(8)]
                r = load(engine, ks, dest)
                err = r.error  # type: ignore[attr-defined]
                missing = set(err.missing) if isinstance(err, KeyMissError) else set()
                assert r.success or missing, r  # type: ignore[attr-defined]
                for k, b, d in zip(ks, ids, dest, strict=True):
                    want = bytes(BLOCK) if k in missing else originals[b]
                    assert data(tier, d) == want

        in_threads(worker, 4)
        stats = disk.stats()
        assert stats.evictions > 0 and stats.corrupt == 0
        assert stats.used_bytes == 3 * SEG == on_disk(tmp_path)
        stored = [
            keys(1000 * r + 100 * t, 1000 * r + 100 * t + 8) for t in range(4) for r in range(6)
        ]
        live = [k for ks in stored for k in ks if disk.contains([k])]
    # after a restart: the same keys, each with its own bytes
    tier.memory[32:].zero_()
    with engine_on(tmp_path, tier, capacity_bytes=3 * SEG) as (disk, engine):
        assert disk.stats().recovered == len(live) > 0
        for n, k in enumerate(live[:32]):
            i = int.from_bytes(k[:32], "big")  # key(i): thread (i % 1000) // 100, block i % 100
            assert load(engine, [k], [32 + n]).success  # type: ignore[attr-defined]
            assert data(tier, 32 + n) == originals[(i % 1000) // 100 * 8 + i % 100]


def test_a_segment_with_an_object_being_read_is_not_recycled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    with engine_on(tmp_path, tier, capacity_bytes=SEG) as (disk, engine):
        assert store(engine, list(range(12)), keys(0, 12)).success  # type: ignore[attr-defined]
        job, release = load_held_in_flight(engine, monkeypatch, key(3), 20)
        r = store(engine, list(range(12, 16)), keys(12, 16))
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        release.set()
        [done] = engine.wait([job], timeout=30)
        assert done.success and data(tier, 20) == data(tier, 3)  # type: ignore[attr-defined]
        assert disk.contains(keys(0, 12)) == 12
        assert store(engine, list(range(12, 16)), keys(12, 16)).success  # type: ignore[attr-defined]
        assert disk.contains(keys(0, 12)) == 0


# ------------------------------------------------------------------ disk full


def test_disk_full_on_a_small_tmpfs(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    tier = make_tier(48)
    with _mounted(small, f"size={SEG * 5 // 2}") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs is refused here; the injected ENOSPC tests cover it")
        with engine_on(small, tier) as (disk, engine):
            assert SEG - PAGE - record(14) < record(1)
            for j in range(2):  # a record of 14 objects fills a segment
                r = store(engine, list(range(j * 14, j * 14 + 14)), keys(j * 14, j * 14 + 14))
                assert r.success  # type: ignore[attr-defined]
            # the third segment cannot be preallocated: its record fails, nothing else
            r = store(engine, list(range(28, 40)), keys(28, 40))
            assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
            assert disk.contains(keys(0, 40)) == 28 and disk.stats().store_failures == 12
            tier.memory[36:48].zero_()
            assert load(engine, keys(6, 18), list(range(36, 48))).success  # type: ignore[attr-defined]
            assert all(data(tier, 36 + i) == data(tier, 6 + i) for i in range(12))
        with engine_on(small, tier) as (disk, _engine):
            assert disk.stats().recovered == 28
            assert disk.stats().used_bytes == 2 * SEG == on_disk(small)


def test_enospc_preallocating_a_segment_fails_its_records_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    calls = [0]
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with engine_on(tmp_path, tier) as (disk, engine):
        r = store(engine, [0, 1], keys(0, 2))
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        assert disk.contains(keys(0, 2)) == 0 and disk.stats().store_failures == 2
        # the engine serves on: the next record prepares the segment again
        assert store(engine, [0, 1, 2], keys(0, 3)).success  # type: ignore[attr-defined]
        tier.memory[8:11].zero_()
        assert load(engine, keys(0, 3), [8, 9, 10]).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(3))
        assert disk.stats().used_bytes == SEG == on_disk(tmp_path)
    with engine_on(tmp_path, tier) as (disk, _engine):
        assert disk.stats().recovered == 3


def test_enospc_writing_a_record_leaves_a_hole_the_restart_steps_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    real = _io.pwritev
    fail = [True]

    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        if fail[0] and sum(b.nbytes for b in bufs) == 3 * SLOT:  # the second record's slots
            fail[0] = False
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(real(fd, bufs, offset))

    monkeypatch.setattr(_io, "pwritev", pwritev)
    with engine_on(tmp_path, tier) as (disk, engine):
        assert store(engine, [0, 1], keys(0, 2)).success  # type: ignore[attr-defined]
        r = store(engine, [2, 3, 4], keys(2, 5))
        assert isinstance(r.error, TierFullError)  # type: ignore[attr-defined]
        assert store(engine, [5, 6], keys(5, 7)).success  # type: ignore[attr-defined]
        assert disk.location(key(5)) == (
            segments(tmp_path)[0],
            PAGE + record(2) + record(3) + PAGE,
            SLOT,
        )
        assert [disk.contains([k]) for k in keys(0, 7)] == [1, 1, 0, 0, 0, 1, 1]
    tier.memory[8:].zero_()
    with engine_on(tmp_path, tier) as (disk, engine):
        assert disk.stats().recovered == 4  # the records on both sides of the hole
        assert [disk.contains([k]) for k in keys(0, 7)] == [1, 1, 0, 0, 0, 1, 1]
        assert load(engine, [key(0), key(1), key(5), key(6)], [8, 9, 10, 11]).success  # type: ignore[attr-defined]
        assert [data(tier, b) for b in (8, 9, 10, 11)] == [data(tier, b) for b in (0, 1, 5, 6)]


# ------------------------------------------------------------------ crash mid-write

_WRITER = r"""
import os, sys, threading
from offload_engine.disk.handler import disk_handlers
from offload_engine.disk import _io
from offload_engine.disk.store import DiskStore
from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, disk_blocks
from tests.test_disk_segments import BLOCK, SEG, digest, keys, make_tier

real = _io.pwritev
count = [0]
where = sys.argv[2]  # "slots": die halfway through the second record's slots
                     # "header": die after its slots, before its header

def pwritev(fd, bufs, offset):
    count[0] += 1
    # calls: 1 segment head, 2 record 1 slots, 3 its header, 4 record 2 slots, 5 its header
    if (where == "slots" and count[0] == 4) or (where == "header" and count[0] == 5):
        if where == "slots":
            os.pwritev(fd, [bufs[0][: BLOCK // 2]], offset)  # aligned: O_DIRECT takes it
        sys.stdout.write("MID-WRITE\n")
        sys.stdout.flush()
        threading.Event().wait()  # until SIGKILL
    return real(fd, bufs, offset)

_io.pwritev = pwritev
tier = make_tier(8, seed=11)
store = DiskStore(
    sys.argv[1], digest(), capacity_bytes=4 * SEG, segment_bytes=SEG, pack_bytes=0, queue_depth=1
)
engine = SyncOffloadingEngine(disk_handlers(store, tier))
engine.wait([engine.submit(TransferSpec(cpu_blocks(range(4)), disk_blocks(keys(0, 4))))])
engine.wait([engine.submit(TransferSpec(cpu_blocks(range(4, 8)), disk_blocks(keys(4, 8))))])
"""


@pytest.mark.parametrize("where", ["slots", "header"])
def test_a_writer_killed_mid_record_leaves_nothing_of_it_in_the_index(
    tmp_path: Path, where: str
) -> None:
    with killed_mid_write(_WRITER, str(tmp_path), where):
        pass
    [seg0] = segments(tmp_path)
    # the second record's header page was never written (preallocated: zeros)
    with pytest.raises(TrailerError, match="magic"):
        _record.RecordHeader.needed(seg0.read_bytes()[PAGE + record(4) :][:PAGE])
    tier = make_tier(16, seed=11)  # the writer's data in blocks 0..7
    with engine_on(tmp_path, tier, capacity_bytes=4 * SEG) as (disk, engine):
        stats = disk.stats()
        assert (stats.recovered, stats.used_bytes) == (4, SEG)
        assert disk.contains(keys(0, 8)) == 4 and disk.contains(keys(4, 8)) == 0
        assert load(engine, keys(0, 4), [8, 9, 10, 11]).success  # type: ignore[attr-defined]
        assert all(data(tier, 8 + i) == data(tier, i) for i in range(4))
        # stored again after the restart: into a new segment, never over the torn tail
        assert store(engine, [4, 5, 6, 7], keys(4, 8)).success  # type: ignore[attr-defined]
        where_now = disk.location(key(4))
        assert where_now is not None and where_now[0] != seg0
