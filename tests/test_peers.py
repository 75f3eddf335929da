"""Peer paths: a job's blocks split over the own link and borrowed ones."""

from __future__ import annotations

import math
import mmap
import multiprocessing
import multiprocessing.connection
import os
import signal
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing.synchronize import Event

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_engine import ConfigError, DeviceHandlerConfig
from offload_engine.device import peers
from offload_engine.device.peers import (
    LEDGER_BYTES,
    MAX_DEVICES,
    MAX_PROCESSES,
    OwnerTraffic,
    PeerLedger,
    default_ledger_path,
    split_units,
)
from offload_engine.errors import EngineClosedError, LedgerUnavailableError

# ------------------------------------------------------------------ split_units


def counts(ranges: tuple[tuple[int, int], ...]) -> list[int]:
    return [stop - start for start, stop in ranges]


def check_partition(ranges: tuple[tuple[int, int], ...], units: int, paths: int) -> None:
    """One range per path, contiguous from 0 to ``units``: no unit lost or moved twice."""
    assert len(ranges) == paths
    position = 0
    for start, stop in ranges:
        assert start == position and stop >= start
        position = stop
    assert position == units


def test_a_split_follows_the_rates() -> None:
    assert split_units(12, (1.0, 1.0, 1.0)) == ((0, 4), (4, 8), (8, 12))
    assert split_units(10, (55.0, 53.0, 52.0, 0.0)) == ((0, 3), (3, 7), (7, 10), (10, 10))
    assert split_units(8, (3, 1)) == ((0, 6), (6, 8))
    assert split_units(0, (1.0, 2.0)) == ((0, 0), (0, 0))
    assert split_units(5, (7.0,)) == ((0, 5),)


def test_the_same_inputs_give_the_same_split() -> None:
    rates = (54.1, 53.7, 0.0, 51.9)
    assert len({split_units(37, rates, min_units=2) for _ in range(20)}) == 1


def test_dead_paths_get_nothing() -> None:
    ranges = split_units(9, (1.0, 0.0, -3.0, math.nan, -math.inf, 2.0))
    assert counts(ranges) == [3, 0, 0, 0, 0, 6]
    check_partition(ranges, 9, 6)


def test_no_positive_rate_puts_everything_on_the_own_link() -> None:
    assert split_units(7, (0.0, 0.0)) == ((0, 7), (7, 7))
    assert split_units(7, (math.nan, -1.0, 0)) == ((0, 7), (7, 7), (7, 7))


def test_a_dead_own_link_gets_nothing_while_a_peer_lives() -> None:
    assert counts(split_units(6, (0.0, 1.0, 1.0))) == [0, 3, 3]


def test_peer_parts_below_min_units_fold_into_the_own_link() -> None:
    # shares 10 / 1 / 5 of 16: the one-block part folds, the five-block part stays
    assert counts(split_units(16, (10.0, 1.0, 5.0))) == [10, 1, 5]
    assert counts(split_units(16, (10.0, 1.0, 5.0), min_units=2)) == [11, 0, 5]
    assert counts(split_units(16, (10.0, 1.0, 5.0), min_units=6)) == [16, 0, 0]
    # the own link's part is never folded, however small
    assert counts(split_units(16, (1.0, 15.0), min_units=4)) == [1, 15]


def test_extreme_rates_stay_exact() -> None:
    assert counts(split_units(4, (1e308, 1e308))) == [2, 2]
    assert counts(split_units(4, (5e-324, 5e-324))) == [2, 2]
    assert counts(split_units(3, (1e300, 1e-300))) == [3, 0]


@pytest.mark.parametrize(
    ("units", "rates", "min_units", "error", "match"),
    [
        (-1, (1.0,), 1, ValueError, "units"),
        (1.5, (1.0,), 1, ValueError, "units"),
        (True, (1.0,), 1, ValueError, "units"),
        (4, (1.0,), 0, ValueError, "min_units"),
        (4, (), 1, ValueError, "at least the own link"),
        (4, (1.0, math.inf), 1, ValueError, r"rates\[1\] must be finite"),
        (4, (1.0, "2"), 1, TypeError, r"rates\[1\] must be a number"),
        (4, (1.0, None), 1, TypeError, r"rates\[1\]"),
        (4, (True,), 1, TypeError, r"rates\[0\]"),
        (4, "12", 1, TypeError, "sequence of numbers"),
        (4, 3.0, 1, TypeError, "sequence of numbers"),
    ],
)
def test_bad_arguments_raise_typed_errors(
    units: object, rates: object, min_units: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        split_units(units, rates, min_units=min_units)  # type: ignore[arg-type]


rate = st.one_of(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    st.sampled_from([0.0, -1.0, math.nan, -math.inf]),
)


@settings(max_examples=300, deadline=None)
@given(
    units=st.integers(0, 4096),
    rates=st.lists(rate, min_size=1, max_size=9).map(tuple),
    min_units=st.integers(1, 64),
)
def test_every_split_is_a_partition_in_proportion(
    units: int, rates: tuple[float, ...], min_units: int
) -> None:
    ranges = split_units(units, rates, min_units=min_units)
    check_partition(ranges, units, len(rates))
    got = counts(ranges)
    usable = [r if r > 0 else 0.0 for r in rates]
    total = sum(usable)
    for i, r in enumerate(rates):
        if not r > 0:
            assert got[i] == 0 or i == 0
        if i > 0:
            assert got[i] == 0 or got[i] >= min_units
    if total == 0:
        assert got[0] == units
        return
    unfolded = counts(split_units(units, rates))
    for i, r in enumerate(usable):
        assert abs(unfolded[i] - units * r / total) <= 1 + 1e-9
    # folding moves only parts below min_units, and only onto the own link
    moved = [i for i in range(1, len(rates)) if got[i] != unfolded[i]]
    assert all(0 < unfolded[i] < min_units and got[i] == 0 for i in moved)
    assert got[0] == unfolded[0] + sum(unfolded[i] for i in moved)


# ------------------------------------------------------------------ PeerLedger


@pytest.fixture
def path() -> Iterator[str]:
    """A ledger file of this test's own in /dev/shm, removed afterwards if a test left it."""
    where = f"/dev/shm/offload-engine-test-peers-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield where
    if os.path.exists(where):
        os.unlink(where)


class Clock:
    """Monotonic nanoseconds that a test moves on by hand, from the real clock's now."""

    def __init__(self) -> None:
        self.now = time.monotonic_ns()
        self.offset = 0

    def __call__(self) -> int:
        return self.now + self.offset

    def real(self) -> int:
        return time.monotonic_ns() + self.offset


def test_the_default_ledger_is_per_user_in_shared_memory() -> None:
    assert default_ledger_path() == f"/dev/shm/offload-engine-peers-{os.geteuid()}"


def test_an_owner_announces_and_a_borrower_sees_it(path: str) -> None:
    with PeerLedger(path) as owner, PeerLedger(path) as borrower:
        assert (owner.slot, borrower.slot) == (0, 1)
        assert not borrower.busy(2) and borrower.free_share(2) == 1.0
        owner.announce(2, 64 << 20)
        assert borrower.busy(2) and owner.busy(2)  # the owner's own process counts too
        assert borrower.free_share(2) == 0.0
        assert not borrower.busy(1) and not borrower.busy(3)
        [seen] = borrower.announcements(2)
        assert (seen.pid, seen.device, seen.inflight_bytes, seen.share) == (
            os.getpid(),
            2,
            64 << 20,
            1.0,
        )
        assert 0 <= seen.age < 5
        # a second announcement replaces the first; shares of several owners add up
        owner.announce(2, 1 << 20, share=0.25)
        assert borrower.free_share(2) == 0.75
        borrower.announce(2, 1 << 20, share=0.5)
        assert owner.free_share(2) == 0.25
        borrower.announce(2, 1 << 20, share=1.0)
        assert owner.free_share(2) == 0.0
        # idle
        owner.announce(2, 0)
        borrower.announce(2, 0, share=1.0)
        assert not owner.busy(2) and owner.free_share(2) == 1.0
        assert owner.announcements(2) == ()
        assert "busy []" in repr(owner)
        owner.announce(MAX_DEVICES - 1, 1)
        assert f"busy [{MAX_DEVICES - 1}]" in repr(borrower)


def test_an_announcement_lapses_after_ttl_unless_renewed(path: str) -> None:
    clock = Clock()
    with PeerLedger(path, ttl=1.0, clock=clock) as ledger:
        ledger.announce(0, 4096)
        clock.offset = 1_000_000_000
        assert ledger.busy(0)
        clock.offset += 1
        assert not ledger.busy(0) and ledger.free_share(0) == 1.0
        ledger.announce(0, 4096)  # renewed
        assert ledger.busy(0)


def test_closing_frees_the_slot_and_the_last_close_removes_the_file(path: str) -> None:
    first = PeerLedger(path)
    second = PeerLedger(path)
    assert os.path.getsize(path) == LEDGER_BYTES
    assert os.stat(path).st_mode & 0o777 == 0o600
    second.announce(5, 100)
    second.close()
    assert not first.busy(5)  # its announcements went with its slot
    assert os.path.exists(path)
    third = PeerLedger(path)
    assert third.slot == 1  # the freed slot is reused
    third.close()
    first.close()
    first.close()  # idempotent
    assert not os.path.exists(path)
    with PeerLedger(path) as again:  # a fresh file
        assert again.slot == 0
    assert not os.path.exists(path)


def test_every_call_after_close_raises(path: str) -> None:
    ledger = PeerLedger(path)
    ledger.close()
    assert ledger.closed and "closed" in repr(ledger)
    for call in (
        lambda: ledger.busy(0),
        lambda: ledger.free_share(0),
        lambda: ledger.announcements(0),
        lambda: ledger.announce(0, 1),
        ledger.reap,
    ):
        with pytest.raises(EngineClosedError, match="closed"):
            call()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ledger: ledger.busy(MAX_DEVICES), "device"),
        (lambda ledger: ledger.free_share(-1), "device"),
        (lambda ledger: ledger.busy(True), "device"),
        (lambda ledger: ledger.announce(0, -1), "inflight_bytes"),
        (lambda ledger: ledger.announce(0, 1.0), "inflight_bytes"),
        (lambda ledger: ledger.announce(0, 2**64), "inflight_bytes"),
        (lambda ledger: ledger.announce(0, 1, share=1.5), "share"),
        (lambda ledger: ledger.announce(0, 1, share=math.nan), "share"),
        (lambda ledger: ledger.announce(0, 1, share=True), "share"),
    ],
)
def test_bad_arguments_to_the_ledger_raise_value_errors(
    path: str, call: object, match: str
) -> None:
    with PeerLedger(path) as ledger:
        with pytest.raises(ValueError, match=match):
            call(ledger)  # type: ignore[operator]
        assert not any(ledger.busy(d) for d in range(MAX_DEVICES))
    with pytest.raises(ValueError, match="ttl"):
        PeerLedger(path, ttl=0)


def test_no_shared_memory_is_a_typed_error(tmp_path: os.PathLike[str]) -> None:
    missing = os.path.join(os.fspath(tmp_path), "no-shm", "ledger")
    with pytest.raises(LedgerUnavailableError, match="cannot open the peer ledger") as caught:
        PeerLedger(missing)
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def test_a_file_of_another_layout_is_refused_and_kept(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"not a ledger")
    with pytest.raises(LedgerUnavailableError, match="another ledger layout"):
        PeerLedger(path)
    with open(path, "r+b") as f:
        f.truncate(LEDGER_BYTES)
        f.write(b"OEPEERS\x00" + struct.pack("<I", 99))  # a later version
    with pytest.raises(LedgerUnavailableError, match="another ledger layout"):
        PeerLedger(path)
    assert os.path.getsize(path) == LEDGER_BYTES


def test_a_file_whose_creator_died_before_its_header_is_set_up(path: str) -> None:
    with open(path, "wb") as f:
        f.truncate(LEDGER_BYTES)
    os.chmod(path, 0o644)
    with PeerLedger(path) as ledger:
        assert os.stat(path).st_mode & 0o777 == 0o600  # no other user writes the slots
        ledger.announce(1, 1)
        assert ledger.busy(1)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_file_is_refused(path: str) -> None:
    PeerLedger(path).close()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, LEDGER_BYTES)
    os.close(fd)
    os.chown(path, 12345, 12345)
    with pytest.raises(LedgerUnavailableError, match="belongs to uid 12345"):
        PeerLedger(path)


def test_a_full_ledger_is_a_typed_error(path: str) -> None:
    opened = [PeerLedger(path) for _ in range(MAX_PROCESSES)]
    try:
        assert [ledger.slot for ledger in opened] == list(range(MAX_PROCESSES))
        with pytest.raises(LedgerUnavailableError, match=f"{MAX_PROCESSES} slots"):
            PeerLedger(path)
    finally:
        for ledger in opened:
            ledger.close()
    assert not os.path.exists(path)


def slot_at(slot: int) -> int:
    return peers._HEAD_BYTES + slot * peers._SLOT_BYTES


def entry_at(slot: int, device: int) -> int:
    return slot_at(slot) + peers._OWNER_BYTES + device * peers._ENTRY_BYTES


def test_an_entry_left_torn_is_skipped_not_waited_on(path: str) -> None:
    with PeerLedger(path) as ledger, open(path, "r+b") as f:
        ledger.announce(4, 1 << 20)
        mem = mmap.mmap(f.fileno(), LEDGER_BYTES)
        try:
            seq = struct.unpack_from("<Q", mem, entry_at(ledger.slot, 4))[0]
            struct.pack_into("<Q", mem, entry_at(ledger.slot, 4), seq + 1)  # died mid-write
            assert not ledger.busy(4) and ledger.free_share(4) == 1.0
        finally:
            mem.close()


def test_a_reused_pid_is_reaped(path: str) -> None:
    """A slot naming this process's pid with another start time belonged to a process
    that ended before the pid came back."""
    with PeerLedger(path) as ledger, open(path, "r+b") as f:
        mem = mmap.mmap(f.fileno(), LEDGER_BYTES)
        try:
            me = peers._Process.current()
            struct.pack_into("<QqQQ", mem, slot_at(3), 1, me.pid, me.start + 1, me.namespace)
            struct.pack_into("<I", mem, peers._IN_USE_AT, 4)
            struct.pack_into("<QQdq", mem, entry_at(3, 0), 2, 1, 1.0, time.monotonic_ns())
            assert ledger.busy(0)
            # another pid namespace's slot is left to lapse, never reaped
            struct.pack_into("<QqQQ", mem, slot_at(2), 1, me.pid, 1, me.namespace + 1)
            assert ledger.reap() == 1
            assert not ledger.busy(0)
            assert struct.unpack_from("<Q", mem, slot_at(2))[0] == 1
            struct.pack_into("<Q", mem, slot_at(2), 0)
        finally:
            mem.close()


def test_a_forked_child_may_read_but_not_announce(path: str) -> None:
    with PeerLedger(path) as ledger:
        ledger.announce(0, 1)
        peers._after_fork_in_child()  # what os.fork runs in the child
        try:
            assert ledger.busy(0)
            with pytest.raises(LedgerUnavailableError, match="parent process"):
                ledger.announce(0, 0)
        finally:
            ledger._forked = False


# two processes (spawned: a child shares nothing with its parent but the file)


WHOLE_READS = 1000


def burst_entry(i: int) -> tuple[int, float]:
    """The i-th of a burst of announcements: its bytes name its share, so a reader can
    tell a torn entry (one write's bytes with another's share) from a whole one."""
    return i + 1, (i % 64) / 64


def own_a_device(
    path: str, device: int, marked: Event, clear: Event, cleared: Event, enough: Event
) -> None:
    with PeerLedger(path) as ledger:
        ledger.announce(device, 256 << 20)
        marked.set()
        if not clear.wait(60):
            raise TimeoutError("the parent never asked to clear")
        for i in range(10**8):  # until the parent has read enough
            inflight, share = burst_entry(i)
            ledger.announce(device + 1, inflight, share=share)
            if i % 256 == 0 and enough.is_set():
                break
        ledger.announce(device + 1, 0)
        ledger.announce(device, 0)
        cleared.set()


def own_and_hang(path: str, device: int, marked: Event, never: Event) -> None:
    ledger = PeerLedger(path)
    ledger.announce(device, 256 << 20)
    marked.set()
    never.wait(60)  # killed before this returns


def test_another_process_sees_an_announcement_and_its_end(path: str) -> None:
    spawn = multiprocessing.get_context("spawn")
    marked, clear, cleared, enough = (spawn.Event() for _ in range(4))
    child = spawn.Process(target=own_a_device, args=(path, 2, marked, clear, cleared, enough))
    with PeerLedger(path) as borrower:
        child.start()
        try:
            assert marked.wait(60)
            assert borrower.busy(2) and borrower.free_share(2) == 0.0
            [seen] = borrower.announcements(2)
            assert seen.pid == child.pid and seen.age < 0.5
            assert not borrower.busy(1)
            clear.set()
            # while the child rewrites an entry as fast as it can, every read is whole
            whole = 0
            deadline = time.monotonic() + 60
            while whole < WHOLE_READS and time.monotonic() < deadline:
                for a in borrower.announcements(3):
                    assert burst_entry(a.inflight_bytes - 1) == (a.inflight_bytes, a.share)
                    whole += 1
            enough.set()
            assert whole == WHOLE_READS
            assert cleared.wait(60)
            assert not borrower.busy(2) and borrower.free_share(2) == 1.0
        finally:
            clear.set()
            enough.set()
            child.join(60)
        assert child.exitcode == 0
        assert struct.unpack_from("<I", borrower._map, peers._IN_USE_AT)[0] == 1
    assert not os.path.exists(path)


def test_a_killed_owner_does_not_hold_the_link(path: str) -> None:
    spawn = multiprocessing.get_context("spawn")
    marked, never = spawn.Event(), spawn.Event()
    child = spawn.Process(target=own_and_hang, args=(path, 3, marked, never))
    clock = Clock()
    with PeerLedger(path, ttl=30.0, clock=clock.real) as borrower:
        child.start()
        try:
            assert marked.wait(60)
            assert borrower.busy(3)
            os.kill(child.pid, signal.SIGKILL)
            assert multiprocessing.connection.wait([child.sentinel], 60)
            wait_for_zombie(child.pid)  # dead, not yet waited for by its parent
            # without a reap, the mark lapses after ttl
            clock.offset = 31_000_000_000
            assert not borrower.busy(3)
            clock.offset = 0
            assert borrower.busy(3)
            # a reap frees the dead process's slot at once
            assert borrower.reap() == 1
            assert not borrower.busy(3) and borrower.announcements(3) == ()
            assert borrower.reap() == 0
        finally:
            if child.is_alive():
                child.kill()
            child.join(60)
        assert child.exitcode == -signal.SIGKILL
    assert not os.path.exists(path)


def wait_for_zombie(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stat = peers._proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not end")


# ------------------------------------------------------------------ DeviceHandlerConfig


def test_peers_default_to_the_own_link_only() -> None:
    config = DeviceHandlerConfig()
    assert config.peers is None
    assert config.peer_staging_bytes == 64 << 20


@pytest.mark.parametrize(
    "kw",
    [
        {"peers": (1, 2, 3)},
        {"peers": (0,)},
        {"peers": (MAX_DEVICES - 1,)},
        {"peers": "auto"},
        {"peers": "auto", "peer_staging_bytes": 1},
        {"peers": ()},
        {"peers": (), "peer_staging_bytes": 0},
        {"peers": None, "peer_staging_bytes": 0},
    ],
)
def test_valid_peer_configs(kw: dict[str, object]) -> None:
    config = DeviceHandlerConfig(**kw)  # type: ignore[arg-type]
    assert {k: getattr(config, k) for k in kw} == kw
    hash(config)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"peers": (1, -1)}, r"peers\[1\] \(a device index\) must be an int in \[0, 15\], got -1"),
        ({"peers": (MAX_DEVICES,)}, r"peers\[0\]"),
        ({"peers": (1, 2, 1, 2, 3)}, r"peers must name each device once, .* \(\[1, 2\]\)"),
        ({"peers": (1.0,)}, r"peers\[0\]"),
        ({"peers": (True,)}, r"peers\[0\]"),
        ({"peers": ("1",)}, r"peers\[0\]"),
        ({"peers": [1, 2]}, "peers must be None, 'auto' or a tuple of device indices"),
        ({"peers": 1}, "peers must be None, 'auto' or a tuple"),
        ({"peers": "all"}, "peers must be None, 'auto' or a tuple"),
        ({"peers": {1, 2}}, "peers must be None"),
        ({"peers": (1,), "peer_staging_bytes": 0}, "peer_staging_bytes must be a positive int"),
        ({"peers": "auto", "peer_staging_bytes": -5}, "peer_staging_bytes"),
        ({"peer_staging_bytes": -1}, "peer_staging_bytes must be an int >= 0"),
        ({"peers": (1,), "peer_staging_bytes": 1.5}, "peer_staging_bytes"),
        ({"peer_staging_bytes": None}, "peer_staging_bytes"),
    ],
)
def test_bad_peer_configs_name_the_field(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DeviceHandlerConfig(**kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- owners' traffic


def test_owner_traffic_sums_its_handlers_per_device_and_renews_while_busy(
    tmp_path: object,
) -> None:
    """Two handlers' shares on one device add up; the sum is announced at each change,
    renewed past the ttl while it is not 0, idle once both are back to 0, and a
    share's close takes back what it still counted; the renewing thread ends then."""
    with PeerLedger(f"{tmp_path}/ledger", ttl=0.3) as ledger:
        traffic = OwnerTraffic.of(ledger)
        assert OwnerTraffic.of(ledger) is traffic
        store, load = traffic.share(2), traffic.share(2)
        store.started(100)
        load.started(50)
        assert [a.inflight_bytes for a in ledger.announcements(2)] == [150]
        time.sleep(0.7)  # past two ttls: only renewals keep it
        assert ledger.busy(2) and not ledger.busy(0)
        store.finished(100)
        load.finished(20)
        assert traffic.inflight(2) == 30
        load.close()  # the 30 bytes of a job abandoned at close
        assert traffic.inflight(2) == 0 and not ledger.busy(2)
        renewers = [t for t in threading.enumerate() if t.name == "offload-engine-ledger"]
        assert renewers == []
        load.finished(10)  # nothing left to take back: no negative count
        assert traffic.inflight(2) == 0
        with pytest.raises(ValueError, match="device"):
            traffic.share(MAX_DEVICES)


def test_owner_traffic_outlives_its_ledger_quietly(tmp_path: object) -> None:
    ledger = PeerLedger(f"{tmp_path}/ledger")
    share = OwnerTraffic.of(ledger).share(0)
    share.started(1)
    ledger.close()
    share.finished(1)  # a closed ledger is skipped: it only steers links
    share.close()


@pytest.mark.parametrize(
    ("visible", "device", "want"),
    [
        (None, 2, 2),
        ("3,1,0", 0, 3),
        ("3,1,0", 2, 0),
        ("3, 1", 1, 1),
        ("3,1", 2, None),
        ("GPU-8a1c0f5e-1111-2222-3333-444455556666", 0, None),
        ("MIG-5c2d,1", 0, None),
    ],
)
def test_the_host_index_of_a_visible_device(visible: str | None, device: int, want: int) -> None:
    from offload_engine.device.runtimes.cuda import visible_device_index

    assert visible_device_index(visible, device) == want
