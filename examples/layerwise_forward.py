"""A forward pass of your own that reads a prefix's KV from the host tier layer by layer.

The prefix's KV blocks sit in the engine's host tier. Instead of loading them
all and then computing, the forward pass submits one load per layer (each moves
only that layer's bytes of every block: ``TransferSpec.tensors``) with a
``JobFence``, and each layer waits only for its own load:

* on a GPU, ``fence.wait_on_stream()`` makes the compute stream wait for the
  layer's copies and returns at once, so loading layer i+1 overlaps computing
  layer i;
* on the host (no GPU), it waits for the copy itself.

The pass attends over the loaded KV and is checked against the same pass over
the original KV: the outputs must be identical. Run it::

    python examples/layerwise_forward.py            # CUDA if usable, else host memory
    python examples/layerwise_forward.py --device cpu
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from offload_engine import (
    HostCopyHandler,
    HostTier,
    JobFence,
    KVLayout,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
)

LAYERS, BLOCKS, TOKENS, KV_HEADS, HEADS, DIM = 8, 16, 16, 2, 8, 64


def build(device: str) -> tuple[SyncOffloadingEngine, list[torch.Tensor], Any]:
    """A per-layer KV cache (K and V of a block side by side), its tier and an engine."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    layers = [
        torch.randn(BLOCKS, 2, TOKENS, KV_HEADS, DIM, dtype=dtype, device=device)
        for _ in range(LAYERS)
    ]
    layout = KVLayout.flashinfer(layers)  # one region per layer: tensor i is layer i
    if device == "cuda":
        from offload_engine import CudaRuntime, make_device_handlers, pinned_host_tier

        runtime = CudaRuntime()
        tier = pinned_host_tier(runtime, layout, BLOCKS)
        engine = SyncOffloadingEngine(list(make_device_handlers(runtime, layout, tier)))
        return engine, layers, gpu_blocks
    tier = HostTier(BLOCKS, layout.slot_bytes)
    return SyncOffloadingEngine([HostCopyHandler(layout, tier)]), layers, host_cache_blocks


def attend(query: torch.Tensor, kv: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """One layer's attention of ``query`` over the KV of ``blocks`` (the "compute")."""
    k = kv[blocks, 0].reshape(-1, KV_HEADS, DIM).transpose(0, 1)
    v = kv[blocks, 1].reshape(-1, KV_HEADS, DIM).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), k, v, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(query.shape)


def forward(
    query: torch.Tensor,
    layers: list[torch.Tensor],
    blocks: list[int],
    fences: list[JobFence] | None = None,
) -> torch.Tensor:
    x = query
    for i, kv in enumerate(layers):
        if fences is not None:
            fences[i].wait_on_stream()  # only this layer's load stands before its compute
        x = x + attend(x, kv, blocks)
    return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    args = parser.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    engine, layers, cache_blocks = build(device)
    prefix, slots, reloaded = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]
    query = torch.randn(TOKENS, HEADS, DIM, dtype=layers[0].dtype, device=device)
    with engine:
        want = forward(query, layers, prefix)
        # park the prefix's blocks in the tier, then lose them from the cache
        [stored] = engine.wait(
            [engine.submit(TransferSpec(cache_blocks(prefix), cpu_blocks(slots)))]
        )
        if not stored.success:
            raise SystemExit(f"store failed: {stored.error}")
        for kv in layers:
            kv[reloaded] = float("nan")
        # one load per layer, all submitted before the forward pass starts
        fences = [JobFence() for _ in layers]
        jobs = [
            engine.submit(
                TransferSpec(cpu_blocks(slots), cache_blocks(reloaded), tensors=[i], fence=fence)
            )
            for i, fence in enumerate(fences)
        ]
        got = forward(query, layers, reloaded, fences)
        failed = [r for r in engine.wait(jobs) if not r.success]
    if failed:
        print(f"{len(failed)} layer loads failed: {failed[0].error}", file=sys.stderr)
        return 1
    same = torch.equal(got, want)
    print(
        f"{device}: {LAYERS} layers loaded one by one inside the forward pass; "
        f"output {'identical to' if same else 'DIFFERENT from'} the pass over the original KV"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
