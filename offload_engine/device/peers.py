"""Borrowing peer devices' host links: how a job's blocks are split over paths,
and the per-host ledger that keeps a borrower off a link its owner is using.

A device's own PCIe link bounds its host transfers (about 55 GB/s on Gen5). Where
devices are joined by NVLink, a job's bytes can also go host -> peer over the peer's
own link, then peer -> device over NVLink (and the reverse for stores); on a 4-GPU
host three borrowed links moved 2.85 times one link. A job is then cut into one
contiguous part per path, each path taking a share of its blocks in proportion to
the rate measured on it (:func:`split_units`).

A borrowed link is only free while its owner is not moving its own bytes: while
every GPU of a host offloads at once, the host's memory bounds the sum, and a
borrower only slows the owner down. Owners may live in other processes (one serving
worker per GPU), so they announce their own traffic in a small file in shared memory
that every process of the user maps (:class:`PeerLedger`), and a borrower reads it
before it splits a job.

Nothing here touches a device: :mod:`offload_engine.device.multipath` splits a
handler's jobs with these.
"""

from __future__ import annotations

import fcntl
import itertools
import math
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from offload_engine._checks import check_int, check_seconds
from offload_engine.errors import EngineClosedError, LedgerUnavailableError


def split_units(
    units: int, rates: Sequence[float], *, min_units: int = 1
) -> tuple[tuple[int, int], ...]:
    """Cut ``units`` blocks into one contiguous ``(start, stop)`` range per path.

    ``rates`` holds each path's measured rate, the device's own link first; the
    result has one range per rate, in the same order, covering ``[0, units)``
    without gap or overlap (a path that gets nothing has ``start == stop``).

    Each path's part is its share of the rates, rounded so that the parts add up:
    the boundaries between parts are the cumulative shares rounded to the nearest
    unit, so every part lies within one unit of ``units * rate / sum(rates)``, the
    same inputs always give the same cut, and no unit is lost or moved twice. A
    rate that is zero, negative or NaN (a path that failed or was never measured)
    gets nothing; if no rate is positive, the own link takes every unit.

    A peer's part smaller than ``min_units`` folds into the own link: a borrowed
    path costs its own copies and events, which a part of a block or two does not
    repay. The own link's part is never folded (it is where the rest goes).

    Raises ``TypeError`` for a rate that is not a number, ``ValueError`` for an
    infinite rate, no rates at all, or ``units`` / ``min_units`` that are not
    ints of at least 0 / 1.
    """
    check_int(units, "units", minimum=0, error=ValueError)
    check_int(min_units, "min_units", error=ValueError)
    weights = _weights(rates)
    counts = _proportional(units, weights)
    for i in range(1, len(counts)):
        if 0 < counts[i] < min_units:
            counts[0] += counts[i]
            counts[i] = 0
    ranges = []
    start = 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return tuple(ranges)


def _weights(rates: Sequence[float]) -> list[float]:
    """The rates as weights in [0, 1] (divided by the largest, so their sum cannot
    overflow); a rate that is not positive, NaN included, weighs 0."""
    if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence):
        raise TypeError(f"rates must be a sequence of numbers, got {type(rates).__name__}")
    if not rates:
        raise ValueError("rates must name at least the own link, got none")
    weights = []
    for i, rate in enumerate(rates):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise TypeError(f"rates[{i}] must be a number, got {rate!r}")
        if rate == math.inf:
            raise ValueError(f"rates[{i}] must be finite, got {rate!r}")
        weights.append(float(rate) if rate > 0 else 0.0)
    top = max(weights)
    return [w / top for w in weights] if top > 0 else weights


def _proportional(units: int, weights: list[float]) -> list[int]:
    """Per-path counts: the boundaries are the cumulative weights' shares of
    ``units``, each rounded half up (monotone, so no count is negative); the last
    is ``units`` itself."""
    cumulative = list(itertools.accumulate(weights))
    total = cumulative[-1]
    if total == 0:
        return [units] + [0] * (len(weights) - 1)
    counts = []
    done = 0
    for acc in cumulative[:-1]:
        bound = min(units, math.floor(units * acc / total + 0.5))
        counts.append(bound - done)
        done = bound
    counts.append(units - done)
    return counts


# ------------------------------------------------------------------ the ledger

#: The ledger's bounds: one slot per open ledger (a process usually opens one),
#: each with an entry for devices ``0 .. MAX_DEVICES - 1``. The file is fixed at
#: ``LEDGER_BYTES`` (37 KiB).
MAX_PROCESSES = 64
MAX_DEVICES = 16
#: How long an announcement counts unless its owner renews it, in seconds.
DEFAULT_TTL = 1.0
#: Where the ledger lives unless a path is given: shared memory (tmpfs).
LEDGER_DIRECTORY = "/dev/shm"

_MAGIC = b"OEPEERS\x00"
_VERSION = 1
# the file: a header, then MAX_PROCESSES slots of an owner record and one entry per
# device; every field is little-endian and aligned to its size
_HEAD = struct.Struct("<8sIIIII")  # magic, version, processes, devices, slot bytes, in use
_HEAD_BYTES = 64
_IN_USE_AT = 24  # slots below this index may be claimed; readers scan no further
_OWNER = struct.Struct("<QqQQ")  # state, pid, start (clock ticks after boot), pid namespace
_OWNER_BYTES = 64
_ENTRY = struct.Struct("<QQdq")  # sequence, bytes in flight, link share, stamp (ns)
_ENTRY_BYTES = 32
_SLOT_BYTES = _OWNER_BYTES + MAX_DEVICES * _ENTRY_BYTES
LEDGER_BYTES = _HEAD_BYTES + MAX_PROCESSES * _SLOT_BYTES
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_FREE, _CLAIMED = 0, 1
_SEQ_MASK = (1 << 64) - 1
_READ_TRIES = 8  # an entry still torn after this many reads is skipped
_OPEN_TRIES = 16  # reopens while a last close removes the file under us


def default_ledger_path() -> str:
    """The ledger of this user on this host (one file per user: another user's
    processes cannot write into it)."""
    return os.path.join(LEDGER_DIRECTORY, f"offload-engine-peers-{os.geteuid()}")


@dataclass(frozen=True)
class Announcement:
    """One process's announced traffic on one device's own link, as a borrower sees
    it: ``inflight_bytes`` launched and unfinished, ``share`` of the link they use,
    made ``age`` seconds ago."""

    pid: int
    device: int
    inflight_bytes: int
    share: float
    age: float


@dataclass(frozen=True)
class _Process:
    """A process as the ledger names it: the pid, and what tells a reused pid apart
    (its start time after boot, 0 if unknown) and which pid namespace it belongs to
    (0 if unknown)."""

    pid: int
    start: int
    namespace: int

    @classmethod
    def current(cls) -> _Process:
        pid = os.getpid()
        stat = _proc_stat(pid)
        try:
            namespace = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            namespace = 0
        return cls(pid, stat[1] if stat else 0, namespace)

    def gone(self) -> bool:
        """Whether the process has ended (a zombie has: it moves nothing) or its pid
        now names another process. Without ``/proc``, only whether the pid exists."""
        if os.path.exists("/proc/self/stat"):
            stat = _proc_stat(self.pid)
            if stat is None:
                return True
            state, start = stat
            reused = self.start not in (0, start)  # known, and not the one /proc has now
            return state in ("Z", "X") or reused
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) from ``/proc/<pid>/stat``, or
    None where there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    fields = text[text.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


_OPEN: weakref.WeakSet[PeerLedger] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # a forked child shares its parent's mapping and slot: it may read, never write
    for ledger in list(_OPEN):
        ledger._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


class PeerLedger:
    """Which devices' own links their owners are using, shared by the processes of
    one user on one host.

    **Owners** announce their own traffic per device (:meth:`announce`: bytes in
    flight and the share of the link they use; 0 bytes is idle). **Borrowers** ask
    :meth:`busy` and :meth:`free_share` before they split a job over peers' links.
    An announcement replaces the ledger's previous one for that device, so the
    handlers of a process share one ledger and announce their bytes summed per
    device.

    The ledger is a file of ``LEDGER_BYTES`` in ``/dev/shm`` (one per user, mode
    0600), mapped by every process that opens it. Processes that do not share
    ``/dev/shm`` (containers without ``--ipc=host``) do not see each other.

    - **No slot is written by two processes.** Each open ledger claims one of
      ``MAX_PROCESSES`` slots, which only it writes; its threads take turns on a
      lock of their own. Claiming, freeing and reaping slots change the file
      under an ``flock`` on it, on these slow paths only.
    - **Reads are one pass over mapped memory.** :meth:`busy` and :meth:`free_share`
      make no system call beyond reading the monotonic clock. An entry carries a
      sequence number, odd while its owner writes it: a reader that sees it odd or
      changed reads again, and skips an entry still torn after a few reads (its
      writer died mid-write). The ledger only steers which link a job uses, never
      what bytes it moves, so a misread costs bandwidth, not correctness.
    - **A dead owner does not hold a link.** A reader counts an announcement for
      its own ``ttl`` seconds after it was made: an owner still moving bytes renews
      it (announces again) within the shortest ``ttl`` of its readers. Sooner,
      :meth:`reap` (run at open, and by any process at will) frees the slots of
      processes that have ended, including zombies, or whose pid now names another
      process (start time in ``/proc/<pid>/stat``). Only slots of the reaper's own
      pid namespace are reaped; others lapse by ``ttl``.
    - **The file goes with its last user.** :meth:`close` frees the slot, and the
      last one to close removes the file; an open racing with that removal opens
      the new file instead. A forked child shares its parent's slot: it may read,
      and must open a ledger of its own to announce.

    ``clock`` gives monotonic nanoseconds (``time.monotonic_ns``: one clock for the
    processes of a host); tests pass their own. Raises
    :class:`~offload_engine.errors.LedgerUnavailableError` where the ledger cannot
    be used; every call after :meth:`close` raises ``EngineClosedError``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.path = default_ledger_path() if path is None else os.fspath(path)
        self.ttl = check_seconds(ttl, "ttl", error=ValueError)
        self._ttl_ns = int(self.ttl * 1e9)
        self._clock = clock
        self._lock = threading.Lock()  # one writer at a time among this process's threads
        self._closed = True
        self._forked = False
        self._me = _Process.current()
        self.slot = -1
        self._seqs = [0] * MAX_DEVICES
        fd = self._open_locked()
        try:
            try:
                self._map = mmap.mmap(fd, LEDGER_BYTES)
            except OSError as exc:
                raise LedgerUnavailableError(f"cannot map {self.path}: {exc}") from exc
            try:
                self._reap_locked()
                self.slot = self._claim_locked()
            except BaseException:
                self._map.close()
                raise
        except BaseException:
            os.close(fd)  # drops the lock
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        self._fd = fd
        self._closed = False
        _OPEN.add(self)

    # ------------------------------------------------------------ owners

    def announce(self, device: int, inflight_bytes: int, *, share: float = 1.0) -> None:
        """This process moves ``inflight_bytes`` of its own over ``device``'s own
        link and uses ``share`` of it (0 bytes: idle). Replaces the process's last
        announcement for ``device`` and renews it for ``ttl`` seconds."""
        check_int(device, "device", minimum=0, maximum=MAX_DEVICES - 1, error=ValueError)
        check_int(
            inflight_bytes, "inflight_bytes", minimum=0, maximum=_SEQ_MASK >> 1, error=ValueError
        )
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"share must be a number in [0, 1], got {share!r}")
        at = _HEAD_BYTES + self.slot * _SLOT_BYTES + _OWNER_BYTES + device * _ENTRY_BYTES
        with self._lock:
            self._check_open()
            if self._forked:
                raise LedgerUnavailableError(
                    "this ledger was opened by the parent process: open one in the child"
                )
            writing = (self._seqs[device] + 1) & _SEQ_MASK
            _U64.pack_into(self._map, at, writing)
            _ENTRY.pack_into(self._map, at, writing, inflight_bytes, float(share), self._clock())
            done = (writing + 1) & _SEQ_MASK
            _U64.pack_into(self._map, at, done)
            self._seqs[device] = done

    # ------------------------------------------------------------ borrowers

    def busy(self, device: int) -> bool:
        """Whether some process (this one included) announced bytes of its own in
        flight on ``device``'s link within the last ``ttl`` seconds."""
        return any(True for _ in self._live(device))

    def free_share(self, device: int) -> float:
        """The share of ``device``'s link its owners leave free: 1 less the shares
        their live announcements use, at least 0."""
        used = 0.0
        for _, _, share, _ in self._live(device):
            used += share
        return 0.0 if used >= 1 else 1.0 - used

    def announcements(self, device: int) -> tuple[Announcement, ...]:
        """The announcements on ``device`` that count now, for logs and tests."""
        now = self._clock()
        found = []
        for slot, inflight, share, stamp in self._live(device):
            pid = _OWNER.unpack_from(self._map, _HEAD_BYTES + slot * _SLOT_BYTES)[1]
            found.append(Announcement(pid, device, inflight, share, (now - stamp) / 1e9))
        return tuple(found)

    def _live(self, device: int) -> Iterator[tuple[int, int, float, int]]:
        """(slot, bytes in flight, share, stamp) of each live announcement on
        ``device``: from a claimed slot, bytes in flight, made within ``ttl``."""
        check_int(device, "device", minimum=0, maximum=MAX_DEVICES - 1, error=ValueError)
        self._check_open()
        mem = self._map
        try:
            now = self._clock()
            in_use = min(_U32.unpack_from(mem, _IN_USE_AT)[0], MAX_PROCESSES)
            for slot in range(in_use):
                base = _HEAD_BYTES + slot * _SLOT_BYTES
                if _U64.unpack_from(mem, base)[0] != _CLAIMED:
                    continue
                entry = _read_entry(mem, base + _OWNER_BYTES + device * _ENTRY_BYTES)
                if entry is not None and entry[0] and now - entry[2] <= self._ttl_ns:
                    yield slot, *entry
        except ValueError:  # the mapping closed under this read
            self._check_open()
            raise

    # ------------------------------------------------------------ slow paths

    def reap(self) -> int:
        """Free the slots of processes that have ended (or whose pid was reused), in
        this pid namespace; returns how many. Takes the file's lock: not for the
        hot path."""
        self._check_open()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            return self._reap_locked()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _open_locked(self) -> int:
        """The ledger file's descriptor, under its lock, its header checked (or
        written, for a new file)."""
        for _ in range(_OPEN_TRIES):
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
                )
            except OSError as exc:
                raise LedgerUnavailableError(
                    f"cannot open the peer ledger {self.path}: {exc.strerror} (it lives in "
                    f"shared memory: is {os.path.dirname(self.path) or '.'} a writable tmpfs?)"
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if self._still_at_path(fd):
                    self._check_file(fd)
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the last user removed it while we waited: open the new one
        raise LedgerUnavailableError(f"{self.path} kept being removed while opening it")

    def _still_at_path(self, fd: int) -> bool:
        try:
            there = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        here = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)

    def _check_file(self, fd: int) -> None:
        """Refuse another user's file or another layout; set up a new (empty) file,
        or one whose creator died before writing the header."""
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise LedgerUnavailableError(
                f"{self.path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
            )
        head = _HEAD.pack(_MAGIC, _VERSION, MAX_PROCESSES, MAX_DEVICES, _SLOT_BYTES, 0)
        try:
            if st.st_mode & 0o077:
                os.fchmod(fd, 0o600)  # no other user may write the slots
            if st.st_size == 0:
                os.ftruncate(fd, LEDGER_BYTES)
                os.pwrite(fd, head, 0)
                return
            found = os.pread(fd, _HEAD.size, 0)
        except OSError as exc:
            raise LedgerUnavailableError(f"cannot set up {self.path}: {exc}") from exc
        if st.st_size == LEDGER_BYTES and found[:8] == bytes(8):
            os.pwrite(fd, head, 0)
            return
        if st.st_size != LEDGER_BYTES or found[:-4] != head[:-4]:
            raise LedgerUnavailableError(
                f"{self.path} holds another ledger layout ({st.st_size} bytes, header "
                f"{found[:20].hex()}): remove it once no process of another version uses it"
            )

    def _claim_locked(self) -> int:
        for slot in range(MAX_PROCESSES):
            base = _HEAD_BYTES + slot * _SLOT_BYTES
            if _U64.unpack_from(self._map, base)[0] == _FREE:
                self._map[base : base + _SLOT_BYTES] = bytes(_SLOT_BYTES)
                me = self._me
                _OWNER.pack_into(self._map, base, _CLAIMED, me.pid, me.start, me.namespace)
                self._count_in_use()
                return slot
        raise LedgerUnavailableError(
            f"every one of the {MAX_PROCESSES} slots of {self.path} is held by a live process"
        )

    def _free_locked(self, slot: int) -> None:
        base = _HEAD_BYTES + slot * _SLOT_BYTES
        self._map[base : base + _SLOT_BYTES] = bytes(_SLOT_BYTES)
        self._count_in_use()

    def _reap_locked(self) -> int:
        freed = 0
        for slot in range(MAX_PROCESSES):
            if slot == self.slot:
                continue
            state, pid, start, namespace = _OWNER.unpack_from(
                self._map, _HEAD_BYTES + slot * _SLOT_BYTES
            )
            mine = state == _CLAIMED and namespace == self._me.namespace
            if mine and _Process(pid, start, namespace).gone():
                self._free_locked(slot)
                freed += 1
        return freed

    def _count_in_use(self) -> int:
        """Write (and return) how far readers scan: one past the last claimed slot."""
        in_use = 0
        for slot in range(MAX_PROCESSES):
            if _U64.unpack_from(self._map, _HEAD_BYTES + slot * _SLOT_BYTES)[0] != _FREE:
                in_use = slot + 1
        _U32.pack_into(self._map, _IN_USE_AT, in_use)
        return in_use

    # ------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"the peer ledger {self.path} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free this process's slot (its announcements go with it) and unmap the
        file; the last process to close removes it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _OPEN.discard(self)
        try:
            if not self._forked:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                self._free_locked(self.slot)
                if self._count_in_use() == 0 and self._still_at_path(self._fd):
                    os.unlink(self.path)
        finally:
            self._map.close()
            os.close(self._fd)  # drops the lock

    def __enter__(self) -> PeerLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<PeerLedger {self.path} closed>"
        busy = [d for d in range(MAX_DEVICES) if self.busy(d)]
        return f"<PeerLedger {self.path} slot {self.slot} of {MAX_PROCESSES}, busy {busy}>"


def _read_entry(mem: mmap.mmap, at: int) -> tuple[int, float, int] | None:
    """(bytes in flight, share, stamp) of the entry at ``at`` as one consistent
    write left it, or None if it stays torn."""
    for _ in range(_READ_TRIES):
        seq, inflight, share, stamp = _ENTRY.unpack_from(mem, at)
        if not seq & 1 and _U64.unpack_from(mem, at)[0] == seq:
            return inflight, share, stamp
    return None


# ------------------------------------------------------------------ owners' traffic


class OwnerTraffic:
    """A process's own bytes in flight per device, summed over its handlers and
    announced in a :class:`PeerLedger`, so that borrowers in this and other processes
    keep off those links while they are busy.

    Each handler takes a :class:`TrafficShare` (:meth:`share`) for its device (as the
    host numbers it) and reports the bytes of each job it launches and each it hands
    back; the sum per device is announced whenever it changes. While any device has
    bytes in flight, a thread renews those announcements every third of the ledger's
    ``ttl`` (a long job would otherwise lapse), and ends once none has. One per
    ledger (:meth:`of`), shared by the handlers that were given it.
    """

    _BY_LEDGER: ClassVar[weakref.WeakKeyDictionary[PeerLedger, OwnerTraffic]] = (
        weakref.WeakKeyDictionary()
    )
    _BY_LEDGER_LOCK: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, ledger: PeerLedger) -> None:
        self.ledger = ledger
        self._lock = threading.Lock()
        self._bytes: dict[int, int] = {}
        self._renewer: threading.Thread | None = None
        self._wake = threading.Event()

    @classmethod
    def of(cls, ledger: PeerLedger) -> OwnerTraffic:
        """The one :class:`OwnerTraffic` of ``ledger`` in this process."""
        with cls._BY_LEDGER_LOCK:
            found = cls._BY_LEDGER.get(ledger)
            if found is None:
                found = cls._BY_LEDGER[ledger] = cls(ledger)
            return found

    def share(self, device: int) -> TrafficShare:
        """A handler's share of ``device``'s announced bytes."""
        check_int(device, "device", minimum=0, maximum=MAX_DEVICES - 1, error=ValueError)
        return TrafficShare(self, device)

    def inflight(self, device: int) -> int:
        """The bytes in flight on ``device`` this process announces now."""
        with self._lock:
            return self._bytes.get(device, 0)

    def _add(self, device: int, nbytes: int) -> None:
        with self._lock:
            total = max(0, self._bytes.get(device, 0) + nbytes)
            self._bytes[device] = total
            self._announce(device, total)
            if total and self._renewer is None:
                self._wake.clear()
                self._renewer = threading.Thread(
                    target=self._renew, name="offload-engine-ledger", daemon=True
                )
                self._renewer.start()
            elif not any(self._bytes.values()):
                self._wake.set()  # nothing in flight: the renewer ends now

    def settle(self, timeout: float = 5.0) -> None:
        """With nothing in flight, wait for the renewing thread to end (a handler's
        close calls it, so no thread of the engine outlives its handlers)."""
        with self._lock:
            renewer = None if any(self._bytes.values()) else self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            self._wake.set()
            renewer.join(timeout)

    def _announce(self, device: int, total: int) -> None:
        """Announce ``total`` for ``device`` (the lock held); a closed or forked-off
        ledger is skipped: it only steers which link a job takes."""
        try:
            self.ledger.announce(device, total)
        except (EngineClosedError, LedgerUnavailableError):
            pass

    def _renew(self) -> None:
        period = self.ledger.ttl / 3
        while True:
            self._wake.wait(period)
            with self._lock:
                busy = {d: b for d, b in self._bytes.items() if b}
                if not busy or self.ledger.closed:
                    self._renewer = None
                    return
                self._wake.clear()
                for device, total in busy.items():
                    self._announce(device, total)


class TrafficShare:
    """One handler's bytes in :class:`OwnerTraffic` for one device: :meth:`started`
    at a job's launch, :meth:`finished` when it is handed back, :meth:`close` takes
    back whatever is still counted (jobs abandoned at the handler's close)."""

    def __init__(self, traffic: OwnerTraffic, device: int) -> None:
        self.traffic = traffic
        self.device = device
        self._lock = threading.Lock()
        self._mine = 0

    def started(self, nbytes: int) -> None:
        with self._lock:
            self._mine += nbytes
        self.traffic._add(self.device, nbytes)

    def finished(self, nbytes: int) -> None:
        with self._lock:
            nbytes = min(nbytes, self._mine)
            self._mine -= nbytes
        if nbytes:
            self.traffic._add(self.device, -nbytes)

    def close(self) -> None:
        with self._lock:
            left, self._mine = self._mine, 0
        if left:
            self.traffic._add(self.device, -left)
        self.traffic.settle()
