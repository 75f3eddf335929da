"""One-off probe of the CUDA machine: versions, binding shapes, batched copy, Triton pointer loads.

python benchmarks/device/probe_cuda.py
"""

from __future__ import annotations

import inspect
import sys
import time

import torch

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
try:
    import cuda.bindings
    from cuda.bindings import driver as drv

    print("cuda.bindings", getattr(cuda.bindings, "__version__", "?"))
    fn = getattr(drv, "cuMemcpyBatchAsync", None)
    print("cuMemcpyBatchAsync in binding:", fn is not None)
    if fn is not None:
        print((fn.__doc__ or "")[:1500])
    err, ver = drv.cuDriverGetVersion()
    print("driver version", err, ver)
    for name in (b"cuMemcpyBatchAsync", b"cuMemcpyAsync"):
        for v in (13000, 12080):
            try:
                res = drv.cuGetProcAddress(
                    name,
                    v,
                    drv.CUflags.CU_GET_PROC_ADDRESS_DEFAULT if hasattr(drv, "CUflags") else 0,
                )
            except Exception as exc:  # noqa: BLE001
                res = f"error {exc!r}"
            print("cuGetProcAddress", name, v, res)
except Exception as exc:  # noqa: BLE001
    print("cuda.bindings unavailable:", repr(exc))

try:
    import triton
    import triton.language as tl

    print("triton", triton.__version__)

    @triton.jit
    def ptr_copy(src_tab, dst_tab, n_bytes, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.load(src_tab + i).to(tl.pointer_type(tl.int64))
        d = tl.load(dst_tab + i).to(tl.pointer_type(tl.int64))
        offs = j * BLOCK + tl.arange(0, BLOCK)
        m = offs < n_bytes // 8
        tl.store(d + offs, tl.load(s + offs, mask=m), mask=m)

    a = torch.randn(4, 4096, device="cuda")
    b = torch.zeros_like(a)
    st = torch.tensor([a[i].data_ptr() for i in range(4)], dtype=torch.int64, device="cuda")
    dt = torch.tensor([b[3 - i].data_ptr() for i in range(4)], dtype=torch.int64, device="cuda")
    ptr_copy[(4, 4)](st, dt, 16384, BLOCK=1024)
    torch.cuda.synchronize()
    print("triton pointer copy ok:", torch.equal(a, b.flip(0)))
    # mapped pinned host memory as a Triton target
    h = torch.empty(4, 4096, dtype=torch.float32)
    rc = torch.cuda.cudart().cudaHostRegister(h.data_ptr(), h.numel() * 4, 3)
    print("cudaHostRegister rc", rc)
    ht = torch.tensor([h[i].data_ptr() for i in range(4)], dtype=torch.int64, device="cuda")
    ptr_copy[(4, 4)](st, ht, 16384, BLOCK=1024)
    torch.cuda.synchronize()
    print("triton -> mapped host ok:", torch.equal(a.cpu(), h))
    print("cudaHostUnregister rc", torch.cuda.cudart().cudaHostUnregister(h.data_ptr()))
except Exception as exc:  # noqa: BLE001
    print("triton probe failed:", repr(exc))

# contiguous pinned ceiling
n = 1 << 30
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
for name, fn in (
    ("D2H", lambda: host.copy_(dev, non_blocking=True)),
    ("H2D", lambda: dev.copy_(host, non_blocking=True)),
):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    print(f"contiguous {name}: {5 * n / (time.perf_counter() - t) / 1e9:.1f} GB/s")
print("torch.cuda.Event blocking:", "blocking" in inspect.signature(torch.cuda.Event).parameters)
print("legacy default stream handle:", torch.cuda.default_stream().cuda_stream)
