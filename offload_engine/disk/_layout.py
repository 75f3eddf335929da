"""The disk tier's directory: its lock, its ``config.json``, and the geometry of
its segments.

``config.json`` holds the :class:`~offload_engine.keyed.LayoutDigest` and
``"store": {"format": "segments", "segment_bytes": N}``. A directory whose config
names no store, or another one, was written by an older version in another
on-disk layout (a file per object, pack files): it is refused with
:class:`~offload_engine.TierUnavailableError`, or emptied when the store is
opened with ``on_foreign_layout="wipe"``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from offload_engine.disk._record import MAX_RECORD_SLOTS, PAGE, max_header_bytes, slot_bytes
from offload_engine.errors import ConfigError, LayoutMismatchError, TierUnavailableError
from offload_engine.keyed import LayoutDigest

log = logging.getLogger("offload_engine.disk")

SEGMENT_BYTES = 128 * 2**20
"""The largest segment a new directory gets by default (``segment_bytes=None``:
a 16th of ``capacity_bytes``, at most this), and a reasonable explicit size for a
large tier."""

OnForeignLayout = Literal["error", "wipe"]
ON_FOREIGN_LAYOUT = ("error", "wipe")

# what older layouts and this one keep in the directory (all a wipe removes)
_OLDER_DIRS = ("objects", "packs")
_OWN = ("config.json", "config.json.tmp", "segments", *_OLDER_DIRS)


@dataclass(frozen=True)
class Geometry:
    """How objects of ``payload_bytes`` lie in segments of ``segment_bytes``."""

    payload_bytes: int
    segment_bytes: int

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.payload_bytes)

    @property
    def record_max(self) -> int:
        """The most objects one record may hold (what fits an empty segment); 0 if
        not even one does."""
        room = self.segment_bytes - PAGE  # page 0 is the segment head
        slot = self.slot_bytes
        for k in range(MAX_RECORD_SLOTS, 0, -1):
            if max_header_bytes(k) + k * slot <= room:
                return k
        return 0

    @property
    def per_segment(self) -> int:
        """The fewest objects a segment holds, however jobs group them into records.

        Each object costs its slot and at most one header page (a record of one
        object with the longest key; a record of k keys has a header of at most k
        pages), and a segment is left only when not even one more object with its
        header fits the rest, so it holds at least ``room // (slot + header)``.
        """
        return (self.segment_bytes - PAGE) // (self.slot_bytes + max_header_bytes(1))

    def capacity_for(self, objects: int) -> int:
        """The cap, in whole segments, that holds ``objects`` objects at once."""
        per = self.per_segment
        if per < 1:
            raise ConfigError(self._too_small())
        return max(1, -(-objects // per)) * self.segment_bytes

    def check(self, capacity_bytes: int) -> None:
        """:class:`ConfigError` unless a segment holds an object and the cap a segment."""
        if self.segment_bytes % PAGE:
            raise ConfigError(f"DiskStore segment_bytes must be a multiple of {PAGE}")
        if not self.record_max:
            raise ConfigError(self._too_small())
        if capacity_bytes < self.segment_bytes:
            raise ConfigError(
                f"DiskStore capacity_bytes={capacity_bytes} is less than one segment "
                f"({self.segment_bytes} bytes)"
            )

    def _too_small(self) -> str:
        return (
            f"DiskStore segment_bytes={self.segment_bytes} cannot hold one object of "
            f"{self.payload_bytes} bytes (needs >= {smallest_segment(self.payload_bytes)})"
        )


def smallest_segment(payload_bytes: int) -> int:
    """The smallest segment that holds one object of ``payload_bytes``."""
    return PAGE + max_header_bytes(1) + slot_bytes(payload_bytes)


def default_segment_bytes(capacity_bytes: int, payload_bytes: int) -> int:
    """A new directory's segment size: a 16th of the cap, at most
    :data:`SEGMENT_BYTES`, at least what one object needs."""
    sixteenth = capacity_bytes // 16 // PAGE * PAGE
    return max(min(SEGMENT_BYTES, sixteenth), smallest_segment(payload_bytes))


def lock_directory(path: Path) -> int:
    """Open and ``flock`` ``path/lock``: one store per directory."""
    if not path.is_dir():
        raise TierUnavailableError(f"disk tier directory {path} does not exist")
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise TierUnavailableError(
            f"disk tier directory {path} is not writable: {exc.strerror}"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise TierUnavailableError(
            f"disk tier directory {path} is in use by another DiskStore (flock: {exc.strerror})"
        ) from exc
    return fd


def _store_entry(segment_bytes: int) -> dict[str, object]:
    return {"format": "segments", "segment_bytes": segment_bytes}


def _foreign(path: Path, data: dict[str, object] | None) -> str | None:
    """What older or unknown layout ``path`` holds, or ``None`` if none."""
    if data is not None:
        have = data.get("store")
        if have is None:
            return 'files-and-packs layout (a config.json with no "store" entry)'
        if not isinstance(have, dict) or have.get("format") != "segments":
            return f"unknown store layout {json.dumps(have)}"
    found = [d for d in _OLDER_DIRS if (path / d).exists()]
    if found:
        return f"files-and-packs layout ({' and '.join(f'{d}/' for d in found)})"
    return None


def _wipe(path: Path, what: str) -> None:
    log.warning(
        "disk tier directory %s held the %s; deleting it (on_foreign_layout='wipe')", path, what
    )
    try:
        for name in _OWN:
            entry = path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
    except OSError as exc:
        raise TierUnavailableError(
            f"disk tier directory {path}: could not delete the {what}: {exc}"
        ) from exc


def _read_config(config: Path) -> dict[str, object] | None:
    try:
        text = config.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        LayoutDigest.from_json(json.dumps(data["layout"]))
    except LayoutMismatchError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise LayoutMismatchError(f"{config} is not a disk tier config: {exc}") from exc
    return data


def open_config(
    path: Path,
    digest: LayoutDigest,
    *,
    segment_bytes: int | None,
    capacity_bytes: int,
    on_foreign_layout: OnForeignLayout,
) -> int:
    """Check (or write) ``path/config.json``; the directory's segment size.

    ``segment_bytes`` ``None`` follows the directory (a new one gets
    :func:`default_segment_bytes`); a number must match it
    (:class:`LayoutMismatchError`). A directory of an older layout raises
    :class:`TierUnavailableError` or, with ``on_foreign_layout="wipe"``, is
    emptied and opened as a new one.
    """
    config = path / "config.json"
    data = _read_config(config)
    foreign = _foreign(path, data)
    if foreign is not None:
        if on_foreign_layout != "wipe":
            raise TierUnavailableError(
                f"disk tier directory {path} holds the {foreign} of an older offload-engine; "
                "this version reads only the segment layout. Give the tier an empty directory, "
                "delete this one's contents, or open it with on_foreign_layout='wipe' to have "
                "them deleted"
            )
        _wipe(path, foreign)
        data = None
    if data is not None:
        found = LayoutDigest.from_json(json.dumps(data["layout"]))
        digest.check_same(found, where=f"disk tier directory {path}")
        have = data["store"]
        try:
            size = int(have["segment_bytes"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError) as exc:
            raise LayoutMismatchError(f"{config} names no segment size: {exc}") from exc
        if segment_bytes is not None and segment_bytes != size:
            raise LayoutMismatchError(
                f"disk tier directory {path} was written with segment_bytes={size}; "
                f"this store was opened with segment_bytes={segment_bytes}"
            )
        return size
    size = (
        default_segment_bytes(capacity_bytes, digest.page_bytes)
        if segment_bytes is None
        else segment_bytes
    )
    Geometry(digest.page_bytes, size).check(capacity_bytes)
    body = {"layout": json.loads(digest.to_json()), "store": _store_entry(size)}
    tmp = config.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, config)
    except OSError as exc:
        raise TierUnavailableError(
            f"disk tier directory {path} is not writable: {exc.strerror}"
        ) from exc
    return size
