"""The remote tier: host-tier blocks <-> a distributed store (Redis/Valkey, Mooncake Store).

:class:`RemoteTier` joins a :class:`~offload_engine.HostTier` to a
:class:`~offload_engine.RemoteStore` and gives the engine two handlers,
``CPU -> REMOTE`` (store) and ``REMOTE -> CPU`` (load). Jobs are keyed like the
disk tier's: ``TransferSpec(cpu_blocks(ids), remote_blocks(keys))`` stores host
block ``ids[i]`` under ``keys[i]``, and the reverse spec loads it back.

On the wire:

* **names**: ``oe:<layout digest>:<key hex>``. Tiers with another
  :class:`~offload_engine.LayoutDigest` (model, dtype, block/chunk size,
  parallel rank, page bytes, format) use other names and never see each
  other's objects.
* **objects**: the host block's bytes, then a :class:`~offload_engine.Trailer`
  (format version, the object's name, length, xxh3-64). The trailer of block
  ``b`` is built in row ``b`` of a small registered trailer area, so a backend
  that moves bytes from registered memory (Mooncake) sends both parts without
  a copy. Nothing is pickled.
* **loads** verify every trailer. An object that is absent, evicted, of
  another size, or fails verification is a **miss**: the job fails with
  :class:`~offload_engine.KeyMissError` naming the missed and the loaded keys,
  and the missed host blocks are zeroed (as the disk tier does). Missed objects are
  removed from the store, so a bad one does not keep answering lookups and the
  next store rewrites it.

A server that cannot be reached fails the job (``TransferError`` caused by
:class:`~offload_engine.StoreUnavailableError`) within the store's timeouts;
the engine keeps serving, and the next job reconnects. With
``degraded_start=True`` a tier whose server is down at construction starts
anyway, fails its jobs, answers lookups with 0, and connects as soon as the
server answers (at most one attempt per ``reconnect_interval`` seconds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch

from offload_engine._checks import check_int, check_seconds
from offload_engine.engine.handler import LaunchedJob
from offload_engine.engine.threadpool import ThreadPoolHandler
from offload_engine.errors import (
    ConfigError,
    InvalidTransferError,
    KeyMissError,
    StoreError,
    StoreUnavailableError,
    TrailerError,
)
from offload_engine.host import HostTier
from offload_engine.keyed import KeyedTransfer, LayoutDigest, Trailer, map_keyed
from offload_engine.remote.store import RemoteStore
from offload_engine.vocabulary import MAX_KEY_BYTES, Medium, TransferSpec

A = ParamSpec("A")
R = TypeVar("R")

NAME_PREFIX = "oe"
MAX_BATCH_KEYS = 64
"""Keys per store call: a job of more keys is sent as several pipelined batches."""


def wire_name(digest: LayoutDigest, key: bytes) -> str:
    """The name ``key`` is stored under, in ``digest``'s namespace."""
    return f"{NAME_PREFIX}:{digest.hexdigest}:{key.hex()}"


@dataclass(frozen=True)
class RemoteTierStats:
    """Counters of one :class:`RemoteTier` since it was built."""

    stored: int  # objects written
    loaded: int  # objects verified and delivered
    missed: int  # absent, evicted, another size, or lost with a server
    corrupt: int  # arrived whole but failed trailer verification (also counted in missed)
    unavailable: int  # calls that found the server unreachable (jobs and lookups)
    connected: bool


class RemoteTier:
    """A host tier's blocks stored in, and loaded from, a remote store.

    ``connect`` builds the store (e.g. ``lambda: RedisStore(config)``); it is
    called at construction, and again after a failed connection when
    ``degraded_start`` is set. The tier registers the host tier's memory and
    its trailer area with the store. :meth:`handlers` gives the two engine
    handlers; :meth:`contains` answers lookups. :meth:`close` closes the store
    (after the engine that ran the handlers has closed).
    """

    def __init__(
        self,
        connect: Callable[[], RemoteStore],
        tier: HostTier,
        digest: LayoutDigest,
        *,
        workers: int = 4,
        degraded_start: bool = False,
        reconnect_interval: float = 1.0,
        close_timeout: float = 30.0,
    ) -> None:
        if not isinstance(tier, HostTier) or not isinstance(digest, LayoutDigest):
            raise TypeError(
                f"RemoteTier takes a HostTier and a LayoutDigest, got {type(tier).__name__} "
                f"and {type(digest).__name__}"
            )
        block_bytes = tier.factor * tier.slot_bytes
        if digest.page_bytes != block_bytes:
            raise ConfigError(
                f"the layout digest says {digest.page_bytes} payload bytes per object, the host "
                f"tier's blocks hold {block_bytes}"
            )
        if (
            isinstance(reconnect_interval, bool)
            or not isinstance(reconnect_interval, (int, float))
            or reconnect_interval < 0
        ):
            raise ConfigError(
                f"reconnect_interval must be a non-negative number, got {reconnect_interval!r}"
            )
        # checked before connecting, so a bad argument leaves no store open
        self._workers = check_int(workers, "workers")
        self._close_timeout = check_seconds(close_timeout, "close_timeout")
        self.tier = tier
        self.digest = digest
        self.block_bytes = block_bytes
        self._prefix = wire_name(digest, b"")  # hashing the digest costs ~10 us: once
        self._connect = connect
        self._reconnect_interval = float(reconnect_interval)
        # the longest trailer this tier writes (a name's length follows its key's)
        self.trailer_bytes = Trailer.size(len(wire_name(digest, b"")) + 2 * MAX_KEY_BYTES)
        # row b holds the trailer of host block b (a block is in one job at a time)
        self._trailers = torch.zeros((tier.num_blocks, self.trailer_bytes), dtype=torch.uint8)
        self._lock = threading.Lock()  # guards _store, _next_try and the counters
        self._store: RemoteStore | None = None
        self._next_try = 0.0
        self._counts = dict.fromkeys(("stored", "loaded", "missed", "corrupt", "unavailable"), 0)
        self._closed = False
        try:
            self._store = self._open()
        except StoreUnavailableError:
            if not degraded_start:
                raise
            self._bump("unavailable")
            self._next_try = time.monotonic() + self._reconnect_interval

    def _open(self) -> RemoteStore:
        store = self._connect()
        if not isinstance(store, RemoteStore):
            raise ConfigError(f"connect must return a RemoteStore, got {type(store).__name__}")
        try:
            store.register(self.tier.memory)
            store.register(self._trailers)
        except BaseException:
            store.close()
            raise
        return store

    def _bump(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._counts[counter] += n

    def store(self) -> RemoteStore:
        """The connected store; connects first if the tier started degraded.

        Raises :class:`StoreUnavailableError` while the server cannot be reached.
        """
        with self._lock:
            store = self._store
            if store is not None:
                return store
            if self._closed:
                raise StoreUnavailableError("the remote tier is closed")
            now = time.monotonic()
            if now < self._next_try:
                raise StoreUnavailableError(
                    f"the remote store was unreachable; next attempt in {self._next_try - now:.2f}s"
                )
            self._next_try = now + self._reconnect_interval
        # connect outside the lock: it does network I/O
        opened = self._open()
        with self._lock:
            if self._store is None and not self._closed:
                self._store = opened
                return opened
            store = self._store
        opened.close()  # another thread connected first, or the tier closed
        if store is None:
            raise StoreUnavailableError("the remote tier is closed")
        return store

    @property
    def connected(self) -> bool:
        return self._store is not None

    def handlers(self) -> tuple[RemoteHandler, RemoteHandler]:
        """A new ``CPU -> REMOTE`` and ``REMOTE -> CPU`` handler pair, to register with
        one engine (a handler belongs to one engine and is used once; the tier, its
        store and its counters are shared by every pair)."""
        return (
            RemoteHandler(
                self, store=True, workers=self._workers, close_timeout=self._close_timeout
            ),
            RemoteHandler(
                self, store=False, workers=self._workers, close_timeout=self._close_timeout
            ),
        )

    def names(self, keys: Sequence[bytes]) -> list[str]:
        """The wire names of ``keys`` (see :func:`wire_name`)."""
        prefix = self._prefix
        return [prefix + k.hex() for k in keys]

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored (a later load may still miss).

        A server that cannot be reached answers 0 (counted as unavailable):
        a lookup must not fail the caller's step.
        """
        if not keys:
            return 0
        try:
            return self.store().longest_prefix(self.names(keys))
        except StoreUnavailableError:
            self._bump("unavailable")
            return 0

    def stats(self) -> RemoteTierStats:
        with self._lock:
            return RemoteTierStats(**self._counts, connected=self._store is not None)

    def payload(self, block: int) -> torch.Tensor:
        """Host block ``block``'s bytes, flat (a view of the tier's memory)."""
        f = self.tier.factor
        return self.tier.memory[block * f : (block + 1) * f].view(-1)

    # ------------------------------------------------------------------ work (worker threads)

    def put(self, t: KeyedTransfer) -> int:
        """Store a mapped job's blocks (worker thread); return the payload bytes."""
        store = self._call(self.store)
        all_names = self.names(t.keys)
        for lo in range(0, len(t.keys), MAX_BATCH_KEYS):
            names = all_names[lo : lo + MAX_BATCH_KEYS]
            objects = []
            for name, block in zip(names, t.blocks[lo : lo + MAX_BATCH_KEYS].tolist(), strict=True):
                payload = self.payload(block)
                trailer = Trailer.for_payload(name.encode(), memoryview(payload.numpy().data))
                raw = trailer.encode()
                row = self._trailers[block, : len(raw)]
                row.numpy()[:] = memoryview(raw)
                objects.append((payload, row))
            self._call(store.put, names, objects)
        self._bump("stored", len(t.keys))
        return t.nbytes

    def get(self, t: KeyedTransfer) -> int:
        """Load a mapped job's blocks and verify them (worker thread); return the
        payload bytes, or raise :class:`KeyMissError` naming the missed keys."""
        store = self._call(self.store)
        all_names = self.names(t.keys)
        missing: list[bytes] = []
        corrupt = 0
        for lo in range(0, len(t.keys), MAX_BATCH_KEYS):
            names = all_names[lo : lo + MAX_BATCH_KEYS]
            keys = t.keys[lo : lo + MAX_BATCH_KEYS]
            blocks = t.blocks[lo : lo + MAX_BATCH_KEYS].tolist()
            objects = [
                (self.payload(b), self._trailers[b, : Trailer.size(len(n))])
                for n, b in zip(names, blocks, strict=True)
            ]
            hits = self._call(store.get_into, names, objects)
            for key, name, (payload, row), hit in zip(keys, names, objects, hits, strict=True):
                if hit:
                    try:
                        Trailer.decode(
                            memoryview(row.numpy().data), key=name.encode(), length=self.block_bytes
                        ).verify(memoryview(payload.numpy().data))
                        continue
                    except TrailerError:
                        corrupt += 1
                missing.append(key)
                payload.zero_()  # as the disk tier does: a missed block holds no stray bytes
        loaded = len(t.keys) - len(missing)
        self._bump("loaded", loaded)
        if missing:
            self._drop(store, missing)
            self._bump("missed", len(missing))
            self._bump("corrupt", corrupt)
            lost = set(missing)
            raise KeyMissError(
                f"{len(missing)} of {len(t.keys)} keys missed in the remote store "
                f"({corrupt} failed verification)",
                missing=tuple(missing),
                loaded=tuple(k for k in t.keys if k not in lost),
            )
        return t.nbytes

    def _drop(self, store: RemoteStore, keys: list[bytes]) -> None:
        """Remove missed objects, so a bad one (corrupt, another size) cannot answer
        lookups as a hit forever, and the next store writes it afresh (Mooncake's
        put does not overwrite). Best effort: the job fails with its misses anyway,
        and an object that stays is verified again by the next load."""
        try:
            store.remove(self.names(keys))
        except StoreError:
            self._bump("unavailable")

    def _call(self, fn: Callable[A, R], *args: A.args, **kwargs: A.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except StoreUnavailableError:
            self._bump("unavailable")
            raise

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the store connection. Idempotent. Close the engine first."""
        with self._lock:
            store, self._store = self._store, None
            self._closed = True
        if store is not None:
            store.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else ("connected" if s.connected else "disconnected")
        return (
            f"<RemoteTier {state} digest={self.digest.hexdigest} blocks={self.tier.num_blocks} "
            f"stored={s.stored} loaded={s.loaded} missed={s.missed}>"
        )


class RemoteHandler(ThreadPoolHandler[KeyedTransfer]):
    """One direction of a :class:`RemoteTier`: ``CPU -> REMOTE`` or ``REMOTE -> CPU``."""

    def __init__(
        self, remote: RemoteTier, *, store: bool, workers: int = 4, close_timeout: float = 30.0
    ) -> None:
        direction = "store" if store else "load"
        super().__init__(
            workers=workers,
            thread_name=f"offload-engine-remote-{direction}",
            close_timeout=close_timeout,
        )
        self.remote = remote
        self.is_store = store
        self.src, self.dst = (Medium.CPU, Medium.REMOTE) if store else (Medium.REMOTE, Medium.CPU)
        self.ordered = False  # independent keys: deliver each job as soon as it ends
        self._who = self.name  # for prepare's errors, built once
        # launch only puts the job on the workers' queue (thread-safe, never blocks):
        # an idle route lets the submitting thread do that, and the loop sleeps on
        self.launch_in_submitter = True

    def prepare(self, spec: TransferSpec) -> KeyedTransfer:
        # only the checks run here, in the submitting thread; the wire names are
        # built by the worker
        t = map_keyed(spec, self.remote.tier, medium=Medium.REMOTE, who=self._who)
        if t.store is not self.is_store:
            raise InvalidTransferError(f"{self._who} got a job for the other direction")
        return t

    def execute(self, job: LaunchedJob[KeyedTransfer]) -> int:
        if self.is_store:
            return self.remote.put(job.prepared)
        return self.remote.get(job.prepared)
