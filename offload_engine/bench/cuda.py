"""The GPU side of the demo and the benchmarks, on the CUDA runtime.

* :func:`open_rig` picks the demo's rig from a ``--device`` value: the host
  rig, or the GPU one where CUDA is usable.
* :func:`open_cuda_rig` is the demo's GPU path: a KV cache in GPU memory, a
  pinned host tier, and the device handler pair from
  :func:`~offload_engine.device.handler.make_device_handlers`, with the
  ``auto`` strategy.
* :func:`run_cuda_cases` is ``bench``'s GPU hook: the same sweep and latency
  runs as on the host, once per copy strategy the runtime offers
  (``dma``, ``staged``, ``kernel``). Cases in the style of
  ``benchmarks/device/bench_cuda.py`` (a contiguous-copy ceiling, transfers
  under a GEMM) can be added here; the report and the figures take any
  :class:`~offload_engine.bench.SweepPoint` and
  :class:`~offload_engine.bench.LatencySeries`.
* :func:`run_cuda_step` is ``bench``'s model-step pass: how much a decode-like
  step slows while each step stores and loads a few blocks
  (:mod:`offload_engine.bench.step`).
* :func:`run_cuda_ttft` is ``bench``'s time-to-first-token pass: a prefill on a
  prefix hit, loaded then computed, layer by layer, or recomputed
  (:mod:`offload_engine.bench.ttft`); with ``stores=True`` it is the store pass
  instead: the prefill's new blocks stored after the forward pass or layer by
  layer during it (:mod:`offload_engine.bench.ttft_stores`).

They raise :class:`~offload_engine.errors.RuntimeUnavailableError` when the
CUDA runtime cannot start, which the command line turns into a one-line
message (``--device cuda``) or a note and a host run (``--device auto``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from offload_engine.bench import BenchPlan, CaseResults
from offload_engine.bench.rigs import Device, Rig, RigShape, open_device_rig, open_host_rig
from offload_engine.bench.step import StepPlan, StepRow, run_step_pass
from offload_engine.bench.transfers import run_rig_cases
from offload_engine.bench.ttft import TtftDevice, TtftPlan, run_ttft_pass
from offload_engine.bench.ttft_stores import run_store_pass
from offload_engine.device import CopyStrategy
from offload_engine.device.runtimes import probe as runtimes
from offload_engine.device.runtimes.cuda import CudaRuntime
from offload_engine.device.runtimes.probe import RuntimeInfo
from offload_engine.errors import InsufficientMemoryError, RuntimeUnavailableError


def _rig(runtime: CudaRuntime, shape: RigShape, strategy: CopyStrategy, own: bool) -> Rig:
    device = runtime.device
    free, _ = torch.cuda.mem_get_info(device)
    if shape.cache_bytes > free:
        raise InsufficientMemoryError(
            f"the KV cache needs {shape.cache_bytes / 2**30:.1f} GiB of {device} memory, "
            f"but only {free / 2**30:.1f} GiB is free"
        )

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    return open_device_rig(
        runtime,
        shape,
        empty=empty,
        strategy=strategy,
        medium=str(device),
        release=runtime.close if own else lambda: None,
    )


def open_cuda_rig(info: RuntimeInfo, shape: RigShape) -> Rig:
    """GPU KV cache <-> pinned host tier on the current CUDA device (``auto`` strategy).

    ``info`` is the available CUDA runtime from ``probe_runtimes()``.
    """
    runtime = CudaRuntime()
    try:
        return _rig(runtime, shape, CopyStrategy.AUTO, own=True)
    except BaseException:
        runtime.close()
        raise


def run_cuda_cases(
    info: RuntimeInfo, plan: BenchPlan, shape: RigShape, *, tick: Callable[[str], None]
) -> CaseResults:
    """The sweep and latency runs on the GPU, once per strategy in ``info.strategies``."""
    runtime = CudaRuntime()
    out = CaseResults(sweep=[], latency=[])
    try:
        for name in info.strategies:
            rig = _rig(runtime, shape, CopyStrategy(name), own=False)
            try:
                found = run_rig_cases(rig, plan, tick=tick)
            finally:
                rig.close()
            out.sweep += found.sweep
            out.latency += found.latency
    finally:
        runtime.close()
    return out


def open_rig(device: Device, shape: RigShape, *, workers: int = 2) -> tuple[Rig, list[str]]:
    """The rig for ``device``, and notes on how it was chosen.

    ``"cpu"`` is the host rig. ``"cuda"`` is the CUDA rig or
    :class:`RuntimeUnavailableError` (no usable CUDA device here). ``"auto"``
    tries CUDA when a device is visible and falls back to the host rig, saying
    why in the notes.
    """
    if device == "cpu":
        return open_host_rig(shape, workers=workers), []
    cuda = runtimes.probe_cuda()
    if device == "cuda":
        if not cuda.available:
            raise RuntimeUnavailableError(f"CUDA is not available: {cuda.reason}")
        return open_cuda_rig(cuda, shape), []
    notes: list[str] = []
    if cuda.available:
        try:
            return open_cuda_rig(cuda, shape), []
        except RuntimeUnavailableError as exc:
            notes.append(f"CUDA is present but not used: {exc}; running on host memory")
    else:
        notes.append(f"no CUDA ({cuda.reason}); running on host memory")
    return open_host_rig(shape, workers=workers), notes


def run_cuda_step(plan: StepPlan, *, tick: Callable[[str], None]) -> list[StepRow]:
    """The model-step pass on the current CUDA device."""
    runtime = CudaRuntime()
    try:
        return run_step_pass(runtime, plan, tick=tick)
    finally:
        runtime.close()


def run_cuda_ttft(
    plan: TtftPlan, *, tick: Callable[[str], None], stores: bool = False, strategy: str = "auto"
) -> list[dict[str, Any]]:
    """The time-to-first-token pass (or, with ``stores``, the store pass) on the current
    CUDA device: one row per (H, N). ``strategy`` names the device handlers'
    :class:`~offload_engine.device.CopyStrategy` (``auto``: the parts stage).

    Raises :class:`InsufficientMemoryError` before allocating if the device's free
    memory cannot hold the plan's KV cache, reference copy, weights and activations.
    """
    runtime = CudaRuntime()
    try:
        free, _ = torch.cuda.mem_get_info(runtime.device)
        need = plan.device_bytes()
        if need > free:
            raise InsufficientMemoryError(
                f"the time-to-first-token pass needs about {need / 2**30:.1f} GiB of "
                f"{runtime.device} memory (hits up to {max(plan.hits)} tokens, "
                f"{max(plan.new)} new), but only {free / 2**30:.1f} GiB is free"
            )
        run = run_store_pass if stores else run_ttft_pass
        device = TtftDevice.cuda(runtime)
        if device.config is not None:
            config = replace(device.config, strategy=CopyStrategy(strategy))
            device = replace(device, config=config)
        return run(device, plan, tick=tick)
    finally:
        runtime.close()
