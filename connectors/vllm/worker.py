"""``EngineOffloadingWorker``: vLLM's ``OffloadingWorker`` interface over an :class:`EngineBridge`.

This module imports vLLM. It only translates: vLLM's load/store specs to block
ids, engine results to vLLM's ``TransferResult``. The bookkeeping lives in
:mod:`offload_engine.connectors.vllm.bridge`.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult

from .bridge import EngineBridge
from .layerwise import LayerwiseLoads


class EngineOffloadingWorker(OffloadingWorker):
    """Async KV transfers through offload-engine, for vLLM's OffloadingConnector.

    ``src_spec``/``dst_spec`` on the cache side are vLLM's ``GPULoadStoreSpec``
    (block ids, ``group_sizes``, ``block_indices``) whatever the device, and on
    the tier side a block-ids spec of chunk indices (``CPULoadStoreSpec``).
    """

    def __init__(self, bridge: EngineBridge) -> None:
        self.bridge = bridge
        self._layerwise: LayerwiseLoads | None = None
        self._record_load: Callable[[int, float], None] | None = None

    def serve_layerwise(
        self, loads: LayerwiseLoads, record_load: Callable[[int, float], None]
    ) -> None:
        """Under ``load_mode: layerwise``: ``loads`` submits the step's loads itself (vLLM
        never hands them to this worker), and :meth:`get_finished` reports their results
        through it, counting their bytes and seconds with ``record_load``."""
        self._layerwise = loads
        self._record_load = record_load

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self.bridge.submit_store(
            job_id,
            src_spec.block_ids,
            src_spec.group_sizes,
            src_spec.block_indices,
            dst_spec.block_ids,  # type: ignore[attr-defined]
        )

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # vLLM 0.33 marks loads it waits on within the step as expedited; the
        # engine runs a handler's jobs in submission order, so it queues like any
        # load (see offload_engine.connectors.vllm.compat).
        del expedited
        return self.bridge.submit_load(
            job_id,
            src_spec.block_ids,  # type: ignore[attr-defined]
            dst_spec.block_ids,
            dst_spec.group_sizes,
            dst_spec.block_indices,
        )

    def get_finished(self) -> list[VllmTransferResult]:
        layerwise = self._layerwise
        out = []
        for r in self.bridge.get_finished():
            if layerwise is not None and layerwise.owns(r.job_id):
                # vLLM sees the job finish either way (it releases the tier blocks); a
                # failed one's cache blocks go out as load errors, which vLLM recomputes.
                # Its bytes count as a load here: vLLM would count a job it did not
                # submit as a load as a store.
                layerwise.finished(r.job_id, r.success, r.error)
                if r.success and self._record_load is not None:
                    self._record_load(r.bytes_moved, r.seconds)
                out.append(
                    VllmTransferResult(
                        job_id=r.job_id, success=True, transfer_size=None, transfer_time=None
                    )
                )
                continue
            out.append(
                VllmTransferResult(
                    job_id=r.job_id,
                    success=r.success,
                    transfer_size=r.bytes_moved,
                    transfer_time=r.seconds,
                )
            )
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.bridge.wait(job_ids)

    def shutdown(self) -> None:
        self.bridge.shutdown()
