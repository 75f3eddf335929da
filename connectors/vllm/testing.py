"""Test helpers for the vLLM adapter that need no vLLM.

:func:`fake_canonical_kv_caches` builds an object shaped like vLLM's
``CanonicalKVCaches`` (same attribute names), laid out the way vLLM lays out
a KV cache: every tensor a ``(num_blocks, padded_page)`` int8 view carved out
of one shared buffer, each KV group referring to some of them with its
un-padded page size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class FakeCanonicalKVCacheTensor:
    tensor: torch.Tensor
    page_size_bytes: int


@dataclass
class FakeCanonicalKVCacheRef:
    tensor_idx: int
    page_size_bytes: int
    mapping: object | None = None


@dataclass
class FakeCanonicalKVCaches:
    tensors: list[FakeCanonicalKVCacheTensor]
    group_data_refs: list[list[FakeCanonicalKVCacheRef]]
    buffer: torch.Tensor = field(repr=False, default_factory=lambda: torch.empty(0))


def fake_canonical_kv_caches(
    *,
    num_blocks: int = 16,
    padded_pages: Sequence[int] = (256, 256, 192),
    groups: Sequence[Sequence[tuple[int, int]]] = (((0, 240), (1, 240)), ((2, 160),)),
    seed: int = 0,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> FakeCanonicalKVCaches:
    """Random KV caches: tensor ``t`` is ``(num_blocks, padded_pages[t])``; group ``g``
    holds ``(tensor_idx, unpadded_page_bytes)`` refs ``groups[g]``. ``empty``
    allocates the shared buffer (a fake device runtime's memory, say)."""
    total = num_blocks * sum(padded_pages)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, (total,), generator=gen, dtype=torch.int16).to(torch.int8)
    buffer = values if empty is None else empty((total,), torch.int8).copy_(values)
    tensors = []
    offset = 0
    for page in padded_pages:
        view = buffer[offset : offset + num_blocks * page].view(num_blocks, page)
        tensors.append(FakeCanonicalKVCacheTensor(view, page))
        offset += num_blocks * page
    refs = [[FakeCanonicalKVCacheRef(t, size) for t, size in g] for g in groups]
    return FakeCanonicalKVCaches(tensors, refs, buffer)


def page_bytes(kv: FakeCanonicalKVCaches, group: int, block: int) -> bytes:
    """The un-padded bytes of ``block`` for every layer of ``group``, in ref order."""
    parts = []
    for ref in kv.group_data_refs[group]:
        row = kv.tensors[ref.tensor_idx].tensor[block]
        parts.append(row[: ref.page_size_bytes].numpy().tobytes())
    return b"".join(parts)
