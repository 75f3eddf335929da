"""The disk tier's store path: a job's objects grouped into records, each record
placed in a segment under the index lock and written by a pool thread.

A record's slots are written first and its header after them, so a killed
writer leaves nothing a restart indexes. The head of a segment's generation is
written once per use, before any of its records.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Literal

from offload_engine.disk._index import Index, Record, Segment
from offload_engine.disk._io import O_DIRECT, Job, Pool, split, sync_dir, write_all
from offload_engine.disk._record import PAGE, RecordHeader, SegmentHead
from offload_engine.errors import TierFullError, TransferError
from offload_engine.keyed import Trailer

log = logging.getLogger("offload_engine.disk")

FsyncPolicy = Literal["never", "data", "always"]
Done = Callable[[int, BaseException | None], None]
_Unit = tuple[Record, list[memoryview]]
"""What one write request stores: a record and its objects' payloads."""


class Writer:
    """Stores jobs' objects into records; see :meth:`DiskStore.start_store`."""

    def __init__(
        self,
        index: Index,
        pool: Pool,
        *,
        fsync: FsyncPolicy,
        queue_depth: int,
        record_min: int,
        record_max: int,
        tail_bytes: int,
        check_open: Callable[[], None],
    ) -> None:
        self.check_open = check_open  # called under the lock: a closed store queues nothing
        self.index = index
        self.pool = pool
        self.fsync = fsync
        self.queue_depth = queue_depth
        self.record_min = record_min  # a record holds >= pack_bytes ...
        self.record_max = record_max  # ... and at most what fits a segment
        self.tail_bytes = tail_bytes  # a slot's bytes after its payload
        self._made_root = False

    def record_slots(self, n: int) -> int:
        """Objects per record for a job storing ``n``: >= pack_bytes, one record per
        I/O thread for a large job, no more than a segment holds."""
        return min(self.record_max, max(self.record_min, -(-n // self.queue_depth)))

    def start(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], direct: bool, done: Done
    ) -> None:
        """Place the job's new objects and queue their writes; never blocks on I/O."""
        index = self.index
        units: list[_Unit] = []
        full: list[bytes] = []
        with index.lock:
            self.check_open()
            fresh: dict[bytes, memoryview] = {}
            for key, payload in zip(keys, payloads, strict=True):
                if key in index.entries or key in fresh:
                    index.counts["already_stored"] += 1
                    index.policy.touched(key)
                else:
                    fresh[key] = payload
            new = list(fresh.items())
            per = self.record_slots(len(new))
            i = 0
            while i < len(new):
                # a record that does not fit the rest of the active segment is cut
                # to what does, so a segment's tail is not left empty
                group = index.fit_active_locked([k for k, _ in new[i : i + per]])
                payload_views = [p for _, p in new[i : i + len(group)]]
                i += len(group)
                record = index.add_record_locked(group)
                if record is None:
                    full += group
                else:
                    units.append((record, payload_views))
            index.counts["store_failures"] += len(full)
        batches = split(units, self.queue_depth)
        job = Job(max(1, len(batches)), self._report(done, full))
        if not units:
            job.finish_batch(0)
            return
        for batch in batches:
            self.pool.put(functools.partial(self._write_batch, job, batch, direct))

    def _report(self, done: Done, full: list[bytes]) -> Callable[[Job], None]:
        def report(job: Job) -> None:
            if not full and not job.errors:
                done(job.nbytes, None)
                return
            failed = [k.hex()[:16] for k in full] + [k.hex()[:16] for k, _ in job.errors]
            error: TransferError
            causes = [e for _, e in job.errors]
            if full or any(getattr(e, "errno", None) == errno.ENOSPC for e in causes):
                error = TierFullError(
                    f"{len(failed)} object(s) not stored, the disk tier is full "
                    f"(cap {self.index.capacity_bytes} bytes or ENOSPC): {failed[:4]}"
                )
            else:
                error = TransferError(f"{len(failed)} object(s) not stored: {failed[:4]}")
            if causes:
                error.__cause__ = causes[0]
            done(job.nbytes, error)

        return report

    def _write_batch(self, job: Job, batch: list[_Unit], direct: bool, scratch: mmap.mmap) -> None:
        index = self.index
        nbytes = 0
        try:
            for record, payloads in batch:
                with index.lock:  # loads go first
                    while index.loads_active:
                        index.loads_idle.wait()
                seg = record.seg  # stable while the record is being written
                try:
                    self._write_record(seg, record, payloads, direct, scratch)
                except Exception as exc:  # noqa: BLE001 - reported in the job's result
                    self._write_hole(seg, record, direct, scratch)
                    with index.lock:
                        index.record_failed_locked(record)
                    with job.lock:
                        job.errors += [(key, exc) for key in record.keys]
                    continue
                with index.lock:
                    index.record_written_locked(record)
                nbytes += sum(p.nbytes for p in payloads)
        finally:
            job.finish_batch(nbytes)

    def _open(self, seg: Segment, flags: int, direct: bool) -> int:
        if not self._made_root:
            seg.path.parent.mkdir(exist_ok=True)
            self._made_root = True  # a bool store is atomic under the GIL
        flags |= os.O_CLOEXEC | (O_DIRECT if direct else 0)
        return os.open(seg.path, flags, 0o644)

    def _prepare_segment(self, seg: Segment, generation: int, fd: int, page: memoryview) -> None:
        """Create and preallocate ``seg``'s file (first use), and write the head of
        ``generation`` before any of its records (each use, once)."""
        with seg.prep:
            if seg.ready == generation:
                return
            if seg.fresh:
                os.posix_fallocate(fd, 0, self.index.segment_bytes)
                seg.fresh = False
                if self.fsync == "always":
                    sync_dir(seg.path.parent)
            page[:] = SegmentHead(self.index.segment_bytes, generation).encode()
            write_all(fd, [page], PAGE, 0)
            for base, size, gen in seg.holes:
                if gen == generation:
                    page[:] = RecordHeader((), size - PAGE, gen).encode()
                    write_all(fd, [page], PAGE, base)
            seg.holes = []
            if self.fsync != "never":
                os.fdatasync(fd)
            seg.ready = generation

    def _write_record(
        self,
        seg: Segment,
        record: Record,
        payloads: list[memoryview],
        direct: bool,
        scratch: mmap.mmap,
    ) -> None:
        """Slots first, then (once they are written) the header that makes them a
        record: a killed writer leaves no header, so nothing of it is indexed."""
        generation = seg.generation  # stable while the record is being written
        fd = self._open(seg, os.O_RDWR | os.O_CREAT, direct)
        mem = memoryview(scratch)
        hsize = record.first - record.base
        views: list[memoryview] = []
        try:
            head = mem[:PAGE]
            views.append(head)
            self._prepare_segment(seg, generation, fd, head)
            bufs = self._slots(record.keys, payloads, mem, hsize, views)
            write_all(fd, bufs, record.size - hsize, record.first)
            if self.fsync != "never":
                os.fdatasync(fd)
            header = mem[:hsize]
            views.append(header)
            header[:] = RecordHeader(tuple(record.keys), record.slot, generation).encode()
            write_all(fd, [header], hsize, record.base)
            if self.fsync != "never":
                os.fdatasync(fd)
        finally:
            for v in views:
                v.release()
            mem.release()
            os.close(fd)

    def _write_hole(self, seg: Segment, record: Record, direct: bool, scratch: mmap.mmap) -> None:
        """After a record failed: a header with no keys spanning it, so a restart's
        walk steps over it to the records after it (best effort: if this fails
        too, the walk stops there and those records are missed)."""
        generation = seg.generation
        page = memoryview(scratch)[:PAGE]
        try:
            with seg.prep:
                if seg.ready != generation:  # the head is not written yet: with it
                    seg.holes.append((record.base, record.size, generation))
                    return
                page[:] = RecordHeader((), record.size - PAGE, generation).encode()
                fd = self._open(seg, os.O_WRONLY, direct)
                try:
                    write_all(fd, [page], PAGE, record.base)
                finally:
                    os.close(fd)
        except OSError as exc:
            log.warning("could not mark a failed record in %s: %s", seg.path, exc)
        finally:
            page.release()

    def _slots(
        self,
        keys: list[bytes],
        payloads: list[memoryview],
        mem: memoryview,
        at: int,
        views: list[memoryview],
    ) -> list[memoryview]:
        """``payload, trailer, payload, trailer ...`` for one write of consecutive slots,
        the (page-padded) trailers built in ``mem`` from ``at`` (their views added
        to ``views``, to release)."""
        bufs: list[memoryview] = []
        tb = self.tail_bytes
        for key, payload in zip(keys, payloads, strict=True):
            trailer = Trailer.for_payload(key, payload).encode(PAGE)
            tail = mem[at : at + tb]
            views.append(tail)
            tail[: len(trailer)] = trailer
            if tb > len(trailer):
                tail[len(trailer) :] = bytes(tb - len(trailer))
            bufs += [payload, tail]
            at += tb
        return bufs
