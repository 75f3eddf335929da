"""GPU hooks of the demo and the benchmarks: NOT WIRED YET.

The CUDA device handler (``offload_engine.handlers.device``) is being written
on another branch. Until it lands, both functions below raise
:class:`~offload_engine.errors.RuntimeUnavailableError`, which the command
line turns into a one-line message (``--device cuda``) or a note and a host
run (``--device auto``). Nothing else in the CLI touches a GPU, so wiring the
device path means filling in these two functions:

* :func:`open_cuda_rig` returns a :class:`~offload_engine.bench.rigs.Rig`
  whose KV cache is on the GPU (``cache_blocks=gpu_blocks``), whose tier is
  pinned host memory, and whose handlers serve GPU->CPU and CPU->GPU. The demo
  and :func:`~offload_engine.bench.transfers.run_rig_cases` then work as they
  do on the host rig (the rig's integrity check compares on the device).
* :func:`run_cuda_cases` runs the GPU transfer cases, one rig per copy
  strategy in ``info.strategies``, and returns their points and latency
  series; the report and the figures take them as they take the host's.
"""

from __future__ import annotations

from collections.abc import Callable

from offload_engine.bench import BenchPlan, CaseResults
from offload_engine.bench.rigs import Rig, RigShape
from offload_engine.errors import RuntimeUnavailableError
from offload_engine.runtimes import RuntimeInfo

#: Flip to True once both functions below drive the device handler.
WIRED = False
NOT_WIRED = (
    "the CUDA device handler is not in this build yet (offload_engine.handlers.device), "
    "so the CLI cannot drive a GPU"
)


def open_cuda_rig(info: RuntimeInfo, shape: RigShape) -> Rig:
    """GPU KV cache <-> pinned host tier, through the CUDA device handler.

    ``info`` is the available CUDA runtime from ``probe_runtimes()``.
    """
    raise RuntimeUnavailableError(NOT_WIRED)


def run_cuda_cases(
    info: RuntimeInfo, plan: BenchPlan, *, tick: Callable[[str], None]
) -> CaseResults:
    """The GPU transfer cases, per strategy in ``info.strategies``."""
    raise RuntimeUnavailableError(NOT_WIRED)
