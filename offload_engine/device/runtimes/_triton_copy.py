"""The device-side block copy as a Triton kernel (compiled at first use, never at install).

The CUDA runtime launches the same copy through NVRTC and the driver
(``_cuda_copy``), which costs far less CPU per launch; this kernel is its
fallback (``CudaRuntime(use_nvrtc=False)``, or NVRTC missing).

One program copies one tile of one region of one block:
``grid = (blocks, regions, tiles)``. Addresses come from int64 tables (region
base, block stride, size, slot offset) plus the job's block ids, so the host
uploads only the ids; no per-chunk pointer table crosses PCIe. Chunks move as
int64 words (8-byte aligned sizes and addresses are required; the runtime
checks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from offload_engine.device.runtimes.base import BlockCopy
from offload_engine.vocabulary import Direction

WORDS = 1024  # int64 words per program: 8 KiB


@triton.jit
def _block_copy(  # type: ignore[no-untyped-def]
    region_base,
    region_stride,
    region_size,
    slot_offset,
    cache_ids,
    slot_ids,
    slot_base,
    slot_bytes,
    TO_SLOTS: tl.constexpr,
    HAS_SLOT_IDS: tl.constexpr,
    WORDS: tl.constexpr,
):
    i = tl.program_id(0)
    r = tl.program_id(1)
    tile = tl.program_id(2)
    size = tl.load(region_size + r)
    start = tile.to(tl.int64) * (WORDS * 8)
    if start < size:
        cid = tl.load(cache_ids + i)
        if HAS_SLOT_IDS:  # noqa: SIM108 - a constexpr branch, resolved at compile time
            sid = tl.load(slot_ids + i)
        else:
            sid = i.to(tl.int64)
        cache_addr = tl.load(region_base + r) + cid * tl.load(region_stride + r) + start
        slot_addr = slot_base + sid * slot_bytes + tl.load(slot_offset + r) + start
        words = tl.arange(0, WORDS)
        mask = words * 8 < size - start
        cache_ptr = cache_addr.to(tl.pointer_type(tl.int64))
        slot_ptr = slot_addr.to(tl.pointer_type(tl.int64))
        if TO_SLOTS:
            tl.store(slot_ptr + words, tl.load(cache_ptr + words, mask=mask), mask=mask)
        else:
            tl.store(cache_ptr + words, tl.load(slot_ptr + words, mask=mask), mask=mask)


def launch_block_copy(copy: BlockCopy) -> None:
    """Enqueue ``copy`` on the current stream."""
    if copy.count == 0:
        return
    tiles = -(-copy.max_region_size // (WORDS * 8))
    grid = (copy.count, int(copy.region_size.shape[0]), tiles)
    slot_ids = copy.slot_ids if copy.slot_ids is not None else copy.cache_ids
    _block_copy[grid](
        copy.region_base,
        copy.region_stride,
        copy.region_size,
        copy.slot_offset,
        copy.cache_ids,
        slot_ids,
        copy.slot_base,
        copy.slot_bytes,
        TO_SLOTS=copy.direction is Direction.STORE,
        HAS_SLOT_IDS=copy.slot_ids is not None,
        WORDS=WORDS,
    )
