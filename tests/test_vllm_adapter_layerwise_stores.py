"""The adapter's layer-wise stores without vLLM: parts by layer, each after its compute.

A bridge over the device handlers on the fake runtime. The model's (fake) compute
stream writes each layer's new KV, held back behind a gate until every part is
submitted: a part whose copies did not wait for its layers' compute would store the
old bytes. Each store comes back as one result once all its parts are in, failed if
any part failed or was refused.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from offload_engine import (
    CacheBlocks,
    Direction,
    InvalidBlockIdsError,
    InvalidTransferError,
    KVLayout,
    Medium,
    SyncOffloadingEngine,
    TransferResult,
    cpu_blocks,
)
from offload_engine.connectors.vllm import bridge as bridge_module
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.connectors.vllm.layerwise import (
    LayerPlan,
    LayerwiseLoads,
    LayerwiseStores,
    TransferJob,
)
from offload_engine.device import DeviceHandlerConfig, make_device_handlers, pinned_host_tier
from offload_engine.testing import LAYOUT_KINDS, FakeRuntime, build_layout
from tests.test_vllm_adapter_layerwise import LAYERS, addresses, bridge, fake, names, region

__all__ = ["bridge", "fake"]  # the fixtures, shared with the layer-wise loads' tests


def plan_of(layout: KVLayout, per: int) -> LayerPlan:
    return LayerPlan.build(layout, addresses(layout), per)


def computed(layer: int, block: int) -> int:
    """The byte layer ``layer``'s (fake) compute writes into cache block ``block``."""
    return 16 * layer + block + 1


def recorded_parts(bridge: EngineBridge, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every submit_part call, as (job id, tensors)."""
    calls: list[Any] = []
    real = bridge.submit_part

    def spy(job_id: int, *args: Any, **kwargs: Any) -> Any:
        calls.append((job_id, args[0]))
        return real(job_id, *args, **kwargs)

    monkeypatch.setattr(bridge, "submit_part", spy)
    return calls


def read_back(bridge: EngineBridge, tier_ids: list[int], into: list[int]) -> None:
    """Load ``tier_ids`` into cache blocks ``into`` (the whole blocks) and wait."""
    assert bridge.submit_load(90, tier_ids, into, (len(into),), (0,))
    bridge.wait([90])
    [result] = bridge.get_finished()
    assert result.job_id == 90 and result.success


def test_each_part_goes_out_after_its_layers_and_stores_their_computed_bytes(
    fake: FakeRuntime, bridge: EngineBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = bridge.layout
    assert layout is not None
    stores = LayerwiseStores(bridge, plan_of(layout, 2))
    calls = recorded_parts(bridge, monkeypatch)
    go = threading.Event()
    fake.enqueue(fake.compute, lambda: go.wait(10))  # compute runs only once go is set
    stores.start(
        [
            TransferJob(1, [0, 1], (2,), (0,), tier_ids=[3, 4]),
            TransferJob(2, [2], (1,), (0,), tier_ids=[5]),
        ]
    )
    assert stores.open and calls == []
    out_after: list[int] = []
    for i, name in enumerate(names(LAYERS)):

        def layer(i: int = i) -> None:
            for b in (0, 1, 2):
                region(layout, i, b).fill_(computed(i, b))

        fake.enqueue(fake.compute, layer)
        stores.saved(name)
        out_after.append(len(calls))
    # a part goes out once both its layers are computed, parts in layer order
    assert out_after == [0, 2, 2, 4, 4, 6]
    assert calls == [(j, t) for t in ((0, 1), (2, 3), (4, 5)) for j in (1, 2)]
    assert bridge.get_finished() == []  # nothing can have finished behind the gate
    go.set()
    stores.finish_step()  # every part is out already: nothing more
    assert len(calls) == 6 and not stores.open
    bridge.wait([1, 2])
    results = {r.job_id: r for r in bridge.get_finished()}
    assert set(results) == {1, 2}  # one result per store, not one per part
    assert results[1].success and results[1].bytes_moved == 2 * layout.slot_bytes
    assert results[2].success and results[2].bytes_moved == layout.slot_bytes
    adapter = bridge.stats()["adapter"]
    assert adapter["stores_submitted"] == 2
    assert (adapter["store_parts_at_layer"], adapter["store_parts_at_step_end"]) == (6, 0)
    read_back(bridge, [3, 4, 5], [6, 7, 5])
    for t in range(LAYERS):
        for b, back in ((0, 6), (1, 7), (2, 5)):
            got = set(region(layout, t, back).tolist())
            assert got == {computed(t, b)}, (t, b)


def test_finish_step_submits_the_parts_no_layer_reached(
    fake: FakeRuntime, bridge: EngineBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = bridge.layout
    assert layout is not None
    want = {t: region(layout, t, 0).clone() for t in range(LAYERS)}
    stores = LayerwiseStores(bridge, plan_of(layout, 4))  # parts (0..3), (4, 5)
    calls = recorded_parts(bridge, monkeypatch)
    stores.start([TransferJob(3, [0], (1,), (0,), tier_ids=[2])])
    stores.saved(names(LAYERS)[0])
    stores.saved("model.lm_head")  # not in the plan: left to finish_step
    assert calls == []
    bridge.wait([3])  # a store whose parts are not all out is not finished
    assert bridge.get_finished() == []
    stores.finish_step()
    assert calls == [(3, (0, 1, 2, 3)), (3, (4, 5))]
    assert bridge.stats()["adapter"]["store_parts_at_step_end"] == 2
    bridge.wait([3])
    [result] = bridge.get_finished()
    assert result.job_id == 3 and result.success
    read_back(bridge, [2], [7])
    for t in range(LAYERS):
        assert region(layout, t, 7).equal(want[t])


def test_a_refused_part_fails_its_stores_result(fake: FakeRuntime, bridge: EngineBridge) -> None:
    layout = bridge.layout
    assert layout is not None
    plan = plan_of(layout, 2)
    stores = LayerwiseStores(bridge, plan)
    # job 4's tier block 99 is past the tier: each of its parts is refused at submit
    stores.start(
        [
            TransferJob(4, [0], (1,), (0,), tier_ids=[99]),
            TransferJob(5, [1], (1,), (0,), tier_ids=[1]),
        ]
    )
    for name in names(2):
        stores.saved(name)
    assert bridge.get_finished() == []  # job 4 has parts to come: no result yet
    stores.finish_step()
    bridge.wait([4, 5])
    results = {r.job_id: r for r in bridge.get_finished()}
    assert set(results) == {4, 5}
    assert not results[4].success and results[4].bytes_moved == 0
    assert results[4].error is not None
    assert results[5].success
    adapter = bridge.stats()["adapter"]
    assert adapter["submits_refused"] == plan.parts
    assert adapter["failures_delivered"] == 1


def test_a_part_that_fails_on_the_device_fails_its_stores_result(
    fake: FakeRuntime, bridge: EngineBridge
) -> None:
    layout = bridge.layout
    assert layout is not None
    stores = LayerwiseStores(bridge, plan_of(layout, 3))
    stores.start([TransferJob(6, [0, 1], (2,), (0,), tier_ids=[0, 1])])
    fake.fail_next("copy")  # the first part's copies fail on the device, after launch
    for name in names(LAYERS):
        stores.saved(name)
    stores.finish_step()
    bridge.wait([6])
    [result] = bridge.get_finished()
    assert result.job_id == 6 and not result.success and result.error is not None


#: one cache block and one tier block, as open_parts takes a job's blocks
BLOCKS: dict[str, Any] = {
    "cache_ids": [0],
    "group_sizes": (1,),
    "block_indices": (0,),
    "tier_ids": [0],
}


def test_parts_are_announced_checked_and_counted(bridge: EngineBridge) -> None:
    for bad in (0, -1, True, 1.0):
        with pytest.raises(InvalidTransferError, match="at least one part"):
            bridge.open_parts(7, Direction.STORE, bad, **BLOCKS)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match="no part left"):
        bridge.submit_part(7, None)  # never opened
    assert bridge.open_parts(7, Direction.STORE, 1, **BLOCKS) is None
    with pytest.raises(InvalidTransferError, match="already out"):
        bridge.open_parts(7, Direction.LOAD, 2, **BLOCKS)
    assert bridge.submit_part(7, None) is None
    with pytest.raises(InvalidTransferError, match="all 1 were"):
        bridge.submit_part(7, None)
    bridge.wait([7])
    [result] = bridge.get_finished()
    assert isinstance(result, TransferResult) and result.job_id == 7 and result.success
    assert bridge.stats()["adapter"]["stores_submitted"] == 1


def counted_conversions(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the bridge converts vLLM's ids into cache and tier blocks."""
    counts: Counter[str] = Counter()

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)

        return spy

    monkeypatch.setattr(bridge_module, "CacheBlocks", counting("cache", CacheBlocks))
    monkeypatch.setattr(bridge_module, "cpu_blocks", counting("tier", cpu_blocks))
    return counts


def test_a_jobs_blocks_are_converted_once_for_all_its_parts(
    fake: FakeRuntime, bridge: EngineBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = bridge.layout
    assert layout is not None
    plan = plan_of(layout, 1)  # one part per layer
    assert plan.parts == LAYERS
    conversions = counted_conversions(monkeypatch)
    stores = LayerwiseStores(bridge, plan)
    calls = recorded_parts(bridge, monkeypatch)
    stores.start(
        [
            TransferJob(1, [0, 1], (2,), (0,), tier_ids=[3, 4]),
            TransferJob(2, [2], (1,), (0,), tier_ids=[5]),
        ]
    )
    assert conversions == {"cache": 2, "tier": 2}  # at open, once per store
    for name in names(LAYERS):
        stores.saved(name)
    stores.finish_step()
    assert len(calls) == 2 * LAYERS
    assert conversions == {"cache": 2, "tier": 2}  # no part converted them again
    loads = LayerwiseLoads(bridge, plan, timeout=10)
    loads.start([TransferJob(3, [6, 7], (2,), (0,), tier_ids=[3, 4])])
    for name in names(LAYERS):
        loads.wait_for_layer(name)
    loads.finish_step()
    assert conversions == {"cache": 3, "tier": 3}  # a load of 6 parts: once
    bridge.wait([1, 2, 3])
    results = {r.job_id: r for r in bridge.get_finished()}
    assert set(results) == {1, 2, 3} and all(r.success for r in results.values())
    assert results[3].bytes_moved == 2 * layout.slot_bytes


def test_blocks_refused_at_open_end_the_store_as_one_failed_result(
    fake: FakeRuntime,
    bridge: EngineBridge,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = bridge.layout
    assert layout is not None
    plan = plan_of(layout, 2)
    caplog.set_level(logging.ERROR, logger="offload_engine.connectors.vllm.bridge")
    # job 4's group sizes count two cache blocks, its ids one: refused when opened
    refused = bridge.open_parts(
        4,
        Direction.STORE,
        plan.parts,
        cache_ids=[0],
        group_sizes=(2,),
        block_indices=(0,),
        tier_ids=[1],
    )
    assert isinstance(refused, InvalidTransferError)
    assert "store job 4" in caplog.text
    assert "InvalidTransferError: group_sizes (2,) sum to 2" in caplog.text
    assert bridge.open_parts(5, Direction.STORE, plan.parts, **BLOCKS) is None
    conversions = counted_conversions(monkeypatch)
    for tensors in plan.tensor_sets[:-1]:
        assert bridge.submit_part(4, tensors) is refused  # never reaches the engine
        assert bridge.submit_part(5, tensors) is None
    bridge.wait([4])  # none of job 4's parts is in the engine: returns at once
    assert bridge.get_finished() == []  # job 4 has a part to come: no result yet
    assert bridge.submit_part(4, plan.tensor_sets[-1]) is refused
    assert bridge.submit_part(5, plan.tensor_sets[-1]) is None
    assert conversions == {}
    with pytest.raises(InvalidTransferError, match="no part left"):
        bridge.submit_part(4, None)  # all were handed in: the job is done
    bridge.wait([4, 5])
    results = {r.job_id: r for r in bridge.get_finished()}
    assert set(results) == {4, 5}  # one result per store, none for a part
    assert not results[4].success and results[4].bytes_moved == 0
    assert results[4].error is refused
    assert results[5].success
    assert bridge.get_finished() == [] and bridge.live_jobs == 0
    adapter = bridge.stats()["adapter"]
    assert adapter["stores_submitted"] == 2
    assert adapter["submits_refused"] == plan.parts
    assert adapter["failures_delivered"] == 1


def test_layerwise_stores_of_blocks_refused_at_open_still_finish(
    fake: FakeRuntime, bridge: EngineBridge
) -> None:
    layout = bridge.layout
    assert layout is not None
    stores = LayerwiseStores(bridge, plan_of(layout, 2))
    stores.start(
        [
            TransferJob(4, [0, -1], (2,), (0,), tier_ids=[1]),
            TransferJob(5, [1], (1,), (0,), tier_ids=[2]),
        ]
    )
    for name in names(LAYERS):
        stores.saved(name)
    stores.finish_step()
    bridge.wait([4, 5])
    results = {r.job_id: r for r in bridge.get_finished()}
    assert set(results) == {4, 5}
    assert not results[4].success and isinstance(results[4].error, InvalidBlockIdsError)
    assert results[5].success


def test_a_one_part_plan_stores_the_whole_block_once_every_layer_is_saved(
    fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = build_layout("cross-layer", fake.empty, num_blocks=4, num_layers=LAYERS)
    tier = pinned_host_tier(fake, layout, 4)
    engine = SyncOffloadingEngine(list(make_device_handlers(fake, layout, tier)))
    bridge = EngineBridge(engine, Medium.GPU, tier=tier, layout=layout)
    try:
        base = layout.tensors[0].data_ptr()
        plan = LayerPlan.build(layout, {n: base + 64 * i for i, n in enumerate(names(3))}, 1)
        assert plan.parts == 1
        stores = LayerwiseStores(bridge, plan)
        calls = recorded_parts(bridge, monkeypatch)
        stores.start([TransferJob(8, [1], (1,), (0,), tier_ids=[2])])
        for name in names(3):
            assert calls == []
            stores.saved(name)
        assert calls == [(8, None)]
        stores.finish_step()
        bridge.wait([8])
        [result] = bridge.get_finished()
        assert result.success and result.bytes_moved == layout.slot_bytes
    finally:
        bridge.shutdown()


def layerwise_store_race(
    runtime: Any,
    layout: KVLayout,
    *,
    per_part: int,
    on_stream: Callable[[Callable[[], None]], None],
    hold: Callable[[], None],
    release: Callable[[], None],
) -> None:
    """Layer-wise stores of the first half of ``layout``'s blocks, each layer's KV written
    by work ``on_stream`` (the model's stream) that ``hold`` keeps back until every part
    is submitted and ``release`` lets go; loaded back over poison into the second half,
    every layer must hold the bytes its compute wrote. Shared with the GPU tests."""
    groups = len(layout.groups)
    n = layout.num_blocks // (2 * groups)
    src, dst = list(range(n * groups)), list(range(n * groups, 2 * n * groups))
    sizes, first = (n,) * groups, (0,) * groups
    device = layout.tensors[0].device
    tier = pinned_host_tier(runtime, layout, n * groups)
    handlers = make_device_handlers(runtime, layout, tier, DeviceHandlerConfig(max_inflight=64))
    bridge = EngineBridge(
        SyncOffloadingEngine(list(handlers)), Medium.GPU, tier=tier, layout=layout
    )

    def views(tensor: int, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for g in range(groups):
            index = torch.tensor(blocks[g * n : (g + 1) * n], device=device)
            for view, r in zip(layout.region_views(g), layout.groups[g], strict=True):
                if r.tensor == tensor:
                    out.append((view, index))
        return out

    def compute(tensor: int) -> None:  # layer ``tensor`` writes its KV of the new blocks
        for view, index in views(tensor, src):
            view[index] = 0x10 + tensor

    try:
        names = [f"model.layers.{t}.attn" for t in range(len(layout.tensors))]
        found = {name: t.data_ptr() for name, t in zip(names, layout.tensors, strict=True)}
        stores = LayerwiseStores(bridge, LayerPlan.build(layout, found, per_part))
        stores.start([TransferJob(1, src, sizes, first, tier_ids=list(range(n * groups)))])
        hold()
        for t, name in enumerate(names):
            on_stream(partial(compute, t))
            stores.saved(name)
        release()
        stores.finish_step()
        bridge.wait([1])
        [stored] = bridge.get_finished()
        assert stored.job_id == 1 and stored.success, stored.error
        for t in range(len(layout.tensors)):
            for view, index in views(t, dst):
                view[index] = 0xA5
        assert bridge.submit_load(2, list(range(n * groups)), dst, sizes, first)
        bridge.wait([2])
        [loaded] = bridge.get_finished()
        assert loaded.success, loaded.error
        wrong = [
            t
            for t in range(len(layout.tensors))
            for view, index in views(t, dst)
            if not bool((view.index_select(0, index) == 0x10 + t).all())
        ]
        assert wrong == [], f"layers stored before their compute: {wrong}"
    finally:
        bridge.shutdown()


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("per_part", [1, 2])
def test_every_layout_stores_each_layer_after_its_compute(
    fake: FakeRuntime, kind: str, per_part: int
) -> None:
    layout = build_layout(kind, fake.empty, num_blocks=8, num_layers=4, seed=per_part)
    gate = threading.Event()
    layerwise_store_race(
        fake,
        layout,
        per_part=per_part,
        on_stream=lambda work: fake.enqueue(fake.compute, work),
        hold=lambda: fake.enqueue(fake.compute, lambda: gate.wait(10)),
        release=gate.set,
    )
