"""vLLM's ``CanonicalKVCaches`` as an offload-engine :class:`~offload_engine.KVLayout`.

vLLM hands a worker its KV cache as unique tensors, each ``(num_blocks, ...)``
whose row ``b`` holds block ``b`` (a padded page of ``page_size_bytes``), and,
per KV group, references ``(tensor_idx, page_size_bytes)`` to the rows each
layer of the group uses (the un-padded page). That is one region per reference:
``Region(tensor_idx, 0, row_stride_bytes, page_size_bytes)``.

Duck-typed (``.tensors[i].tensor``, ``.tensors[i].page_size_bytes``,
``.group_data_refs[g][j].tensor_idx`` / ``.page_size_bytes``), so it needs no
vLLM import. Anything the engine cannot move raises :class:`LayoutError`
naming the tensor's shape, at registration.
"""

from __future__ import annotations

from typing import Any

from offload_engine import KVLayout, LayoutError, Region


def _tensor_row(i: int, entry: Any, num_blocks: int) -> tuple[int, int]:
    """``(block stride, padded page)`` in bytes of KV tensor ``i``, checked against
    ``num_blocks`` (tensor 0's block count; -1 for tensor 0 itself)."""
    t = entry.tensor
    what = f"KV tensor {i} (shape {tuple(t.shape)}, stride {t.stride()}, {t.dtype})"
    if t.dim() < 1:
        raise LayoutError(f"{what}: needs a leading num_blocks dimension")
    if num_blocks >= 0 and int(t.shape[0]) != num_blocks:
        raise LayoutError(
            f"{what}: has {int(t.shape[0])} blocks, tensor 0 has {num_blocks}; "
            "every KV tensor must hold the same number of blocks"
        )
    esz = t.element_size()
    inner = t[0] if t.dim() > 1 else t[:1]
    if t.dim() > 1 and not inner.is_contiguous():
        raise LayoutError(f"{what}: a block's bytes must be contiguous")
    width = inner.numel() * esz
    stride = t.stride(0) * esz
    page = int(entry.page_size_bytes)
    if page <= 0 or page > width:
        raise LayoutError(
            f"{what}: page_size_bytes={page} does not fit a block row of {width} bytes"
        )
    if stride < page:
        raise LayoutError(
            f"{what}: block stride {stride} bytes is smaller than its page "
            f"({page} bytes), so blocks overlap"
        )
    return stride, page


def _group_regions(
    g: int, refs: list[Any], tensors: list[Any], row_strides: list[int], row_bytes: list[int]
) -> list[Region]:
    """KV group ``g``'s layers as regions of the tensors they refer to."""
    if not refs:
        raise LayoutError(f"KV group {g} has no layers to offload")
    regions = []
    for ref in refs:
        idx = int(ref.tensor_idx)
        if not 0 <= idx < len(tensors):
            raise LayoutError(
                f"KV group {g}: a layer refers to tensor {idx}, but there are {len(tensors)}"
            )
        size = int(ref.page_size_bytes)
        if size <= 0 or size > row_bytes[idx]:
            t = tensors[idx]
            raise LayoutError(
                f"KV group {g}: a layer's page of {size} bytes does not fit tensor {idx} "
                f"(shape {tuple(t.shape)}, padded page {row_bytes[idx]} bytes)"
            )
        regions.append(Region(idx, 0, row_strides[idx], size))
    return regions


def layout_from_canonical(kv_caches: Any) -> KVLayout:
    """Map vLLM's ``CanonicalKVCaches`` to a :class:`KVLayout` (one group per KV group)."""
    entries = list(kv_caches.tensors)
    group_refs = [list(g) for g in kv_caches.group_data_refs]
    if not entries:
        raise LayoutError("vLLM registered no KV cache tensors")
    if not group_refs:
        raise LayoutError("vLLM registered no KV cache groups")

    tensors = [entry.tensor for entry in entries]
    num_blocks = -1
    row_strides: list[int] = []
    row_bytes: list[int] = []
    for i, entry in enumerate(entries):
        stride, page = _tensor_row(i, entry, num_blocks)
        if num_blocks < 0:
            num_blocks = int(entry.tensor.shape[0])
        row_strides.append(stride)
        row_bytes.append(page)
    groups = [
        _group_regions(g, refs, tensors, row_strides, row_bytes)
        for g, refs in enumerate(group_refs)
    ]
    return KVLayout(tensors, groups, num_blocks, name="vllm-canonical")
