"""The disk tier's default queue depth, derived from a fake sysfs tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from offload_engine import DiskStore, LayoutDigest, disk_handlers, page_aligned_tier
from offload_engine.disk._depth import (
    FALLBACK_DEPTH,
    MAX_DERIVED_DEPTH,
    ROTATIONAL_DEPTH,
    derive_queue_depth,
)
from offload_engine.errors import ConfigError


def fake_disk(
    sysfs: Path,
    data: Path,
    name: str,
    *,
    rotational: int | str = 0,
    nr_requests: int | None = 128,
    hw_queues: int = 1,
    partition: bool = False,
) -> Path:
    """A whole disk ``name`` under ``sysfs``/devices, with ``data``'s device number
    pointing at it (or at a partition of it)."""
    disk = sysfs / "devices" / "pci0000:00" / name
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "rotational").write_text(f"{rotational}\n")
    if nr_requests is not None:
        (disk / "queue" / "nr_requests").write_text(f"{nr_requests}\n")
    for q in range(hw_queues):
        (disk / "mq" / str(q)).mkdir(parents=True)
    target = disk
    if partition:
        target = disk / f"{name}p1"
        target.mkdir()
        (target / "partition").write_text("1\n")
    link(sysfs, data, target)
    return disk


def link(sysfs: Path, data: Path, target: Path) -> None:
    dev = os.stat(data).st_dev
    node = sysfs / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    node.parent.mkdir(parents=True, exist_ok=True)
    node.symlink_to(target)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


def test_an_nvme_drive_gets_8_per_queue_bounded_by_two_per_cpu(tmp_path: Path, data: Path) -> None:
    sysfs = tmp_path / "sys"
    fake_disk(sysfs, data, "nvme0n1", nr_requests=1023, hw_queues=2)
    depth = derive_queue_depth(data, sysfs_root=sysfs, cpus=64)
    assert (depth.depth, depth.source, depth.device) == (16, "sysfs", "nvme0n1")
    assert "2 hardware queue(s)" in depth.reason
    # two threads per CPU at most
    assert derive_queue_depth(data, sysfs_root=sysfs, cpus=3).depth == 6
    # never past MAX_DERIVED_DEPTH, never under 4
    assert derive_queue_depth(data, sysfs_root=sysfs, cpus=1).depth == 4


def test_many_queues_stop_at_the_cap(tmp_path: Path, data: Path) -> None:
    sysfs = tmp_path / "sys"
    fake_disk(sysfs, data, "nvme0n1", nr_requests=1023, hw_queues=64)
    assert derive_queue_depth(data, sysfs_root=sysfs, cpus=128).depth == MAX_DERIVED_DEPTH


def test_nr_requests_bounds_the_depth(tmp_path: Path, data: Path) -> None:
    sysfs = tmp_path / "sys"
    fake_disk(sysfs, data, "vda", nr_requests=6, hw_queues=4)
    assert derive_queue_depth(data, sysfs_root=sysfs, cpus=16).depth == 6


def test_a_loop_device_with_one_queue(tmp_path: Path, data: Path) -> None:
    sysfs = tmp_path / "sys"
    fake_disk(sysfs, data, "loop0", nr_requests=128, hw_queues=1)
    assert derive_queue_depth(data, sysfs_root=sysfs, cpus=2).depth == 4
    assert derive_queue_depth(data, sysfs_root=sysfs, cpus=16).depth == 8


def test_a_spinning_disk(tmp_path: Path, data: Path) -> None:
    sysfs = tmp_path / "sys"
    fake_disk(sysfs, data, "sda", rotational=1, hw_queues=8)
    depth = derive_queue_depth(data, sysfs_root=sysfs, cpus=32)
    assert (depth.depth, depth.source, depth.device) == (ROTATIONAL_DEPTH, "sysfs", "sda")


def test_a_partition_reads_its_whole_disk(tmp_path: Path, data: Path) -> None:
    sysfs = tmp_path / "sys"
    fake_disk(sysfs, data, "nvme0n1", nr_requests=1023, hw_queues=4, partition=True)
    depth = derive_queue_depth(data, sysfs_root=sysfs, cpus=8)
    assert (depth.depth, depth.device) == (16, "nvme0n1")


def test_a_device_mapper_device_reads_its_member(tmp_path: Path, data: Path) -> None:
    sysfs = tmp_path / "sys"
    member = sysfs / "devices" / "pci0000:00" / "nvme0n1"
    (member / "queue").mkdir(parents=True)
    (member / "queue" / "rotational").write_text("0\n")
    (member / "queue" / "nr_requests").write_text("1023\n")
    for q in range(4):
        (member / "mq" / str(q)).mkdir(parents=True)
    dm = sysfs / "devices" / "virtual" / "block" / "dm-0"
    (dm / "queue").mkdir(parents=True)
    (dm / "queue" / "rotational").write_text("0\n")
    (dm / "slaves").mkdir()
    (dm / "slaves" / "nvme0n1").symlink_to(member)
    link(sysfs, data, dm)
    depth = derive_queue_depth(data, sysfs_root=sysfs, cpus=16)
    assert (depth.depth, depth.device) == (32, "nvme0n1")


@pytest.mark.parametrize(
    "broken",
    ["no device node", "no queue", "unreadable rotational", "no sysfs"],
)
def test_nothing_readable_falls_back(tmp_path: Path, data: Path, broken: str) -> None:
    sysfs = tmp_path / "sys"
    if broken == "no device node":
        (sysfs / "dev" / "block").mkdir(parents=True)
    elif broken == "no queue":
        disk = sysfs / "devices" / "virtual" / "block" / "zram0"
        disk.mkdir(parents=True)
        link(sysfs, data, disk)
    elif broken == "unreadable rotational":
        fake_disk(sysfs, data, "vdb", rotational="garbage")
    depth = derive_queue_depth(data, sysfs_root=sysfs, cpus=4)
    assert (depth.depth, depth.source) == (FALLBACK_DEPTH, "fallback")
    assert depth.reason


def test_a_missing_directory_falls_back(tmp_path: Path) -> None:
    depth = derive_queue_depth(tmp_path / "absent", sysfs_root=tmp_path, cpus=4)
    assert (depth.depth, depth.source) == (FALLBACK_DEPTH, "fallback")


def _digest() -> LayoutDigest:
    return LayoutDigest(model="m", dtype="uint8", block_size=16, chunk_blocks=1, page_bytes=4096)


def test_the_store_derives_its_depth_and_an_explicit_one_wins(tmp_path: Path) -> None:
    with DiskStore(tmp_path, _digest(), capacity_bytes=2**24) as store:
        derived = derive_queue_depth(tmp_path)
        assert store.queue_depth == derived.depth == store.depth.depth
        assert store.depth.source in ("sysfs", "fallback")
        stats = store.stats()
        assert stats.queue_depth == derived.depth
        assert stats.queue_depth_from == str(store.depth)
        assert f"queue_depth={derived.depth} ({derived.source}" in repr(store)
        assert len(store._readers.threads) == len(store._writers.threads) == derived.depth
    explicit = derived.depth + 3
    with DiskStore(tmp_path, _digest(), capacity_bytes=2**24, queue_depth=explicit) as store:
        assert (store.queue_depth, store.depth.source) == (explicit, "explicit")
        assert store.stats().queue_depth == explicit
        assert len(store._readers.threads) == explicit


@pytest.mark.parametrize("bad", [0, -1, 257, 2.0, "4", True])
def test_a_bad_explicit_depth_is_a_config_error(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="queue_depth"):
        DiskStore(tmp_path, _digest(), capacity_bytes=2**24, queue_depth=bad)  # type: ignore[arg-type]


def test_the_handlers_take_two_jobs_per_io_thread_past_eight(tmp_path: Path) -> None:
    tier = page_aligned_tier(4, 4096)
    for depth, want in ((4, 16), (8, 16), (32, 64)):
        with DiskStore(tmp_path, _digest(), capacity_bytes=2**24, queue_depth=depth) as store:
            assert [h.max_inflight for h in disk_handlers(store, tier)] == [want, want]
            assert [h.max_inflight for h in disk_handlers(store, tier, max_inflight=3)] == [3, 3]
            with pytest.raises(ConfigError, match="max_inflight"):
                disk_handlers(store, tier, max_inflight=0)
