"""Jobs that move some of a block's tensors (layers), and fences that signal them.

The host handler and the device handler on the fake runtime: the bytes of the
chosen tensors land, every other byte stays as it was, and a fence's stream wait
orders the model's (fake) compute stream after exactly its job's copies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from offload_engine import (
    HostCopyHandler,
    HostTier,
    InvalidTransferError,
    JobFence,
    JobTimeoutError,
    KVLayout,
    SyncOffloadingEngine,
    TransferError,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
    gpu_blocks,
    host_cache_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.staged import COPY2D_ROWS
from offload_engine.host.layout import byte_view
from offload_engine.testing import FakeRuntime, build_layout

LAYERS = 4


def tensor_bytes(layout: KVLayout, tensor: int, block: int) -> bytes:
    """The bytes of cache block ``block`` that lie in ``layout.tensors[tensor]``."""
    out = b""
    for g in layout.groups:
        for r in g:
            if r.tensor == tensor:
                base = byte_view(layout.tensors[r.tensor])
                start = r.offset + block * r.stride
                out += base[start : start + r.size].numpy().tobytes()
    return out


def poison_blocks(layout: KVLayout, blocks: list[int]) -> None:
    for g in layout.groups:
        for r in g:
            base = byte_view(layout.tensors[r.tensor])
            for b in blocks:
                base[r.offset + b * r.stride : r.offset + b * r.stride + r.size].fill_(0xA5)


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


# ------------------------------------------------------------------ the spec


def test_tensors_are_checked_at_the_boundary() -> None:
    cache, tier = host_cache_blocks([0, 1]), cpu_blocks([0, 1])
    assert TransferSpec(cache, tier, tensors=[3, 1]).tensors == (1, 3)
    for bad in ([], [-1], [1, 1], ["a"], "01", 7):
        with pytest.raises(InvalidTransferError, match="tensors"):
            TransferSpec(cache, tier, tensors=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match="store or a load"):
        TransferSpec(cpu_blocks([0]), disk_blocks([b"k"]), tensors=[0])
    with pytest.raises(InvalidTransferError, match="JobFence"):
        TransferSpec(cache, tier, fence=object())  # type: ignore[arg-type]


def host_setup(kind: str = "flash-attention") -> tuple[KVLayout, HostTier]:
    layout = build_layout(
        kind,
        lambda shape, dtype: torch.empty(shape, dtype=dtype),
        num_blocks=8,
        num_layers=LAYERS,
        seed=3,
    )
    return layout, HostTier(8, layout.slot_bytes)


def test_a_tensor_past_the_layout_and_a_reused_fence_are_refused() -> None:
    layout, tier = host_setup()
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)]) as engine:
        with pytest.raises(InvalidTransferError, match="names tensor 9"):
            engine.submit(TransferSpec(host_cache_blocks([0]), cpu_blocks([0]), tensors=[9]))
        fence = JobFence()
        engine.wait(
            [engine.submit(TransferSpec(host_cache_blocks([0]), cpu_blocks([0]), fence=fence))]
        )
        fence.wait(5)
        with pytest.raises(InvalidTransferError, match="one fence per job"):
            engine.submit(TransferSpec(host_cache_blocks([1]), cpu_blocks([1]), fence=fence))
        # the refused submit left the engine serving
        [r] = engine.wait([engine.submit(TransferSpec(host_cache_blocks([2]), cpu_blocks([2])))])
        assert r.success


@pytest.mark.parametrize("kind", ["flash-attention", "separate-kv", "groups"])
def test_host_loads_layer_by_layer_move_only_their_tensors(kind: str) -> None:
    layout, tier = host_setup(kind)
    groups = len(layout.groups)
    src, dst = [0, 1], [4, 5]
    sizes = (2,) * groups
    with SyncOffloadingEngine([HostCopyHandler(layout, tier)]) as engine:
        stored = engine.submit(
            TransferSpec(
                host_cache_blocks(src * groups, group_sizes=sizes),
                cpu_blocks([0, 1] * groups if groups == 1 else [0, 1, 2, 3]),
            )
        )
        assert engine.wait([stored])[0].success
        want = {
            (t, b): tensor_bytes(layout, t, s)
            for t in range(len(layout.tensors))
            for s, b in zip(src, dst, strict=False)
        }
        poison_blocks(layout, dst)
        before = {
            (t, b): tensor_bytes(layout, t, b) for t in range(len(layout.tensors)) for b in dst
        }
        tier_ids = [0, 1] if groups == 1 else [0, 1, 2, 3]
        for t in range(len(layout.tensors)):
            fence = JobFence()
            job = engine.submit(
                TransferSpec(
                    cpu_blocks(tier_ids),
                    host_cache_blocks(dst * groups, group_sizes=sizes),
                    tensors=[t],
                    fence=fence,
                )
            )
            fence.wait_on_stream(5)  # no device: a host wait for the job
            assert fence.done
            for u in range(len(layout.tensors)):
                for b in dst:
                    got = tensor_bytes(layout, u, b)
                    assert got == (want[(u, b)] if u <= t else before[(u, b)]), (t, u, b)
            [r] = engine.wait([job])
            assert r.success
            assert r.bytes_moved == sum(len(tensor_bytes(layout, t, b)) for b in dst)


# ------------------------------------------------------------------ the device


def device_setup(
    fake: FakeRuntime, strategy: CopyStrategy = CopyStrategy.AUTO, inline_launch_blocks: int = 64
):
    layout = build_layout("flash-attention", fake.empty, num_blocks=8, num_layers=LAYERS, seed=5)
    tier = pinned_host_tier(fake, layout, 8)
    store, load = make_device_handlers(
        fake,
        layout,
        tier,
        DeviceHandlerConfig(
            strategy=strategy,
            staging_bytes=4 * layout.slot_bytes,
            inline_launch_blocks=inline_launch_blocks,
        ),
    )
    return layout, tier, store, load


@pytest.mark.parametrize("inline_blocks", [1, 0])
def test_a_fenced_job_launches_on_the_submitting_thread_whatever_its_size(
    fake: FakeRuntime, inline_blocks: int
) -> None:
    """A job with a fence (a stream waits on it soon) is put on the streams by the
    thread that submits it, past ``inline_launch_blocks``; the same job without a
    fence goes to the launcher thread, and so does every job where
    ``inline_launch_blocks`` is 0."""
    layout, tier, store, load = device_setup(fake, inline_launch_blocks=inline_blocks)
    launched_on: list[int] = []
    enqueue = load._enqueue

    def recording(plan: Any) -> None:
        launched_on.append(threading.get_ident())
        enqueue(plan)

    load._enqueue = recording  # type: ignore[method-assign]
    here = threading.get_ident()
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            engine.wait([engine.submit(TransferSpec(gpu_blocks([0, 1, 2]), cpu_blocks([0, 1, 2])))])
            fence = JobFence()
            spec = TransferSpec(cpu_blocks([0, 1, 2]), gpu_blocks([5, 6, 7]), tensors=[1])
            fenced = TransferSpec(spec.src, spec.dst, tensors=[1], fence=fence)
            [r] = engine.wait([engine.submit(fenced)])
            assert r.success and fence.done
            [r] = engine.wait([engine.submit(spec)])
            assert r.success
            assert len(launched_on) == 2
            assert (launched_on[0] == here) is (inline_blocks > 0)
            assert launched_on[1] != here
            assert tensor_bytes(layout, 1, 5) == tensor_bytes(layout, 1, 0)
    finally:
        tier.release()


@pytest.mark.parametrize("strategy", [CopyStrategy.AUTO, CopyStrategy.STAGED, CopyStrategy.DMA])
def test_device_layer_waits_order_the_compute_stream(
    fake: FakeRuntime, strategy: CopyStrategy
) -> None:
    """A layer's stream wait holds the compute stream until that layer's bytes are in
    place (read by compute work at that moment) and no longer: layer 0 is read while
    layer 1's copy hangs. The hung layer is reported failed, not hidden."""
    layout, tier, store, load = device_setup(fake, strategy)
    src, dst, slots = [0, 1, 2], [5, 6, 7], [0, 1, 2]
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            [r] = engine.wait([engine.submit(TransferSpec(gpu_blocks(src), cpu_blocks(slots)))])
            assert r.success
            want = {
                (t, b): tensor_bytes(layout, t, s)
                for t in range(LAYERS)
                for s, b in zip(src, dst, strict=False)
            }
            poison_blocks(layout, dst)
            poisoned = {(t, b): tensor_bytes(layout, t, b) for t in range(LAYERS) for b in dst}
            seen: dict[int, dict[tuple[int, int], bytes]] = {}
            looked = {t: threading.Event() for t in range(LAYERS)}

            def layer(t: int) -> tuple[int, JobFence]:
                fence = JobFence()
                spec = TransferSpec(cpu_blocks(slots), gpu_blocks(dst), tensors=[t], fence=fence)
                return engine.submit(spec), fence

            def look(t: int) -> None:
                seen[t] = {(u, b): tensor_bytes(layout, u, b) for u in range(LAYERS) for b in dst}
                looked[t].set()

            job0, fence0 = layer(0)
            fence0.wait_on_stream(5)  # returns once layer 0's copy is enqueued
            fake.hang_next("copy")  # so the next copy, layer 1's, hangs until released
            jobs = [layer(t) for t in range(1, LAYERS)]
            fake.enqueue(fake.compute, lambda: look(0))
            assert looked[0].wait(5)
            for b in dst:
                assert seen[0][(0, b)] == want[(0, b)]  # layer 0 in place
                assert seen[0][(1, b)] == poisoned[(1, b)]  # layer 1 not landed yet
            _job1, fence1 = jobs[0]
            fence1.wait_on_stream(5)  # returns at launch, the copy still hangs
            assert not fence1.done
            fake.enqueue(fake.compute, lambda: look(1))
            assert not looked[1].wait(0.2)  # the compute stream waits behind the copy
            fake.release_hangs()  # the fake fails a released copy
            assert looked[1].wait(5)
            results = engine.wait([job0] + [j for j, _ in jobs])
            assert results[0].success
            assert not results[1].success and "hung operation" in str(results[1].error)
            with pytest.raises(TransferError):
                fence1.wait(5)
    finally:
        fake.release_hangs()
        tier.release()


def test_a_layer_that_fails_at_launch_raises_from_its_wait(fake: FakeRuntime) -> None:
    _layout, tier, store, load = device_setup(fake, CopyStrategy.DMA)
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            original = load._ops.memcpy_batch

            def broken(*args: object, **kw: object) -> int:
                raise RuntimeError("launch refused")

            load._ops.memcpy_batch = broken  # type: ignore[method-assign]
            fence = JobFence()
            job = engine.submit(
                TransferSpec(cpu_blocks([0]), gpu_blocks([3]), tensors=[1], fence=fence)
            )
            with pytest.raises(TransferError, match="launch refused"):
                fence.wait_on_stream(5)
            assert fence.done and isinstance(fence.error, TransferError)
            [r] = engine.wait([job])
            assert not r.success
            load._ops.memcpy_batch = original  # type: ignore[method-assign]
            fence2 = JobFence()
            engine.wait(
                [
                    engine.submit(
                        TransferSpec(cpu_blocks([0]), gpu_blocks([3]), tensors=[1], fence=fence2)
                    )
                ]
            )
            fence2.wait(5)
    finally:
        tier.release()


def test_a_device_failure_after_launch_is_reported_by_the_result(fake: FakeRuntime) -> None:
    _layout, tier, store, load = device_setup(fake, CopyStrategy.DMA)
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            fake.fail_next("copy")
            fence = JobFence()
            job = engine.submit(
                TransferSpec(cpu_blocks([0]), gpu_blocks([3]), tensors=[0], fence=fence)
            )
            [r] = engine.wait([job])
            assert not r.success
            with pytest.raises(TransferError):
                fence.wait(5)
    finally:
        tier.release()


def test_a_fence_wait_times_out_while_its_job_sits_unlaunched() -> None:
    fence = JobFence()
    with pytest.raises(JobTimeoutError):
        fence.wait_on_stream(0.01)
    with pytest.raises(JobTimeoutError):
        fence.wait(0.01)
    assert "pending" in repr(fence)


def test_layer_jobs_stay_bit_exact_on_random_ids(fake: FakeRuntime) -> None:
    """Random ids, every layer in its own job, then all compared with a whole-block load."""
    layout, tier, store, load = device_setup(fake)
    rng = np.random.default_rng(1)
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            src = [int(x) for x in rng.choice(4, 4, replace=False)]
            slots = [int(x) for x in rng.choice(8, 4, replace=False)]
            assert engine.wait([engine.submit(TransferSpec(gpu_blocks(src), cpu_blocks(slots)))])[
                0
            ].success
            want = [layout.region_views(0)[i][src].clone() for i in range(len(layout.groups[0]))]
            dst = [4 + x for x in rng.permutation(4).tolist()]
            poison_blocks(layout, dst)
            jobs = [
                engine.submit(TransferSpec(cpu_blocks(slots), gpu_blocks(dst), tensors=[t]))
                for t in rng.permutation(LAYERS).tolist()
            ]
            assert all(r.success for r in engine.wait(jobs))
            for i, view in enumerate(layout.region_views(0)):
                assert torch.equal(view[dst], want[i])
    finally:
        tier.release()


@pytest.mark.parametrize("kind", ["flash-attention", "flashinfer", "separate-kv", "mla"])
@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("order", ["random", "runs"])
def test_staged_parts_of_consecutive_layers_land_bit_exact(
    fake: FakeRuntime, kind: str, factor: int, order: str
) -> None:
    """A staging handler moves a run of consecutive layers as one span of each tier slot
    (one descriptor per block, then a scatter from its staging row); any other choice
    of layers goes region by region. Either way exactly the chosen tensors' bytes land,
    on random ids, over staging pieces smaller than the job. On an allocator's run of
    consecutive slots the spans go as 2D copies, a single layer's too."""
    layout = build_layout(kind, fake.empty, num_blocks=16, num_layers=LAYERS, seed=3)
    tier = pinned_host_tier(fake, layout, 16, factor=factor)  # blocks of `factor` slots
    config = DeviceHandlerConfig(strategy=CopyStrategy.STAGED, staging_bytes=6 * layout.slot_bytes)
    store, load = make_device_handlers(fake, layout, tier, config)
    taken: list[str] = []
    enqueue = load._enqueue
    load._enqueue = lambda plan: (taken.append(plan.strategy.value), enqueue(plan))[1]  # type: ignore[method-assign]
    copies_2d: list[int] = []
    memcpy_2d = fake.memcpy_2d

    def count_2d(*args: Any) -> None:
        copies_2d.append(args[4])  # its rows
        memcpy_2d(*args)

    fake.memcpy_2d = count_2d  # type: ignore[method-assign]
    rng = np.random.default_rng(7)
    tensors = len(layout.tensors)
    try:
        with SyncOffloadingEngine([store, load]) as engine:
            src = [int(x) for x in rng.choice(8, 8, replace=False)]
            slots = [int(x) for x in rng.choice(16, 8 // factor, replace=False)]
            if order == "runs":
                start = int(rng.integers(0, 16 - 8 // factor + 1))
                slots = list(range(start, start + 8 // factor))
            spec = TransferSpec(gpu_blocks(src), cpu_blocks(slots))
            assert engine.wait([engine.submit(spec)])[0].success
            want = {(t, s): tensor_bytes(layout, t, s) for t in range(tensors) for s in src}
            choices = [[0, 1], list(range(tensors)), [tensors - 1], [0, tensors - 1]]
            for chosen in choices:
                dst = [8 + x for x in rng.permutation(8).tolist()]
                poison_blocks(layout, dst)
                before = {(t, b): tensor_bytes(layout, t, b) for t in range(tensors) for b in dst}
                spec = TransferSpec(cpu_blocks(slots), gpu_blocks(dst), tensors=chosen)
                assert engine.wait([engine.submit(spec)])[0].success, chosen
                for t in range(tensors):
                    for s, b in zip(src, dst, strict=True):
                        expect = want[(t, s)] if t in chosen else before[(t, b)]
                        assert tensor_bytes(layout, t, b) == expect, (chosen, t)
    finally:
        tier.release()
        del fake.memcpy_2d
    assert "staged" in taken and "dma" in taken, taken
    if order == "runs":  # the staged parts' runs went as 2D copies (random slots may too)
        assert copies_2d and min(copies_2d) >= COPY2D_ROWS, copies_2d
