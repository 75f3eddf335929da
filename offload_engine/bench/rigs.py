"""Rigs: a KV cache, a host tier and the handlers that move blocks between them.

The demo and the benchmarks run on a rig, so they run unchanged on whichever
medium is present: :func:`open_host_rig` (the KV cache in host memory, the host
handler) or :func:`open_device_rig` (the KV cache in device memory, a pinned
tier, the device handlers; on a CUDA machine through
:func:`offload_engine.bench.cuda.open_cuda_rig`).
:func:`offload_engine.bench.cuda.open_rig` picks one from a ``--device`` value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from offload_engine.bench.machine import available_memory_bytes, memory_size
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.engine.handler import TransferHandler
from offload_engine.errors import InsufficientMemoryError
from offload_engine.host.handler import HostCopyHandler
from offload_engine.host.layout import KVLayout, byte_view
from offload_engine.host.tier import HostTier
from offload_engine.testing.caches import poisoned_tier, random_host_cache
from offload_engine.vocabulary import (
    BlockIdsLike,
    CacheBlocks,
    Medium,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
    npu_blocks,
)

Device = Literal["auto", "cuda", "cpu"]
DEVICES: tuple[Device, ...] = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class RigShape:
    """The KV cache a rig builds: per-layer blocks-first tensors, bf16.

    One block is ``num_layers * 2 * block_tokens * kv_heads * head_dim * 2`` bytes
    (128 KiB with the defaults).
    """

    num_layers: int = 8
    num_blocks: int = 1024
    tier_blocks: int = 512
    block_tokens: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    seed: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV-cache block (and of one tier block), all layers."""
        return self.num_layers * 2 * self.block_tokens * self.kv_heads * self.head_dim * 2

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def tier_bytes(self) -> int:
        return self.tier_blocks * self.block_bytes

    def check_memory(self, *, cache_on_host: bool, available: int | None = None) -> None:
        """Raise :class:`InsufficientMemoryError` if host memory cannot hold this rig.

        The host holds the tier, the KV cache too when ``cache_on_host``, and one
        layer's random float32 values while the cache is filled. ``available``
        defaults to what the machine reports (skipped when it reports nothing).
        """
        layer = self.cache_bytes // self.num_layers
        need = self.tier_bytes + 2 * layer + (self.cache_bytes if cache_on_host else 0)
        have = available_memory_bytes() if available is None else available
        if have is not None and need > have:
            what = "the KV cache and the tier" if cache_on_host else "the tier"
            raise InsufficientMemoryError(
                f"{what} need {memory_size(need)} of host memory "
                f"({self.num_layers} layers x {self.block_bytes // self.num_layers // 1024} KiB "
                f"per block and layer), but only {memory_size(have)} is available"
            )


@dataclass
class Rig:
    """A KV cache and a host tier, with the handlers for stores and loads."""

    medium: str  # "host", or a device such as "cuda:0"
    description: str  # for people: "host memory <-> host tier"
    strategy: str  # the copy strategy its handlers use
    layout: KVLayout
    tier: HostTier
    handlers: list[TransferHandler[Any]]
    cache_blocks: Callable[[BlockIdsLike], CacheBlocks]  # host_cache_blocks, gpu_blocks, ...
    release: Callable[[], None] = field(default=lambda: None)

    @property
    def block_bytes(self) -> int:
        return self.layout.slot_bytes

    def store(self, cache_ids: BlockIdsLike, tier_ids: BlockIdsLike) -> TransferSpec:
        """A job copying KV-cache blocks into tier blocks."""
        return TransferSpec(self.cache_blocks(cache_ids), cpu_blocks(tier_ids))

    def load(self, tier_ids: BlockIdsLike, cache_ids: BlockIdsLike) -> TransferSpec:
        """A job copying tier blocks into KV-cache blocks."""
        return TransferSpec(cpu_blocks(tier_ids), self.cache_blocks(cache_ids))

    def mismatched(self, dst_ids: list[int], src_ids: list[int]) -> int:
        """How many KV-cache blocks ``dst_ids[i]`` differ in any byte from ``src_ids[i]``.

        Compares on the cache's own device, every region of group 0.
        """
        layout = self.layout
        if not dst_ids:
            return 0
        dst = torch.tensor(dst_ids, dtype=torch.long, device=layout.device)
        src = torch.tensor(src_ids, dtype=torch.long, device=layout.device)
        bad = torch.zeros(len(dst_ids), dtype=torch.bool, device=layout.device)
        for r in layout.groups[0]:
            base = byte_view(layout.tensors[r.tensor])
            rows = base.as_strided(
                (layout.num_blocks, r.size), (r.stride, 1), base.storage_offset() + r.offset
            )
            bad |= (rows.index_select(0, dst) != rows.index_select(0, src)).any(dim=1)
        return int(bad.sum())

    def close(self) -> None:
        """Release the tier (and device resources). Call after the engine closed."""
        self.tier.release()
        self.release()


def open_host_rig(shape: RigShape, *, workers: int = 2) -> Rig:
    """Random KV tensors in host memory, a poisoned host tier, the host handler.

    Raises :class:`InsufficientMemoryError` first if they cannot fit.
    """
    shape.check_memory(cache_on_host=True)
    _, layout = random_host_cache(
        num_layers=shape.num_layers,
        num_blocks=shape.num_blocks,
        block_tokens=shape.block_tokens,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        seed=shape.seed,
    )
    tier = poisoned_tier(layout, shape.tier_blocks)
    return Rig(
        medium="host",
        description=(
            f"host memory <-> host tier, {workers} copy thread{'' if workers == 1 else 's'}"
        ),
        strategy="host-copy",
        layout=layout,
        tier=tier,
        handlers=[HostCopyHandler(layout, tier, workers=workers)],
        cache_blocks=host_cache_blocks,
    )


def open_device_rig(
    runtime: DeviceRuntime,
    shape: RigShape,
    *,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
    strategy: CopyStrategy = CopyStrategy.AUTO,
    medium: str,
    release: Callable[[], None] = lambda: None,
) -> Rig:
    """Random KV tensors in device memory (from ``empty``), a pinned poisoned tier,
    and the device handler pair (store and load) of ``runtime``.

    ``release`` runs at :meth:`Rig.close`, after the tier is released (pass
    ``runtime.close`` to hand the runtime to the rig). Raises
    :class:`InsufficientMemoryError` first if the tier cannot fit in host memory;
    device memory is the device's to refuse.
    """
    shape.check_memory(cache_on_host=False)
    gen = torch.Generator().manual_seed(shape.seed)
    tensors = []
    for _ in range(shape.num_layers):
        block = (shape.num_blocks, 2, shape.block_tokens, shape.kv_heads, shape.head_dim)
        t = empty(block, torch.bfloat16)
        t.copy_(torch.randn(block, generator=gen).to(torch.bfloat16))
        tensors.append(t)
    layout = KVLayout.from_block_tensors(tensors)
    tier = pinned_host_tier(runtime, layout, shape.tier_blocks)
    try:
        tier.memory.fill_(0xA5)
        handlers = make_device_handlers(
            runtime, layout, tier, DeviceHandlerConfig(strategy=strategy)
        )
    except BaseException:
        tier.release()
        raise
    return Rig(
        medium=medium,
        description=f"{medium} memory <-> pinned host tier, {strategy.value} copies",
        strategy=strategy.value,
        layout=layout,
        tier=tier,
        handlers=list(handlers),
        cache_blocks=gpu_blocks if runtime.medium is Medium.GPU else npu_blocks,
        release=release,
    )
