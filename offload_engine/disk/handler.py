"""Disk handlers: ``CPU -> DISK`` stores and ``DISK -> CPU`` loads of whole host-tier blocks.

A job pairs host-tier blocks with keys (``TransferSpec(cpu_blocks(ids),
disk_blocks(keys))`` stores, the reverse loads). ``prepare`` maps it at submit
(:func:`~offload_engine.keyed.map_keyed`, typed errors); ``launch`` hands it to
the :class:`~offload_engine.disk.store.DiskStore`'s read or write pool and
returns. The pool thread that finishes the job's last object reports it.

A store succeeds when every key is stored (or already was). A load succeeds
when every key was read and verified; otherwise it fails with
:class:`~offload_engine.KeyMissError`, which names the keys that missed and
those that were loaded, and the missed keys' host blocks are zeroed.
"""

from __future__ import annotations

import logging
import mmap

import torch

from offload_engine._checks import check_int
from offload_engine.disk.store import PAGE, DiskStore
from offload_engine.engine.handler import LaunchedJob, TransferHandler
from offload_engine.errors import (
    EngineClosedError,
    InvalidTransferError,
    LayoutError,
)
from offload_engine.host import HostTier
from offload_engine.keyed import KeyedTransfer, map_keyed
from offload_engine.vocabulary import Medium, TransferSpec

log = logging.getLogger("offload_engine.disk")


def page_aligned_tier(num_blocks: int, block_bytes: int) -> HostTier:
    """A host tier of ``num_blocks`` blocks in page-aligned memory (anonymous
    ``mmap``), so the disk tier can use O_DIRECT on it."""
    check_int(num_blocks, "num_blocks")
    check_int(block_bytes, "block_bytes")
    buf = mmap.mmap(-1, num_blocks * block_bytes)
    memory = torch.frombuffer(buf, dtype=torch.uint8).view(num_blocks, block_bytes)
    return HostTier(num_blocks, block_bytes, memory=memory)


class DiskHandler(TransferHandler[KeyedTransfer]):
    """One direction between ``tier`` (host memory) and ``store`` (files).

    Build both with :func:`disk_handlers`. ``max_inflight`` caps the jobs the
    engine hands this handler at once; the store's ``queue_depth`` caps the
    requests on the drive. ``None`` (default): ``max(16, 2 * store.queue_depth)``,
    so jobs of one object still keep every I/O thread busy with the next job
    queued behind it.
    """

    ordered = False
    # launch only plans the job under the store's lock and puts its batches on an
    # I/O pool's queue (thread-safe, never waits on I/O): an idle route lets the
    # submitting thread do that, and the loop sleeps on, saving a loop wake-up
    launch_in_submitter = True

    def __init__(
        self,
        store: DiskStore,
        tier: HostTier,
        *,
        store_side: bool,
        max_inflight: int | None = None,
    ) -> None:
        if not isinstance(store, DiskStore) or not isinstance(tier, HostTier):
            raise TypeError(
                f"DiskHandler takes a DiskStore and a HostTier, got {type(store).__name__} and "
                f"{type(tier).__name__}"
            )
        if max_inflight is None:
            max_inflight = default_max_inflight(store.queue_depth)
        check_int(max_inflight, "max_inflight")
        block_bytes = tier.factor * tier.slot_bytes
        if block_bytes != store.payload_bytes:
            raise LayoutError(
                f"host-tier blocks hold {block_bytes} bytes, the disk tier's objects "
                f"{store.payload_bytes} (its layout digest's page_bytes)"
            )
        self.src, self.dst = (Medium.CPU, Medium.DISK) if store_side else (Medium.DISK, Medium.CPU)
        self.store_side = store_side
        self.max_inflight = max_inflight
        self.store = store
        self.tier = tier
        # block b's bytes start at b * block_stride of the tier's span (a tier made by
        # HostTier.over may leave gaps between blocks)
        flat = tier.span.numpy()
        self._memory = memoryview(flat)  # type: ignore[arg-type]
        self._stride = tier.block_stride
        aligned = flat.ctypes.data % PAGE == 0 and self._stride % PAGE == 0
        self.direct = store.direct and aligned
        if store.direct and not aligned:
            log.warning(
                "the host tier's memory is not page-aligned; %s uses buffered I/O "
                "(page_aligned_tier() allocates aligned memory)",
                store.path,
            )

    def prepare(self, spec: TransferSpec) -> KeyedTransfer:
        if self.store.closed:
            raise EngineClosedError(f"{self.name}: the disk store is closed")
        plan = map_keyed(spec, self.tier, medium=Medium.DISK, who=self.name)
        if plan.store != self.store_side:
            raise InvalidTransferError(f"{self.name} got a {'store' if plan.store else 'load'}")
        return plan

    def launch(self, job: LaunchedJob[KeyedTransfer]) -> None:
        plan = job.prepared
        bb, stride = plan.block_bytes, self._stride
        mem = self._memory
        views = [mem[b * stride : b * stride + bb] for b in plan.blocks.tolist()]

        def done(nbytes: int, error: BaseException | None) -> None:
            if error is None:
                job.succeed(nbytes)
            else:
                job.fail(error)

        try:
            if plan.store:
                self.store.start_store(plan.keys, views, direct=self.direct, done=done)
            else:
                self.store.start_load(plan.keys, views, direct=self.direct, done=done)
        except EngineClosedError as exc:
            job.fail(exc)


def default_max_inflight(queue_depth: int) -> int:
    """Jobs a disk handler takes at once by default: 16, or two per I/O thread
    when the store has more than 8."""
    return max(16, 2 * queue_depth)


def disk_handlers(
    store: DiskStore, tier: HostTier, *, max_inflight: int | None = None
) -> tuple[DiskHandler, DiskHandler]:
    """The ``CPU -> DISK`` and ``DISK -> CPU`` handlers between ``tier`` and ``store``
    (``max_inflight``: see :class:`DiskHandler`)."""
    return (
        DiskHandler(store, tier, store_side=True, max_inflight=max_inflight),
        DiskHandler(store, tier, store_side=False, max_inflight=max_inflight),
    )
