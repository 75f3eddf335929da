"""The scheduler's books for loads that end inside the step that schedules them.

vLLM's offloading scheduler keeps, per request, the ids of its transfer jobs still
pending (``transfer_jobs``) and holds two rules over them: a load is issued only
when nothing else of the request is pending, and a store only when no load is
(``_build_store_jobs`` asserts it, and so does the flush of a preempted request).
It learns of a job's end only from the workers' report after a step.

A layer-wise load ends inside the forward pass of the step that schedules it, the
step that also computes the request's new tokens: when those fill a block, or the
request goes on through more prefill chunks before the report arrives (always, with
async scheduling), the scheduler builds a store beside a load it still counts as
pending, and the engine core dies on the assertion. The load is not pending for
that rule: the worker orders its copies before the model's next work on the stream
(``wait_for_layer_load``, and every part at ``wait_for_save``), and every store of
the request is submitted after them on that stream.

:class:`InStepLoads` squares the books: while the scheduler builds a step's
metadata, the in-step loads are out of their requests' ``transfer_jobs``; right
after, they are back, so that everything else keeps vLLM's meaning until the
workers report them: the tier keeps the load's chunks pinned (``complete_load`` runs
at the report), a request with such a load waits before another lookup, and the
report removes the job as vLLM's own code does. A request that finished while its
load was out (vLLM drops a finished request's state once nothing of it is pending)
gets its state back until the report.

vLLM-free: it works on the scheduler's mappings, which :mod:`.compat` reaches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any


class InStepLoads:
    """Load job ids that end inside their step, from their scheduling to the report."""

    def __init__(self) -> None:
        # load job id -> its request id, until the workers' report removes the job
        self._pending: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __repr__(self) -> str:
        return f"<InStepLoads pending={sorted(self._pending)}>"

    def scheduled(self, loads: Iterable[tuple[int, str]]) -> None:
        """This step's loads, as ``(job id, request id)``: each ends inside the step."""
        self._pending.update(loads)

    def settle(self, jobs: Mapping[int, Any]) -> None:
        """Forget the loads the scheduler no longer tracks (reported, or reset)."""
        for job_id in [j for j in self._pending if j not in jobs]:
            del self._pending[job_id]

    @contextmanager
    def hidden(self, requests: MutableMapping[str, Any], jobs: Mapping[int, Any]) -> Iterator[None]:
        """Within the block, the pending in-step loads are out of their requests'
        ``transfer_jobs``; after it (also when it raises), each load the scheduler
        still tracks is back, in its request's state, restored if it was dropped."""
        self.settle(jobs)
        out: list[tuple[int, str, Any]] = []
        for job_id, req_id in self._pending.items():
            state = requests.get(req_id)
            if state is not None and job_id in state.transfer_jobs:
                state.transfer_jobs.discard(job_id)
                out.append((job_id, req_id, state))
        try:
            yield
        finally:
            for job_id, req_id, state in out:
                if job_id not in jobs:
                    continue
                requests.setdefault(req_id, state).transfer_jobs.add(job_id)
