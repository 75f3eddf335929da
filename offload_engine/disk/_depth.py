"""The disk tier's default I/O depth, derived from the block device under its directory.

Each I/O thread keeps one request (``os.preadv``/``os.pwritev``, about
``pack_bytes`` long) on the drive, so the number of threads per direction is the
queue depth the drive sees. What a drive can overlap shows in sysfs: a spinning
disk (``queue/rotational`` = 1) serves one request at a time and a few queued
ones let it reorder, more only add seeks; a solid-state device serves one
stream of requests per hardware queue (``mq/<n>``), and a few large requests
per queue keep it streaming. Every thread needs a CPU to issue and finish its
requests, so beyond two per CPU they only contend; the block layer holds at
most ``queue/nr_requests`` requests per queue. When nothing can be read (no
block device behind the filesystem: tmpfs, overlay, network filesystems; no
``/sys``), the depth is :data:`FALLBACK_DEPTH`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FALLBACK_DEPTH = 4
"""The depth when the device cannot be read: a few requests overlap on any drive."""

ROTATIONAL_DEPTH = 4
"""A spinning disk's depth: enough queued requests for the drive to reorder."""

PER_HW_QUEUE = 8
"""Requests per hardware queue of a solid-state device: one being transferred and
several queued behind it, so the queue never runs dry between two requests."""

MIN_DEPTH = 4
"""The least depth derived for a solid-state device (a one-queue device still
overlaps the next request's setup with the current one's transfer)."""

MAX_DERIVED_DEPTH = 32
"""The most depth derived: 32 requests of ``pack_bytes`` (1 MiB) keep any drive's
channels busy; a user may ask for more (up to ``MAX_QUEUE_DEPTH``)."""


@dataclass(frozen=True)
class DiskDepth:
    """The I/O threads per direction of a :class:`~offload_engine.DiskStore`, and why.

    ``source``: ``"explicit"`` (the user's ``queue_depth``), ``"sysfs"`` (derived
    from the block device) or ``"fallback"`` (nothing could be read).
    ``device``: the block device it was derived from (``"nvme0n1"``), or ``None``.
    ``reason``: the facts and the rule, in words.
    """

    depth: int
    source: str
    device: str | None
    reason: str

    def __str__(self) -> str:
        return f"{self.depth} ({self.source}: {self.reason})"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _whole_disk(sysfs_root: Path, st_dev: int) -> Path | None:
    """The sysfs directory of the whole block device that holds ``st_dev``
    (a partition's parent; the first member of a device-mapper or md device)."""
    node = sysfs_root / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        where = node.resolve(strict=True)
    except OSError:
        return None
    for _ in range(8):  # stacked devices nest a few levels at most
        if (where / "partition").exists():
            where = where.parent
        try:
            members = sorted((where / "slaves").iterdir())
        except OSError:
            members = []
        if not members:
            break
        try:
            where = members[0].resolve(strict=True)
        except OSError:
            return None
    return where if (where / "queue").is_dir() else None


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def derive_queue_depth(
    path: str | os.PathLike[str],
    *,
    sysfs_root: str | os.PathLike[str] = "/sys",
    cpus: int | None = None,
) -> DiskDepth:
    """The default I/O depth for a disk tier in ``path`` (see the module's docstring).

    * a spinning disk: :data:`ROTATIONAL_DEPTH`;
    * a solid-state device with ``q`` hardware queues: ``PER_HW_QUEUE * q``, at
      most two per CPU (``cpus``, default: the CPUs this process may use) and
      ``queue/nr_requests``, at least :data:`MIN_DEPTH`, at most
      :data:`MAX_DERIVED_DEPTH`;
    * no block device to read: :data:`FALLBACK_DEPTH`.

    ``sysfs_root`` is where sysfs is mounted (tests point it at a fake tree).
    """
    cpus = usable_cpus() if cpus is None else max(1, cpus)
    root = Path(sysfs_root)
    try:
        st_dev = os.stat(path).st_dev
    except OSError as exc:
        return DiskDepth(FALLBACK_DEPTH, "fallback", None, f"cannot stat {path}: {exc}")
    disk = _whole_disk(root, st_dev)
    if disk is None:
        return DiskDepth(
            FALLBACK_DEPTH,
            "fallback",
            None,
            f"no block device under {root} for device {os.major(st_dev)}:{os.minor(st_dev)} "
            "(tmpfs, overlay or network filesystem)",
        )
    name = disk.name
    queue = disk / "queue"
    rotational = _read_int(queue / "rotational")
    if rotational is None:
        return DiskDepth(FALLBACK_DEPTH, "fallback", name, f"{name}: queue/rotational unreadable")
    if rotational:
        return DiskDepth(ROTATIONAL_DEPTH, "sysfs", name, f"{name}: rotational")
    try:
        hw_queues = sum(1 for q in (disk / "mq").iterdir() if q.is_dir()) or 1
    except OSError:
        hw_queues = 1
    nr_requests = _read_int(queue / "nr_requests")
    depth = min(PER_HW_QUEUE * hw_queues, 2 * cpus)
    if nr_requests is not None and nr_requests > 0:
        depth = min(depth, nr_requests)
    depth = min(MAX_DERIVED_DEPTH, max(MIN_DEPTH, depth))
    return DiskDepth(
        depth,
        "sysfs",
        name,
        f"{name}: solid-state, {hw_queues} hardware queue(s), nr_requests {nr_requests}, "
        f"{cpus} CPU(s): min({PER_HW_QUEUE}/queue, 2/CPU, nr_requests) in "
        f"[{MIN_DEPTH}, {MAX_DERIVED_DEPTH}]",
    )
