"""Integrity: the bytes that arrive are the bytes that left, and the overlapping-blocks rules.

Every test runs on the host handler (KV cache in host memory) and on the device handler over
the fake runtime (streams are threads, copies are ``memmove``), through the same rig.

What the engine guarantees for overlapping blocks (docs/reliability.md):

1. Within one job, destinations are distinct: a job that names one destination twice (a
   store's tier slot, a load's cache block, counting KV groups that share a tensor as one) is
   refused at submit with ``InvalidBlockIdsError``. Sources may repeat.
2. A job writes only its own destination blocks (every other byte is left alone).
3. Once a job's successful result is collected, all its writes are done and visible; a job
   submitted after that sees them.
4. Between jobs in flight at the same time, the engine imposes no order. Handlers add one: the
   device handler applies the jobs of one direction in submission order, the host handler with
   one worker runs its jobs (both directions) in submission order. Otherwise a block written
   by two in-flight jobs, or read while another writes it, may hold bytes of either (torn),
   never bytes from anywhere else.
5. A job that failed, timed out or was abandoned at close leaves its destinations undefined; a
   timed-out or abandoned job may still be writing them until its handler finishes with it.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from offload_engine import (
    CacheBlocks,
    HostCopyHandler,
    HostTier,
    InvalidBlockIdsError,
    KVLayout,
    Medium,
    SyncOffloadingEngine,
    TransferHandler,
    TransferSpec,
    cpu_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.host.layout import byte_view
from offload_engine.testing import LAYOUT_KINDS, FakeRuntime, build_layout, cache_block_bytes

POISON = 0xA5
BOUND = 20.0


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def cuda_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


@dataclass
class Rig:
    """A layout, a tier and the handlers that move blocks between them."""

    kind: str
    layout: KVLayout
    tier: HostTier
    handlers: list[TransferHandler]  # type: ignore[type-arg]
    medium: Medium
    runtime: FakeRuntime | None = None
    notes: dict[str, object] = field(default_factory=dict)

    def cache(self, ids: list[int], **kw: object) -> CacheBlocks:
        return CacheBlocks(self.medium, ids, **kw)  # type: ignore[arg-type]

    def store(self, cache_ids: list[int], tier_ids: list[int], **kw: object) -> TransferSpec:
        return TransferSpec(self.cache(cache_ids, **kw), cpu_blocks(tier_ids))

    def load(self, tier_ids: list[int], cache_ids: list[int], **kw: object) -> TransferSpec:
        return TransferSpec(cpu_blocks(tier_ids), self.cache(cache_ids, **kw))

    def engine(self, **kw: object) -> SyncOffloadingEngine:
        return SyncOffloadingEngine(self.handlers, **kw)  # type: ignore[arg-type]

    def tier_bytes(self, block: int) -> bytes:
        return bytes(self.tier.block(block).numpy().tobytes())

    def close(self) -> None:
        self.tier.release()
        if self.runtime is not None:
            self.runtime.close()


def make_rig(
    handler: str,
    layout_kind: str = "flashinfer",
    *,
    num_blocks: int = 32,
    tier_blocks: int = 32,
    factor: int = 1,
    workers: int = 2,
    strategy: CopyStrategy = CopyStrategy.AUTO,
    seed: int = 0,
    **config: int,
) -> Rig:
    if handler == "host":
        layout = build_layout(layout_kind, host_empty, num_blocks=num_blocks, seed=seed)
        tier = HostTier.for_layout(layout, tier_blocks, factor=factor)
        tier.memory.fill_(POISON)
        return Rig(
            handler, layout, tier, [HostCopyHandler(layout, tier, workers=workers)], Medium.CPU
        )
    if handler == "cuda":  # the same rig on a real GPU
        from offload_engine.device.runtimes.cuda import CudaRuntime

        cuda = CudaRuntime()
        layout = build_layout(layout_kind, cuda_empty, num_blocks=num_blocks, seed=seed)
        tier = pinned_host_tier(cuda, layout, tier_blocks, factor=factor)
        tier.memory.fill_(POISON)
        cfg = DeviceHandlerConfig(strategy=strategy, staging_bytes=6 * layout.slot_bytes, **config)
        store, load = make_device_handlers(cuda, layout, tier, cfg)
        return Rig(handler, layout, tier, [store, load], Medium.GPU)
    runtime = FakeRuntime()
    layout = build_layout(layout_kind, runtime.empty, num_blocks=num_blocks, seed=seed)
    tier = pinned_host_tier(runtime, layout, tier_blocks, factor=factor)
    tier.memory.fill_(POISON)
    # two staging rows per buffer: multi-block jobs span several pieces
    cfg = DeviceHandlerConfig(
        strategy=strategy, staging_bytes=6 * layout.slot_bytes, streams=3, **config
    )
    store, load = make_device_handlers(runtime, layout, tier, cfg)
    return Rig(handler, layout, tier, [store, load], Medium.GPU, runtime)


HANDLERS = ["host", "device"]


@pytest.fixture(params=HANDLERS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = make_rig(request.param)
    yield r
    r.close()


# --------------------------------------------------------------------------- rule 1


def test_a_job_that_writes_one_destination_twice_is_refused_at_submit(rig: Rig) -> None:
    with rig.engine() as engine:
        with pytest.raises(InvalidBlockIdsError, match="tier block 3 twice"):
            engine.submit_nowait(rig.store([1, 2], [3, 3]))
        with pytest.raises(InvalidBlockIdsError, match="cache block 5 twice"):
            engine.submit_nowait(rig.load([3, 4], [5, 5]))
        assert sum(h.submitted for h in engine.stats().handlers) == 0
        assert rig.tier_bytes(3) == bytes([POISON]) * rig.tier.slot_bytes
        # the engine keeps serving
        [r] = engine.wait([engine.submit_nowait(rig.store([1, 2], [3, 4]))], timeout=BOUND)
        assert r.success, r.error
    assert rig.tier_bytes(3) == cache_block_bytes(rig.layout, 1)


def test_sources_may_repeat(rig: Rig) -> None:
    with rig.engine() as engine:
        [r] = engine.wait([engine.submit_nowait(rig.store([3, 3], [0, 1]))], timeout=BOUND)
        assert r.success, r.error
        [r] = engine.wait([engine.submit_nowait(rig.load([0, 0], [7, 8]))], timeout=BOUND)
        assert r.success, r.error
    block3 = cache_block_bytes(rig.layout, 3)
    assert rig.tier_bytes(0) == rig.tier_bytes(1) == block3
    assert cache_block_bytes(rig.layout, 7) == cache_block_bytes(rig.layout, 8) == block3


@pytest.mark.parametrize("handler", HANDLERS)
def test_distinct_slots_of_one_tier_block_are_distinct_destinations(handler: str) -> None:
    """With a block factor, two groups may fill two slots of one tier block: allowed. The
    same slot twice is not."""
    rig = make_rig(handler, "groups", factor=2)
    try:
        with rig.engine() as engine:
            ok = rig.store([1, 2], [0, 0], group_sizes=(1, 1), block_indices=(0, 1))
            [r] = engine.wait([engine.submit_nowait(ok)], timeout=BOUND)
            assert r.success, r.error
            clash = rig.store([1, 2], [0, 0], group_sizes=(1, 1), block_indices=(1, 1))
            with pytest.raises(InvalidBlockIdsError, match=r"tier block 0 \(slot 1\) twice"):
                engine.submit_nowait(clash)
    finally:
        rig.close()


@pytest.mark.parametrize("handler", HANDLERS)
def test_groups_that_share_a_tensor_share_their_blocks(handler: str) -> None:
    """A load may write cache block 5 of two groups with separate tensors, but not of two
    groups over one tensor (a hybrid model's shared KV pages)."""
    separate = make_rig(handler, "groups")
    try:
        assert len(set(separate.layout.group_aliases)) == 2
        with separate.engine() as engine:
            spec = separate.load([0, 1], [5, 5], group_sizes=(1, 1))
            [r] = engine.wait([engine.submit_nowait(spec)], timeout=BOUND)
            assert r.success, r.error
    finally:
        separate.close()
    shared = make_rig(handler, "flashinfer")
    try:
        one = shared.layout
        shared.layout = KVLayout.combine([one, one])
        assert shared.layout.group_aliases == (0, 0)
        handler_obj = (
            HostCopyHandler(shared.layout, shared.tier)
            if handler == "host"
            else make_device_handlers(shared.runtime, shared.layout, shared.tier)[1]  # type: ignore[arg-type]
        )
        with pytest.raises(InvalidBlockIdsError, match="cache block 5 twice"):
            handler_obj.prepare(shared.load([0, 1], [5, 5], group_sizes=(1, 1)))
        handler_obj.prepare(shared.load([0, 1], [5, 6], group_sizes=(1, 1)))
    finally:
        shared.close()


# --------------------------------------------------------------------------- round trips


def digest(layout: KVLayout, block: int, group: int) -> bytes:
    return hashlib.blake2b(cache_block_bytes(layout, block, group), digest_size=16).digest()


def scribble(layout: KVLayout, blocks: list[int], gen: torch.Generator) -> None:
    """New random bytes in ``blocks`` of every group (a model writing them)."""
    for regions in layout.groups:
        for r in regions:
            base = byte_view(layout.tensors[r.tensor])
            for b in blocks:
                start = r.offset + b * r.stride
                base[start : start + r.size].copy_(
                    torch.randint(0, 256, (r.size,), dtype=torch.uint8, generator=gen)
                )


@dataclass
class Tally:
    jobs: int = 0
    blocks_checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    taken: dict[str, int] = field(default_factory=dict)  # successful jobs per strategy


def round_trips(
    rig: Rig, *, threads: int = 4, rounds: int = 6, per_job: int = 3, depth: int = 2, seed: int = 0
) -> Tally:
    """Each thread owns disjoint cache and tier blocks. Per round it writes new data into
    some of its source blocks, stores them (``depth`` jobs in flight at once), waits, loads
    the tier blocks into its destination blocks, waits, and compares checksums per block
    and group. Unowned blocks (canaries) must not change at all."""
    layout, factor = rig.layout, rig.tier.factor
    groups = len(layout.groups)
    per_group_tier = -(-(per_job + factor - 1) // factor)  # room for any start offset
    tier_per_job = per_group_tier * groups
    sources_per_thread = depth * per_job  # reads may overlap between jobs
    cache_per_thread = sources_per_thread + depth * per_job * groups  # writes must not
    tier_per_thread = depth * tier_per_job
    need_cache = threads * cache_per_thread + 2
    need_tier = threads * tier_per_thread + 2
    assert layout.num_blocks >= need_cache and rig.tier.num_blocks >= need_tier, "rig too small"
    canary_cache = list(range(threads * cache_per_thread, layout.num_blocks))
    canary_tier = list(range(threads * tier_per_thread, rig.tier.num_blocks))
    before_cache = {(b, g): digest(layout, b, g) for b in canary_cache for g in range(groups)}
    before_tier = {b: rig.tier_bytes(b) for b in canary_tier}
    tally = Tally()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(t: int, engine: SyncOffloadingEngine) -> None:
        rng = random.Random(seed * 1000 + t)
        gen = torch.Generator().manual_seed(seed * 1000 + t)
        mine = list(range(t * cache_per_thread, (t + 1) * cache_per_thread))
        tier_mine = list(range(t * tier_per_thread, (t + 1) * tier_per_thread))
        for _ in range(rounds):
            rng.shuffle(mine)  # sources and destinations trade places between rounds
            rng.shuffle(tier_mine)
            jobs = []
            writable = mine[sources_per_thread:]
            for d in range(depth):
                # per group: its own cache ids; all groups share the job's run of tier blocks.
                # No two jobs in flight write one block (rule 4 leaves that unordered).
                srcs = [rng.sample(mine[:sources_per_thread], per_job) for _ in range(groups)]
                mine_d = writable[d * per_job * groups : (d + 1) * per_job * groups]
                dsts = [mine_d[g * per_job : (g + 1) * per_job] for g in range(groups)]
                tiers = tier_mine[d * tier_per_job : (d + 1) * tier_per_job]
                index = rng.randrange(factor)
                used = -(-(per_job + index % factor) // factor)
                tier_ids = [b for g in range(groups) for b in tiers[g * per_group_tier :][:used]]
                jobs.append((srcs, dsts, tier_ids, index))
            # a model writes this round's sources (no job of this thread is in flight)
            sources = sorted({b for srcs, *_ in jobs for ids in srcs for b in ids})
            scribble(layout, sources, gen)
            want = [
                [[digest(layout, b, g) for b in srcs[g]] for g in range(groups)]
                for srcs, *_ in jobs
            ]
            kw = [
                {"group_sizes": (per_job,) * groups, "block_indices": (index,) * groups}
                for *_, index in jobs
            ]
            stores = [
                engine.submit(rig.store([b for ids in srcs for b in ids], tier_ids, **k))
                for (srcs, _, tier_ids, _), k in zip(jobs, kw, strict=True)
            ]
            for r in engine.wait(stores, timeout=BOUND):
                assert r.success, r.error
            loads = [
                engine.submit(rig.load(tier_ids, [b for ids in dsts for b in ids], **k))
                for (_, dsts, tier_ids, _), k in zip(jobs, kw, strict=True)
            ]
            for r in engine.wait(loads, timeout=BOUND):
                assert r.success, r.error
            bad, checked = [], 0
            for (_, dsts, _, _), w in zip(jobs, want, strict=True):
                for g in range(groups):
                    for b, expect in zip(dsts[g], w[g], strict=True):
                        checked += 1
                        if digest(layout, b, g) != expect:
                            bad.append(f"thread {t}: cache block {b} group {g}")
            with lock:
                tally.jobs += 2 * depth
                tally.blocks_checked += checked
                tally.corrupt.extend(bad)

    def run(t: int, engine: SyncOffloadingEngine) -> None:
        try:
            worker(t, engine)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    with rig.engine(capacity=64) as engine:
        pool = [threading.Thread(target=run, args=(t, engine)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join(BOUND * rounds)
        assert not any(th.is_alive() for th in pool), "a submitting thread hung"
        for h in engine.stats().handlers:
            for name, count in h.by_strategy:
                tally.taken[name] = tally.taken.get(name, 0) + count
    if errors:
        raise errors[0]
    for (b, g), d in before_cache.items():
        if digest(layout, b, g) != d:
            tally.corrupt.append(f"canary cache block {b} group {g} changed")
    for b, data in before_tier.items():
        if rig.tier_bytes(b) != data:
            tally.corrupt.append(f"canary tier block {b} changed")
    return tally


CI_ROUND_TRIPS = [
    ("host", "flashinfer", 1, CopyStrategy.AUTO),
    ("host", "groups", 2, CopyStrategy.AUTO),
    ("host", "separate-kv", 4, CopyStrategy.AUTO),
    ("device", "flash-attention", 1, CopyStrategy.DMA),
    ("device", "groups", 2, CopyStrategy.STAGED),
    ("device", "mla", 4, CopyStrategy.KERNEL),
]


@pytest.mark.parametrize(("handler", "kind", "factor", "strategy"), CI_ROUND_TRIPS)
def test_concurrent_round_trips_arrive_intact(
    handler: str, kind: str, factor: int, strategy: CopyStrategy
) -> None:
    rig = make_rig(
        handler, kind, num_blocks=80, tier_blocks=48, factor=factor, workers=3, strategy=strategy
    )
    try:
        tally = round_trips(rig, seed=factor)
    finally:
        rig.close()
    assert tally.corrupt == []
    assert tally.jobs == 4 * 6 * 2 * 2 and tally.blocks_checked > 0


def switching_auto(handler: str) -> Tally:
    """Concurrent round trips whose jobs of 3 blocks (12 descriptors) stage on an
    idle handler and take dma behind two jobs' bytes in flight, so concurrent
    submitters mix both strategies on the same streams."""
    layout = build_layout("flash-attention", host_empty, num_blocks=8)
    rig = make_rig(
        handler,
        "flash-attention",
        num_blocks=80,
        tier_blocks=48,
        factor=2,
        dma_max_descriptors=8,
        dma_backlog_descriptors=64,
        dma_backlog_bytes=2 * 3 * layout.slot_bytes,
        dma_backlog_min_region_bytes=0,
    )
    try:
        tally = round_trips(rig, seed=5)
    finally:
        rig.close()
    assert tally.corrupt == []
    assert tally.jobs == 4 * 6 * 2 * 2 and tally.blocks_checked > 0
    assert sum(tally.taken.values()) == tally.jobs
    assert tally.taken["staged"] >= 1  # the first job, on an idle handler
    return tally


def test_concurrent_round_trips_arrive_intact_as_auto_switches_strategy() -> None:
    assert switching_auto("device").taken["dma"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_concurrent_round_trips_arrive_intact_on_the_gpu_as_auto_switches_strategy() -> None:
    switching_auto("cuda")  # how many take dma depends on how fast the GPU drains them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL])
@pytest.mark.parametrize(("kind", "factor"), [("flash-attention", 1), ("groups", 2), ("mla", 4)])
def test_concurrent_round_trips_arrive_intact_on_the_gpu(
    kind: str, factor: int, strategy: CopyStrategy
) -> None:
    rig = make_rig("cuda", kind, num_blocks=80, tier_blocks=48, factor=factor, strategy=strategy)
    try:
        tally = round_trips(rig, seed=factor)
    finally:
        rig.close()
    assert tally.corrupt == []
    assert tally.jobs == 4 * 6 * 2 * 2 and tally.blocks_checked > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [CopyStrategy.DMA, CopyStrategy.STAGED, CopyStrategy.KERNEL])
@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("handler", HANDLERS)
def test_concurrent_round_trips_arrive_intact_long(
    handler: str, kind: str, factor: int, strategy: CopyStrategy
) -> None:
    if handler == "host" and strategy is not CopyStrategy.DMA:
        pytest.skip("the host handler has one strategy")
    rig = make_rig(
        handler, kind, num_blocks=224, tier_blocks=160, factor=factor, workers=3, strategy=strategy
    )
    try:
        tally = round_trips(rig, threads=6, rounds=30, per_job=4, depth=3, seed=factor)
    finally:
        rig.close()
    assert tally.corrupt == []
    assert tally.blocks_checked > 0


# --------------------------------------------------------------------------- rules 2 to 5


def slot_of(layout: KVLayout, block: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(cache_block_bytes(layout, block)), dtype=torch.uint8)


def submit_from_threads(
    engine: SyncOffloadingEngine, specs: list[TransferSpec], threads: int = 3
) -> dict[int, TransferSpec]:
    """Submit ``specs`` from several threads at once; job id -> spec. Automatic ids grow
    in the order the engine accepted the jobs: that is the submission order."""
    got: dict[int, TransferSpec] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    def submit(part: list[TransferSpec]) -> None:
        barrier.wait(BOUND)
        for spec in part:
            jid = engine.submit(spec, wait_timeout=BOUND)
            with lock:
                got[jid] = spec

    pool = [threading.Thread(target=submit, args=(specs[i::threads],)) for i in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(BOUND)
    assert len(got) == len(specs)
    for r in engine.wait(sorted(got), timeout=BOUND):
        assert r.success, r.error
    return got


@pytest.mark.parametrize("handler", HANDLERS)
def test_in_flight_writes_to_one_block_land_in_submission_order_where_promised(
    handler: str,
) -> None:
    """Rule 4: the device handler orders the jobs of one direction, the host handler with
    one worker orders all its jobs, so the last job submitted wins a shared destination."""
    rig = make_rig(handler, "flash-attention", workers=1)
    try:
        with rig.engine() as engine:
            stores = submit_from_threads(engine, [rig.store([b], [0]) for b in range(1, 13)])
            last = stores[max(stores)]
            winner = int(last.src.block_ids[0])
            assert rig.tier_bytes(0) == cache_block_bytes(rig.layout, winner)
            assert rig.tier_bytes(1) == bytes([POISON]) * rig.tier.slot_bytes  # rule 2
            # give tier blocks 1..12 the contents of cache blocks 1..12, then load them all
            # into cache block 20 at once
            for r in engine.wait(
                [engine.submit(rig.store([b], [b])) for b in range(1, 13)], timeout=BOUND
            ):
                assert r.success
            loads = submit_from_threads(engine, [rig.load([b], [20]) for b in range(1, 13)])
            winner = int(loads[max(loads)].src.block_ids[0])
            assert cache_block_bytes(rig.layout, 20) == cache_block_bytes(rig.layout, winner)
            if handler == "host":  # one worker: a load submitted after a store sees it
                for _ in range(5):
                    s = engine.submit_nowait(rig.store([5], [30]))
                    ld = engine.submit_nowait(rig.load([30], [21]))
                    engine.wait([s, ld], timeout=BOUND)
                    assert cache_block_bytes(rig.layout, 21) == cache_block_bytes(rig.layout, 5)
                    for r in engine.wait([engine.submit(rig.store([6], [30]))], timeout=BOUND):
                        assert r.success
    finally:
        rig.close()


@pytest.mark.parametrize("handler", HANDLERS)
def test_unordered_overlapping_writes_hold_bytes_of_one_writer(handler: str) -> None:
    """Rule 4 where no order is promised: several workers storing into one tier block, and
    (device) a load reading a tier block that a store is writing. Each byte comes from one
    of the writers, never from anywhere else, and no other block changes."""
    rig = make_rig(handler, "flashinfer", workers=4)
    try:
        sources = list(range(1, 9))
        written = torch.stack([slot_of(rig.layout, b) for b in sources])
        with rig.engine() as engine:
            for _ in range(3):
                submit_from_threads(engine, [rig.store([b], [0]) for b in sources], threads=4)
                got = torch.frombuffer(bytearray(rig.tier_bytes(0)), dtype=torch.uint8)
                assert bool((written == got).any(dim=0).all())
            assert rig.tier_bytes(1) == bytes([POISON]) * rig.tier.slot_bytes
            # a load of tier block 2 racing a store into it: old bytes or new, per byte
            old = slot_of(rig.layout, 10)
            [r] = engine.wait([engine.submit(rig.store([10], [2]))], timeout=BOUND)
            assert r.success
            new = slot_of(rig.layout, 11)
            for _ in range(5):
                s = engine.submit_nowait(rig.store([11], [2]))
                ld = engine.submit_nowait(rig.load([2], [25]))
                for r in engine.wait([s, ld], timeout=BOUND):
                    assert r.success
                got = slot_of(rig.layout, 25)
                assert bool(((got == old) | (got == new)).all())
                [r] = engine.wait([engine.submit(rig.store([10], [2]))], timeout=BOUND)
                assert r.success
    finally:
        rig.close()


class GatedHostHandler(HostCopyHandler):
    """Host copies that wait for a gate before moving bytes (a slow transfer)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def execute(self, job):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.gate.wait(BOUND)
        return super().execute(job)


def test_a_timed_out_job_may_still_write_its_destination_after_its_result() -> None:
    """Rule 5: the engine gives a stuck job its timeout result at once, but cannot stop the
    copy already running; that copy lands later. Callers must not reuse the destination of
    a timed-out or abandoned job before the handler is done with it (close is a fence)."""
    layout = build_layout("flashinfer", host_empty, num_blocks=8)
    tier = HostTier.for_layout(layout, 4)
    tier.memory.fill_(POISON)
    handler = GatedHostHandler(layout, tier, workers=1)
    with SyncOffloadingEngine([handler]) as engine:
        slow = engine.submit_nowait(
            TransferSpec(CacheBlocks(Medium.CPU, [3]), cpu_blocks([1])),
            timeout=0.05,  # type: ignore[arg-type]
        )
        assert handler.entered.wait(BOUND)
        [r] = engine.wait([slow], timeout=BOUND)
        assert not r.success and "timed out" in str(r.error)
        assert bytes(tier.block(1).numpy().tobytes()) == bytes([POISON]) * tier.slot_bytes
        handler.gate.set()
        # one worker runs jobs in order, so once the next job is done, the late copy is too
        nxt = engine.submit_nowait(TransferSpec(CacheBlocks(Medium.CPU, [4]), cpu_blocks([2])))  # type: ignore[arg-type]
        [r2] = engine.wait([nxt], timeout=BOUND)
        assert r2.success
    assert bytes(tier.block(1).numpy().tobytes()) == cache_block_bytes(layout, 3)
