"""An EngineOffloadingSpec whose stores take a while, to drive vLLM's flush path.

On this CPU machine a store of a few blocks finishes within the step that
submitted it, so vLLM never finds a store still pending when it preempts a
request or reuses a block, and never calls the worker's ``wait``. Real
accelerators do. This spec (test-only) delays every store on the engine's
worker thread by ``STORE_DELAY_S``, as a slow link would (0.1 s was not always enough
on a loaded 2-core machine, where one step can outlast it); nothing waits on
the delay in the test itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from offload_engine.connectors.vllm.spec import EngineOffloadingSpec
from offload_engine.host.handler import HostCopyHandler
from offload_engine.vocabulary import Direction

STORE_DELAY_S = 0.25


def wrap_host_copies(worker: Any, before: Callable[[Any], None]) -> None:
    """Make the worker's host handler call ``before(job)`` on its copy thread ahead of
    each job's copy (once per handler, however often vLLM asks for the worker)."""
    for handler in worker.bridge.engine.manager.handlers:
        if isinstance(handler, HostCopyHandler) and not hasattr(handler, "_wrapped"):
            copy = handler.execute

            def execute(job: Any, copy: Any = copy) -> int:
                before(job)
                return int(copy(job))

            handler.execute = execute  # type: ignore[method-assign]
            handler._wrapped = True  # type: ignore[attr-defined]


def _slow_store(job: Any) -> None:
    if job.prepared.direction is Direction.STORE:
        time.sleep(STORE_DELAY_S)


class SlowStoreEngineOffloadingSpec(EngineOffloadingSpec):
    def get_worker(self, kv_caches: Any) -> Any:
        worker = super().get_worker(kv_caches)
        wrap_host_copies(worker, _slow_store)
        return worker
