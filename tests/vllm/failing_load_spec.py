"""An EngineOffloadingSpec whose loads fail now and then, to drive vLLM's recovery.

Test-only: every ``FAIL_EVERY``-th load job the host handler runs raises on the
engine's worker thread, as a copy that fails would. Under ``load_mode:
layerwise`` the failed part's load reports its cache blocks through
``get_block_ids_with_load_errors``, and vLLM recomputes them (its default
``kv_load_failure_policy``), so the tokens must not change.
"""

from __future__ import annotations

import itertools
from typing import Any

from slow_store_spec import wrap_host_copies

from offload_engine.connectors.vllm.spec import EngineOffloadingSpec
from offload_engine.vocabulary import Direction

FAIL_EVERY = 3


class FailingLoadEngineOffloadingSpec(EngineOffloadingSpec):
    def get_worker(self, kv_caches: Any) -> Any:
        worker = super().get_worker(kv_caches)
        loads = itertools.count(1)

        def fail_some_loads(job: Any) -> None:
            if job.prepared.direction is Direction.LOAD and next(loads) % FAIL_EVERY == 0:
                raise OSError("injected load failure")

        wrap_host_copies(worker, fail_some_loads)
        return worker
