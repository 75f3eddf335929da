"""The disk tier's load path: a job's keys grouped into runs of consecutive slots
of one record, each run read with one ``preadv`` straight into the host slots,
each object verified alone against its trailer.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable, Sequence

from offload_engine.disk._index import READY, Entry, Index, Record
from offload_engine.disk._io import O_DIRECT, Job, Pool, read_into, split, zero
from offload_engine.errors import KeyMissError, TrailerError
from offload_engine.keyed import Trailer

Done = Callable[[int, BaseException | None], None]
_Run = tuple[Record, int, list[tuple[bytes, memoryview]]]
"""What one read request loads: objects in consecutive slots of a record from ``slot``."""


class Reader:
    """Loads jobs' objects; see :meth:`DiskStore.start_load`."""

    def __init__(
        self,
        index: Index,
        pool: Pool,
        *,
        queue_depth: int,
        read_slots: int,
        tail_bytes: int,
        check_open: Callable[[], None],
    ) -> None:
        self.check_open = check_open  # called under the lock: a closed store queues nothing
        self.index = index
        self.pool = pool
        self.queue_depth = queue_depth
        self.read_slots = read_slots  # a run stops growing at this many slots
        self.tail_bytes = tail_bytes

    def _plan_locked(
        self, keys: Sequence[bytes], dests: Sequence[memoryview]
    ) -> tuple[list[_Run], list[bytes]]:
        """Pin the stored keys and group them into runs; the missing keys."""
        index = self.index
        runs: list[_Run] = []
        missing: list[bytes] = []
        last: Entry | None = None
        for key, dest in zip(keys, dests, strict=True):
            entry = index.entries.get(key)
            if entry is None or entry.state != READY:
                missing.append(key)
                last = None
                continue
            entry.readers += 1  # pinned: eviction skips it until the read ends
            entry.record.pins += 1
            index.policy.touched(key)
            if (
                last is not None
                and last.record is entry.record
                and last.slot + 1 == entry.slot
                and len(runs[-1][2]) < self.read_slots
            ):
                runs[-1][2].append((key, dest))
            else:
                runs.append((entry.record, entry.slot, [(key, dest)]))
            last = entry
        index.counts["misses"] += len(missing)
        if runs:
            index.loads_active += 1
        return runs, missing

    def start(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], direct: bool, done: Done
    ) -> None:
        """Queue the job's reads; zero the missing keys' destinations now."""
        with self.index.lock:
            self.check_open()
            runs, missing = self._plan_locked(keys, dests)
        gone = set(missing)
        for key, dest in zip(keys, dests, strict=True):
            if key in gone:
                zero(dest)
        batches = split(runs, self.queue_depth)
        job = Job(max(1, len(batches)), self._report(keys, done, active=bool(runs)))
        job.missing += missing
        if not runs:
            job.finish_batch(0)
            return
        for batch in batches:
            self.pool.put(functools.partial(self._read_batch, job, batch, direct))

    def _report(self, keys: Sequence[bytes], done: Done, *, active: bool) -> Callable[[Job], None]:
        index = self.index

        def report(job: Job) -> None:
            if active:  # this load counted as active: stores may go on once none is
                with index.lock:
                    index.loads_active -= 1
                    if not index.loads_active:
                        index.loads_idle.notify_all()
            if not job.missing:
                done(job.nbytes, None)
                return
            gone = set(job.missing)
            error = KeyMissError(
                f"{len(gone)} of {len(keys)} key(s) missed in the disk tier: "
                f"{[k.hex()[:16] for k in job.missing[:4]]}",
                missing=tuple(k for k in keys if k in gone),
                loaded=tuple(k for k in keys if k not in gone),
            )
            if job.errors:
                error.__cause__ = job.errors[0][1]
            done(job.nbytes, error)

        return report

    def _read_batch(self, job: Job, batch: list[_Run], direct: bool, scratch: mmap.mmap) -> None:
        nbytes = 0
        bad: list[tuple[bytes, BaseException]] = []
        try:
            for record, slot, items in batch:
                try:
                    failed = self._read_run(record, slot, items, direct, scratch)
                except (OSError, TrailerError) as exc:
                    failed = [(key, exc) for key, _ in items]
                wrong = {key for key, _ in failed}
                for key, dest in items:
                    if key in wrong:
                        zero(dest)
                    else:
                        nbytes += dest.nbytes
                bad += failed
        finally:
            with self.index.lock:
                self._unpin_locked(batch, bad)
            with job.lock:
                job.errors += bad
                job.missing += [k for k, _ in bad]
            job.finish_batch(nbytes)

    def _unpin_locked(self, batch: list[_Run], bad: list[tuple[bytes, BaseException]]) -> None:
        """Release the batch's pins and count it; drop the objects that failed
        verification (never served again)."""
        index = self.index
        for record, _slot, items in batch:
            for key, _dest in items:
                entry = index.entries.get(key)
                if entry is not None:
                    entry.readers -= 1
            record.pins -= len(items)
        index.counts["hits"] += sum(len(r[2]) for r in batch) - len(bad)
        index.counts["misses"] += len(bad)
        for key, err in bad:
            if isinstance(err, TrailerError):
                index.counts["corrupt"] += 1
            elif not isinstance(err, FileNotFoundError):
                continue  # an I/O error says nothing about the object: keep it
            entry = index.entries.get(key)
            if entry is not None and entry.state == READY and not entry.readers:
                index.forget_locked(key, entry)

    def _read_run(
        self,
        record: Record,
        slot: int,
        items: list[tuple[bytes, memoryview]],
        direct: bool,
        scratch: mmap.mmap,
    ) -> list[tuple[bytes, BaseException]]:
        """Read consecutive slots of ``record`` with one ``preadv``; verify each object
        alone. Returns the objects that failed verification."""
        tb = self.tail_bytes
        mem = memoryview(scratch)
        tails = [mem[i * tb : (i + 1) * tb] for i in range(len(items))]
        try:
            bufs: list[memoryview] = []
            for (_key, dest), tail in zip(items, tails, strict=True):
                bufs += [dest, tail]
            flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0)
            fd = os.open(record.path, flags)
            try:
                n = read_into(fd, bufs, record.first + slot * record.slot)
            finally:
                os.close(fd)
            bad: list[tuple[bytes, BaseException]] = []
            for i, ((key, dest), tail) in enumerate(zip(items, tails, strict=True)):
                try:
                    if n < (i + 1) * record.slot:
                        raise TrailerError(
                            "truncated", f"{record.path.name}: slot {slot + i} is cut short"
                        )
                    Trailer.decode(bytes(tail), key=key, length=dest.nbytes).verify(dest)
                except TrailerError as exc:
                    bad.append((key, exc))
            return bad
        finally:
            for t in tails:
                t.release()
            mem.release()
