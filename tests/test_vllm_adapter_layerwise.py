"""The adapter's layer-wise loads without vLLM: parts by layer, waits, failures reported.

A bridge over the device handler on the fake runtime: the model's (fake) compute
stream reads each layer's blocks right after that layer's wait, and finds them in
place; a part the engine refuses makes its load's blocks come back as load errors.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from offload_engine import InvalidTransferError, KVLayout, Medium, SyncOffloadingEngine
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.connectors.vllm.layerwise import (
    LayerPlan,
    LayerwiseLoads,
    TransferJob,
    forward_order,
)
from offload_engine.device import make_device_handlers, pinned_host_tier
from offload_engine.host.layout import byte_view
from offload_engine.testing import FakeRuntime, build_layout

LAYERS = 6


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    yield runtime
    runtime.close()


@pytest.fixture
def bridge(fake: FakeRuntime) -> Iterator[EngineBridge]:
    """A bridge over the device handlers on the fake runtime, with a 6-layer cache."""
    layout = build_layout("flashinfer", fake.empty, num_blocks=8, num_layers=LAYERS, seed=2)
    tier = pinned_host_tier(fake, layout, 8)
    engine = SyncOffloadingEngine(list(make_device_handlers(fake, layout, tier)))
    made = EngineBridge(engine, Medium.GPU, tier=tier, layout=layout)
    yield made
    made.shutdown()


def names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def addresses(layout: KVLayout) -> dict[str, int]:
    # vLLM registers each layer's tensor; the dict's order is not the forward order
    return dict(
        reversed(
            [
                (n, t.data_ptr())
                for n, t in zip(names(len(layout.tensors)), layout.tensors, strict=True)
            ]
        )
    )


def test_forward_order_sorts_by_layer_index() -> None:
    got = forward_order(["m.layers.10.attn", "m.layers.2.attn", "head", "m.layers.2.cross"])
    assert got == ["m.layers.2.attn", "m.layers.2.cross", "m.layers.10.attn", "head"]


def test_plans_group_layers_in_forward_order(fake: FakeRuntime) -> None:
    layout = build_layout("flashinfer", fake.empty, num_blocks=4, num_layers=LAYERS)
    plan = LayerPlan.build(layout, addresses(layout), 4)
    assert plan.tensor_sets == ((0, 1, 2, 3), (4, 5))
    assert [plan.part_of[n] for n in names(LAYERS)] == [0, 0, 0, 0, 1, 1]
    one = LayerPlan.build(layout, addresses(layout), 1)
    assert one.parts == LAYERS and one.part_of[names(LAYERS)[3]] == 3


def test_layers_in_one_tensor_load_as_one_part(fake: FakeRuntime) -> None:
    layout = build_layout("cross-layer", fake.empty, num_blocks=4, num_layers=LAYERS)
    base = layout.tensors[0].data_ptr()
    plan = LayerPlan.build(layout, {n: base + 64 * i for i, n in enumerate(names(LAYERS))}, 1)
    assert plan.tensor_sets == (None,) and set(plan.part_of.values()) == {0}
    # a layer whose tensor is not in the layout: one part, the whole load
    other = LayerPlan.build(build_layout("flashinfer", fake.empty), {"x.0.a": 1, "x.1.a": 2}, 1)
    assert other.tensor_sets == (None,)


def region(layout: KVLayout, tensor: int, block: int) -> torch.Tensor:
    """The bytes of cache block ``block`` in ``layout.tensors[tensor]`` (a view)."""
    [r] = [r for r in layout.groups[0] if r.tensor == tensor]
    start = r.offset + block * r.stride
    return byte_view(layout.tensors[tensor])[start : start + r.size]


def block_bytes(layout: KVLayout, tensor: int, block: int) -> bytes:
    return bytes(region(layout, tensor, block).numpy().tobytes())


def test_each_layer_wait_orders_that_layer_before_the_compute_stream(
    fake: FakeRuntime, bridge: EngineBridge
) -> None:
    layout = bridge.layout
    assert layout is not None
    assert bridge.submit_store(1, [0, 1], (2,), (0,), [3, 4])
    bridge.wait([1])
    assert [r.job_id for r in bridge.get_finished()] == [1]
    want = {(t, b): block_bytes(layout, t, s) for t in range(LAYERS) for s, b in ((0, 5), (1, 6))}
    for t in range(LAYERS):
        for b in (5, 6):
            byte_view(layout.tensors[t])[b * layout.groups[0][t].stride :][
                : layout.groups[0][t].size
            ].fill_(0)
    loads = LayerwiseLoads(bridge, LayerPlan.build(layout, addresses(layout), 2), timeout=10)
    seen: dict[int, dict[tuple[int, int], bytes]] = {}
    done = threading.Event()
    loads.start([TransferJob(7, [5, 6], (2,), (0,), tier_ids=[3, 4])])
    for i, name in enumerate(names(LAYERS)):
        loads.wait_for_layer(name)

        def look(i: int = i) -> None:
            seen[i] = {(t, b): block_bytes(layout, t, b) for t in range(LAYERS) for b in (5, 6)}

        fake.enqueue(fake.compute, look)
    loads.finish_step()
    fake.enqueue(fake.compute, done.set)
    assert done.wait(10)
    for i in range(LAYERS):
        for b in (5, 6):
            assert seen[i][(i, b)] == want[(i, b)], (i, b)
    bridge.wait([7])
    [result] = bridge.get_finished()
    assert result.job_id == 7 and result.success  # the parts come back as one load
    assert result.bytes_moved == 2 * layout.slot_bytes
    assert loads.owns(7)
    loads.finished(7, True, None)
    assert not loads.owns(7) and loads.take_invalid() == set()
    adapter = bridge.stats()["adapter"]
    assert adapter["loads_submitted"] == 1
    # the step's clock: one step of LAYERS / 2 parts, its waits inside its span
    steps = adapter["timings"]["layerwise_loads"]
    assert steps["steps"] == 1 and steps["parts_p50"] == LAYERS // 2
    [[span, blocked]] = steps["recent_ms"]
    assert 0 <= blocked <= span == round(steps["start_to_forward_end_ms_p50"], 2)


def test_a_refused_part_reports_its_loads_blocks_as_load_errors(
    fake: FakeRuntime, bridge: EngineBridge
) -> None:
    layout = bridge.layout
    assert layout is not None
    plan = LayerPlan.build(layout, addresses(layout), 3)
    loads = LayerwiseLoads(bridge, plan, timeout=10)
    # tier block 99 is out of range: every part is refused at submit
    loads.start([TransferJob(4, [2], (1,), (0,), tier_ids=[99])])
    for name in names(LAYERS):
        loads.wait_for_layer(name)  # does not raise: the failure is reported
    loads.finish_step()
    assert loads.take_invalid() == {2}
    [result] = bridge.get_finished()
    assert result.job_id == 4 and not result.success
    loads.finished(4, False, result.error)
    # reported once, at the wait: a later report could name blocks another request owns
    assert loads.take_invalid() == set()
    assert not loads.owns(4)
    assert bridge.stats()["adapter"]["submits_refused"] == plan.parts


def test_blocks_refused_at_open_fail_every_wait_and_the_load_once(
    fake: FakeRuntime, bridge: EngineBridge
) -> None:
    layout = bridge.layout
    assert layout is not None
    plan = LayerPlan.build(layout, addresses(layout), 2)
    loads = LayerwiseLoads(bridge, plan, timeout=10)
    # two cache ids for a group of one: refused when the load is opened
    loads.start([TransferJob(4, [2, 3], (1,), (0,), tier_ids=[1])])
    for name in names(LAYERS):
        loads.wait_for_layer(name)  # does not raise: the failure is reported
    loads.finish_step()
    assert loads.take_invalid() == {2, 3}
    [result] = bridge.get_finished()
    assert result.job_id == 4 and not result.success and result.bytes_moved == 0
    assert isinstance(result.error, InvalidTransferError)
    loads.finished(4, False, result.error)
    assert loads.take_invalid() == set() and not loads.owns(4)
    adapter = bridge.stats()["adapter"]
    assert adapter["loads_submitted"] == 1 and adapter["submits_refused"] == plan.parts
    assert adapter["failures_delivered"] == 1 and bridge.live_jobs == 0


def test_a_part_that_fails_on_the_device_is_reported_once(
    fake: FakeRuntime, bridge: EngineBridge
) -> None:
    layout = bridge.layout
    assert layout is not None
    loads = LayerwiseLoads(bridge, LayerPlan.build(layout, addresses(layout), 3), timeout=10)
    fake.fail_next("copy")  # the first part's copies fail on the device, after launch
    loads.start([TransferJob(9, [4, 5], (2,), (0,), tier_ids=[0, 1])])
    for name in names(LAYERS):
        loads.wait_for_layer(name)  # the copy may or may not have failed by now
    loads.finish_step()
    at_wait = loads.take_invalid()  # known at a wait only if the failure came first
    bridge.wait([9])
    [result] = bridge.get_finished()
    assert result.job_id == 9 and not result.success
    loads.finished(9, result.success, result.error)
    by_result = loads.take_invalid()
    # reported once, by whichever saw the failure first
    assert at_wait | by_result == {4, 5} and not at_wait & by_result
