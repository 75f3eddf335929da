"""The scheduler side's per-request state for layer-wise loads: what
``EngineConnector``'s scheduler methods keep between vLLM's calls.

A layer-wise hit is loaded inside the forward pass of the step that schedules it,
which vLLM's offloading scheduler does not expect in two places.

**The hit's blocks at allocation** (:class:`LayerwiseScheduling.allocated`). vLLM
caches a synchronously loaded request's blocks as it allocates them, so the
scheduler's search for the load's first block (the first fresh, unhashed one past
the locally computed prefix) would find none. The connector remembers each hit's
local tokens from ``get_num_new_matched_tokens`` to ``update_state_after_alloc``
and shows the scheduler the blocks past them as fresh.

**The books of a load that ends inside its step** (:class:`InStepLoads`). vLLM's
offloading scheduler keeps, per request, the ids of its transfer jobs still pending
(``transfer_jobs``) and holds two rules over them: a load is issued only when
nothing else of the request is pending, and a store only when no load is
(``_build_store_jobs`` asserts it, and so does the flush of a preempted request).
It learns of a job's end only from the workers' report after a step. A layer-wise
load ends inside the forward pass of the step that schedules it, the step that also
computes the request's new tokens: when those fill a block, or the request goes on
through more prefill chunks before the report arrives (always, with async
scheduling), the scheduler builds a store beside a load it still counts as pending,
and the engine core dies on the assertion. The load is not pending for that rule:
the worker orders its copies before the model's next work on the stream
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

vLLM-free: it works on the scheduler's mappings and blocks as duck types; the
private names it reads are :mod:`.compat`'s (``scheduler_books``).
"""

from __future__ import annotations

import dataclasses
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


def replays_full_graph(mode: Any, decode_query_len: int, tokens: Iterable[int]) -> bool:
    """Whether vLLM may run a step as a full CUDA graph, whose replay calls no
    ``wait_for_layer_load``. ``mode`` is vLLM's resolved ``CUDAGraphMode``, ``tokens``
    the step's scheduled tokens per request. A mode with full graphs for mixed batches
    (``FULL``) may replay any step; one with full graphs for decode batches only
    (``FULL_AND_PIECEWISE``, vLLM's default, and ``FULL_DECODE_ONLY``) replays a step
    whose every request has ``decode_query_len`` tokens (1 + the speculative tokens),
    such as a hit followed by one new token among decodes. It errs one way only: a step
    larger than vLLM's largest captured graph runs without one, yet counts here."""
    full = type(mode).FULL
    if mode.mixed_mode() == full:
        return True
    counts = list(tokens)
    return mode.decode_mode() == full and bool(counts) and max(counts) <= decode_query_len


class _Fresh:
    """A cache block as the scheduler sees it before vLLM caches it: no hash yet."""

    __slots__ = ("block_hash", "block_id", "is_null")

    def __init__(self, block: Any) -> None:
        self.block_id = block.block_id
        self.is_null = block.is_null
        self.block_hash = None


def fresh_past(blocks: Any, local_tokens: int, group_configs: Iterable[Any]) -> Any:
    """vLLM's ``KVCacheBlocks`` ``blocks`` with every block of an offloaded group (its
    ``group_idx`` and ``tokens_per_block`` in ``group_configs``) past ``local_tokens``
    unhashed."""
    groups = list(blocks.blocks)
    for config in group_configs:
        first = local_tokens // config.tokens_per_block
        own = groups[config.group_idx]
        groups[config.group_idx] = [*own[:first], *(_Fresh(b) for b in own[first:])]
    return dataclasses.replace(blocks, blocks=tuple(groups))


class LayerwiseScheduling:
    """Everything the scheduler side keeps for layer-wise loads, per request: each
    hit's local tokens until its blocks are allocated, and the loads that end inside
    their step until the workers report them."""

    def __init__(self) -> None:
        # request id -> its locally computed tokens, from a layer-wise hit to its allocation
        self._local_tokens: dict[str, int] = {}
        self.in_step = InStepLoads()

    def hit(self, request_id: str, local_tokens: int) -> None:
        """A layer-wise hit past ``local_tokens`` computed tokens, to load in the step."""
        self._local_tokens[request_id] = local_tokens

    def allocated(
        self, request_id: str, blocks: Any, external_tokens: int, group_configs: Iterable[Any]
    ) -> Any:
        """The blocks for vLLM's ``update_state_after_alloc``: past a layer-wise hit's
        local tokens shown as fresh (see the module's docstring), else as they are."""
        local = self._local_tokens.pop(request_id, None)
        if local is None or not external_tokens:
            return blocks
        return fresh_past(blocks, local, group_configs)

    def finished(self, request_id: str) -> None:
        """The request is done; a hit of it that was never allocated is forgotten."""
        self._local_tokens.pop(request_id, None)

    @contextmanager
    def building(
        self,
        requests: MutableMapping[str, Any],
        jobs: Mapping[int, Any],
        loads: Iterable[tuple[int, str]],
    ) -> Iterator[None]:
        """Around vLLM's building of a step's metadata: this step's ``loads`` (``(job id,
        request id)``, each ending inside the step) and the earlier in-step loads are out
        of their requests' books (see :class:`InStepLoads`)."""
        self.in_step.scheduled(loads)
        with self.in_step.hidden(requests, jobs):
            yield

    def __repr__(self) -> str:
        return f"<LayerwiseScheduling hits={sorted(self._local_tokens)} {self.in_step!r}>"
