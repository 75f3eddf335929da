"""Device runtimes: which ones this machine can use, and why not.

A public module. The runtimes themselves live in :mod:`offload_engine.device.runtimes`
(``cuda``, ``npu``; the fakes are in :mod:`offload_engine.testing`); the classes load on
first use from the top-level package (``offload_engine.CudaRuntime``,
``offload_engine.NpuRuntime``). :func:`probe_runtimes` never raises and never
initialises a device it does not have.
"""

from offload_engine.device.runtimes.probe import (
    CUDA_DEFAULT_CONNECTIONS,
    RuntimeInfo,
    connections_note,
    probe_cpu,
    probe_cuda,
    probe_npu,
    probe_runtimes,
)

__all__ = [
    "CUDA_DEFAULT_CONNECTIONS",
    "RuntimeInfo",
    "connections_note",
    "probe_cpu",
    "probe_cuda",
    "probe_npu",
    "probe_runtimes",
]
