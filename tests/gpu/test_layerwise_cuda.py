"""Layer-wise loads on a real GPU: every layout round-trips bit-exact layer by layer, and
work the model's stream issues right after a layer's fence wait reads that layer's final
bytes (a race the stream wait must win). Layer-wise stores: each part, submitted while the
model's stream is still busy before its layers' writes, stores those writes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from offload_engine import JobFence, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.device import DeviceHandlerConfig, make_device_handlers, pinned_host_tier
from offload_engine.host.layout import byte_view
from offload_engine.testing import LAYOUT_KINDS, build_layout
from tests.test_vllm_adapter_layerwise_stores import layerwise_store_race

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

POISON = 0x5A


@pytest.fixture(scope="module")
def cuda() -> Iterator[Any]:
    from offload_engine.device.runtimes.cuda import CudaRuntime

    yield CudaRuntime()


def gpu_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


def tensor_views(layout: Any, tensor: int, blocks: list[int]) -> list[torch.Tensor]:
    """Each region of ``tensor`` in every group, as byte rows of that group's share of
    ``blocks`` (the spec's ids are ordered by group, an equal share each)."""
    out = []
    share = len(blocks) // len(layout.groups)
    for g in range(len(layout.groups)):
        index = torch.tensor(blocks[g * share : (g + 1) * share], device="cuda")
        for view, r in zip(layout.region_views(g), layout.groups[g], strict=True):
            if r.tensor == tensor:
                out.append(view.index_select(0, index))
    return out


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("per_part", [1, 2])
@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
def test_layer_by_layer_round_trip_and_race(
    cuda: Any, kind: str, factor: int, per_part: int, order: str
) -> None:
    """Random slots go block by block; an allocator's runs of consecutive slots go
    as 2D copies."""
    n, groups = 64, 2 if kind == "groups" else 1
    half = n * groups
    layout = build_layout(
        kind, gpu_empty, num_blocks=2 * half, num_layers=8, kv_heads=8, head_dim=128, seed=factor
    )
    assert len(layout.groups) == groups
    rng = np.random.default_rng(factor + per_part)
    src = [int(x) for x in rng.choice(half, half, replace=False)]
    dst = [half + int(x) for x in rng.choice(half, half, replace=False)]
    per_group = -(-n // factor)
    slots = [int(x) for x in rng.permutation(per_group * groups)]
    if order != "random":
        slots = sorted(slots, reverse=order == "descending")
    sizes = (n,) * groups
    tier = pinned_host_tier(cuda, layout, per_group * groups, factor=factor)
    try:
        store, load = make_device_handlers(cuda, layout, tier, DeviceHandlerConfig(max_inflight=64))
        with SyncOffloadingEngine([store, load]) as engine:
            spec = TransferSpec(gpu_blocks(src, group_sizes=sizes), cpu_blocks(slots))
            [stored] = engine.wait([engine.submit(spec)])
            assert stored.success, stored.error
            tensors = list(range(len(layout.tensors)))
            want = {t: [v.clone() for v in tensor_views(layout, t, src)] for t in tensors}
            for g in range(groups):
                index = torch.tensor(dst[g * n : (g + 1) * n], device="cuda")
                for view in layout.region_views(g):
                    view[index] = POISON
            parts = [tensors[i : i + per_part] for i in range(0, len(tensors), per_part)]
            fences = [JobFence() for _ in parts]
            jobs = [
                engine.submit(
                    TransferSpec(
                        cpu_blocks(slots),
                        gpu_blocks(dst, group_sizes=sizes),
                        tensors=part,
                        fence=fence,
                    )
                )
                for part, fence in zip(parts, fences, strict=True)
            ]
            seen = {}
            for part, fence in zip(parts, fences, strict=True):
                fence.wait_on_stream(30)
                for t in part:  # the model's stream reads the layer right after its wait
                    seen[t] = [v.clone() for v in tensor_views(layout, t, dst)]
            results = engine.wait(jobs)
            assert all(r.success for r in results), [r.error for r in results]
            torch.cuda.synchronize()
            corrupt = [
                t
                for t in tensors
                if not all(torch.equal(a, b) for a, b in zip(seen[t], want[t], strict=True))
            ]
            assert corrupt == [], f"layers read before their bytes landed: {corrupt}"
            for t in tensors:  # and the cache holds them afterwards
                assert all(
                    torch.equal(a, b)
                    for a, b in zip(tensor_views(layout, t, dst), want[t], strict=True)
                )
        assert byte_view(layout.tensors[0]).numel() > 0
    finally:
        tier.release()


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("per_part", [1, 2, 8])
def test_layerwise_stores_wait_for_each_layers_compute(cuda: Any, kind: str, per_part: int) -> None:
    layout = build_layout(
        kind, gpu_empty, num_blocks=128, num_layers=8, kv_heads=8, head_dim=128, seed=per_part
    )
    layerwise_store_race(
        cuda,
        layout,
        per_part=per_part,
        on_stream=lambda work: work(),  # torch enqueues on the current stream
        # the model's stream is still busy when every part is submitted
        hold=lambda: torch.cuda._sleep(200_000_000),
        release=lambda: None,
    )
