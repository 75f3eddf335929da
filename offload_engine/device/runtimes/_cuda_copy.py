"""The device-side block copy as a CUDA C kernel, launched straight through the driver.

Same work as the Triton kernel (:mod:`offload_engine.device.runtimes._triton_copy`): one
CTA copies one 8 KiB tile of one region of one block, ``grid = (blocks,
regions, tiles)``, addresses from the int64 region tables plus the job's block
ids, 8-byte words (the runtime checks alignment).

Why a second kernel: a Triton launch costs 100-200 us of Python on an H100 host
(argument binding and specialisation, launcher hooks),
more than all the rest of a small job's launch together. This kernel is compiled
once with NVRTC (through torch's ``torch.cuda._compile_kernel``) and launched
with one ``cuLaunchKernel`` call made through ``ctypes`` while holding the GIL:
a few microseconds. Where NVRTC or that torch helper is missing, the runtime
keeps the Triton kernel.

Holding the GIL through the launch is safe because the launch returns at once:
a launch blocks only when its stream's queue is full (about a thousand
entries), and a device handler keeps far fewer on each stream (``max_inflight``
jobs of a few entries per staged piece).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from offload_engine.device.runtimes.base import BlockCopy
from offload_engine.vocabulary import Direction

TILE = 8192  # bytes per CTA
THREADS = 256

SOURCE = r"""
extern "C" __global__ void offload_engine_block_copy(
    const long long* __restrict__ region_base,
    const long long* __restrict__ region_stride,
    const long long* __restrict__ region_size,
    const long long* __restrict__ slot_offset,
    const long long* __restrict__ cache_ids,
    const long long* __restrict__ slot_ids,
    long long slot_base,
    long long slot_bytes,
    int to_slots)
{
    const long long i = blockIdx.x;
    const int r = blockIdx.y;
    const long long size = region_size[r];
    const long long start = (long long)blockIdx.z * 8192;
    if (start >= size) return;
    const long long cid = cache_ids[i];
    const long long sid = slot_ids ? slot_ids[i] : i;
    long long* cache = (long long*)(region_base[r] + cid * region_stride[r] + start);
    long long* slot = (long long*)(slot_base + sid * slot_bytes + slot_offset[r] + start);
    const long long* src = to_slots ? cache : slot;
    long long* dst = to_slots ? slot : cache;
    const long long end = size - start;
    const long long words = (end < 8192 ? end : 8192) / 8;
    for (long long w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
}
"""

_P = ctypes.c_void_p
_U = ctypes.c_uint
_MAX_GRID_YZ = 65535


class DriverBlockCopy:
    """The compiled kernel and a ``cuLaunchKernel`` entry point that keeps the GIL."""

    def __init__(self) -> None:
        import torch.cuda

        compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
        if compile_kernel is None:
            raise RuntimeError("this torch has no torch.cuda._compile_kernel (NVRTC)")
        self._kernel = compile_kernel(SOURCE, "offload_engine_block_copy")
        self._func = self._kernel.func
        launch = ctypes.PyDLL("libcuda.so.1").cuLaunchKernel
        launch.argtypes = (_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P)
        launch.restype = ctypes.c_int
        self._launch = launch
        self._local = threading.local()

    def _params(self) -> tuple[list[Any], Any]:
        # per thread: the store and load handlers' launchers call at once
        found = getattr(self._local, "params", None)
        if found is None:
            values: list[Any] = [ctypes.c_int64() for _ in range(8)] + [ctypes.c_int()]
            array = (_P * len(values))(*(ctypes.addressof(v) for v in values))
            found = self._local.params = (values, array)
        return found  # type: ignore[no-any-return]

    @property
    def launch_address(self) -> int:
        """The address of the ``cuLaunchKernel`` entry point this launcher calls."""
        return int(ctypes.cast(self._launch, ctypes.c_void_p).value or 0)

    def launch_args(self, copy: BlockCopy) -> tuple[int, tuple[int, ...], list[int]] | None:
        """``(function, (grid x, y, z, block x, y, z, shared bytes), parameter values)``
        of ``copy``'s launch, or None for a copy of no blocks (nothing to launch)."""
        if copy.count == 0:
            return None
        regions = int(copy.region_size.shape[0])
        tiles = -(-copy.max_region_size // TILE)
        if regions > _MAX_GRID_YZ or tiles > _MAX_GRID_YZ:
            raise ValueError(f"{regions} regions of up to {copy.max_region_size} bytes is too many")
        # the staged planner sets parameters 4 and 6 (_native.LAUNCH_IDS, LAUNCH_SLOT_BASE)
        values = [
            copy.region_base.data_ptr(),
            copy.region_stride.data_ptr(),
            copy.region_size.data_ptr(),
            copy.slot_offset.data_ptr(),
            copy.cache_ids.data_ptr(),
            0 if copy.slot_ids is None else copy.slot_ids.data_ptr(),
            copy.slot_base,
            copy.slot_bytes,
            1 if copy.direction is Direction.STORE else 0,
        ]
        func = self._func
        handle = int(getattr(func, "value", func) or 0)
        return handle, (copy.count, regions, tiles, THREADS, 1, 1, 0), values

    def __call__(self, copy: BlockCopy, stream: int) -> int:
        """Enqueue ``copy`` on the raw stream handle ``stream``; the driver's result."""
        args = self.launch_args(copy)
        if args is None:
            return 0
        _, shape, values = args
        params, array = self._params()
        for param, value in zip(params, values, strict=True):
            param.value = value
        rc: int = self._launch(self._func, *shape, stream, array, None)
        return rc
