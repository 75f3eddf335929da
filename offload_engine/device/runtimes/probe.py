"""Device runtimes: the seam between a device handler and an accelerator.

A runtime gives streams, events, the current stream, pinned host memory, and
batched async copies. ``cuda`` (torch.cuda + the driver's batched copy),
``npu`` (torch_npu + CANN's batched copy) and ``fake`` (CPU-backed, for tests)
implement it; the device handler is written once against it.

:func:`probe_runtimes` reports which runtimes this machine can use, and why
not where it cannot. It never raises and never initialises a device it does
not have.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: CUDA's default number of hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS``)
CUDA_DEFAULT_CONNECTIONS = 8


@dataclass(frozen=True)
class RuntimeInfo:
    """What one runtime can do on this machine."""

    name: str  # "cuda", "npu" or "cpu"
    available: bool
    reason: str  # why it is unavailable, or what was found
    devices: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()  # copy strategies usable here
    notes: tuple[str, ...] = ()  # e.g. why a strategy is missing


def _importable(name: str) -> bool:
    """Whether module ``name`` can be found. ``find_spec`` of a dotted name imports
    its parent package, and raises when that is missing (``cuda`` without
    cuda-python) instead of answering None."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def connections_note(environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``CUDA_DEVICE_MAX_CONNECTIONS`` below CUDA's default slows transfers, or None.

    Streams beyond that many hardware queues share one, and work on a shared queue
    runs in the order it was launched whatever stream it is on: a load's DMAs then
    wait behind model kernels that are themselves waiting for SMs. Training stacks
    (Megatron-LM's sequence parallelism, NeMo) set it to 1, and a serving engine
    started in their environment inherits it. An unset or unparsable value (which
    CUDA ignores too) gives None.
    """
    value = (os.environ if environ is None else environ).get("CUDA_DEVICE_MAX_CONNECTIONS")
    try:
        connections = int(value) if value is not None else None
    except ValueError:
        return None
    if connections is None or not 0 < connections < CUDA_DEFAULT_CONNECTIONS:
        return None
    return (
        f"CUDA_DEVICE_MAX_CONNECTIONS={connections} (CUDA's default is "
        f"{CUDA_DEFAULT_CONNECTIONS}): the copy streams share hardware queues with compute "
        "streams, so transfers wait behind kernels; at 1, staged loads under a long GEMM ran at "
        "about half the default's rate on an H100 (docs/cuda.md)"
    )


def peers_note(count: int, can_access: Callable[[int, int], bool]) -> str | None:
    """Which devices each device reaches as a peer (``can_access(own, other)``: torch's
    ``torch.cuda.can_device_access_peer``), whose host links a device handler may
    borrow (``DeviceHandlerConfig.peers``); None with fewer than two devices or no
    peer access at all."""
    rows = []
    for own in range(count):
        peers = [d for d in range(count) if d != own and can_access(own, d)]
        if peers:
            rows.append(f"cuda:{own} -> " + ", ".join(f"cuda:{d}" for d in peers))
    if not rows:
        return None
    return (
        "peers whose host links a device handler may borrow (DeviceHandlerConfig.peers; "
        "rates not measured yet): " + "; ".join(rows)
    )


def probe_cuda() -> RuntimeInfo:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return RuntimeInfo("cuda", False, f"torch is not importable: {exc}")
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = "torch is a CPU-only build" if built is None else "no CUDA device is visible"
        return RuntimeInfo("cuda", False, why)
    devices = tuple(
        f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())
    )
    strategies = ["dma"]
    notes: list[str] = []
    if not _importable("cuda.bindings"):
        notes.append("cuda-python is not installed: dma copies one descriptor at a time")
    nvrtc = hasattr(torch.cuda, "_compile_kernel")  # the block copy's fast launch path
    if nvrtc or _importable("triton"):
        strategies += ["staged", "kernel"]
        if not nvrtc:
            notes.append("this torch cannot compile with NVRTC: block copies launch through Triton")
    else:
        strategies.append("staged")
        notes.append("neither NVRTC nor triton: staged gathers use torch ops; no kernel strategy")
    connections = connections_note()
    if connections is not None:
        notes.append(connections)
    peers = peers_note(torch.cuda.device_count(), torch.cuda.can_device_access_peer)
    if peers is not None:
        notes.append(peers)
    return RuntimeInfo(
        "cuda",
        True,
        f"torch {torch.__version__}, CUDA {torch.version.cuda}",
        devices,
        tuple(strategies),
        tuple(notes),
    )


def probe_npu() -> RuntimeInfo:
    """The NPU runtime's own guarded import
    (:func:`~offload_engine.device.runtimes.npu.load_torch_npu`) and library loader, so
    ``info`` says what constructing the runtime would say."""
    from offload_engine.device.runtimes import npu as npu_runtime
    from offload_engine.errors import RuntimeUnavailableError

    if not _importable("torch_npu"):
        return RuntimeInfo("npu", False, npu_runtime.TORCH_NPU_MISSING)

    try:
        npu = npu_runtime.load_torch_npu()
    except RuntimeUnavailableError as exc:
        return RuntimeInfo("npu", False, str(exc))
    if not npu.is_available():
        return RuntimeInfo("npu", False, "torch_npu imported, but no NPU is visible")
    devices = tuple(f"npu:{i}" for i in range(npu.device_count()))
    try:
        acl = npu_runtime.load_ascendcl()
    except RuntimeUnavailableError as exc:
        return RuntimeInfo("npu", False, str(exc), devices)
    if not hasattr(acl, "aclrtHostRegisterV2"):
        return RuntimeInfo(
            "npu",
            False,
            "libascendcl has no aclrtHostRegisterV2 (CANN 8.5 or later is needed to pin the "
            "host tier)",
            devices,
        )
    notes: list[str] = []
    if not hasattr(acl, "aclrtMemcpyBatchAsync"):
        notes.append("libascendcl has no aclrtMemcpyBatchAsync: dma copies one at a time")
    notes.append("no Triton on Ascend: staged gathers use torch ops; no kernel strategy")
    return RuntimeInfo("npu", True, "torch_npu with CANN", devices, ("dma", "staged"), tuple(notes))


def probe_cpu() -> RuntimeInfo:
    return RuntimeInfo(
        "cpu", True, "host memory copies on worker threads", ("cpu",), ("host-copy",)
    )


def probe_runtimes() -> list[RuntimeInfo]:
    """Every runtime, in order of preference (CUDA, NPU, CPU)."""
    return [probe_cuda(), probe_npu(), probe_cpu()]
