"""Layer-wise loads and stores for vLLM, vLLM-free: which layers each part moves, the
waits, and when each part of a store goes out.

A step's loads go to the engine as one job per *part*: the KV tensors of a run of
``layers_per_load`` layers, in the order the forward pass reads them. Each part
carries a :class:`~offload_engine.JobFence`. vLLM calls
``wait_for_layer_load(layer)`` before each attention layer;
:meth:`LayerwiseLoads.wait_for_layer` then makes the model's stream wait for that
layer's part (on a GPU or NPU; on the host it waits for the copy) and returns.

Nothing the model reads is left unaccounted for: a part that fails before its
copies are enqueued raises from its wait, and one that fails on the device comes
back failed in its result; either way the load's cache blocks are reported
through :meth:`LayerwiseLoads.take_invalid` (vLLM's
``get_block_ids_with_load_errors``), so vLLM recomputes them or fails the request.
A layer this module cannot place in a part waits for every part.

A step's stores (:class:`LayerwiseStores`) go in the same parts, each handed to the
engine once the forward pass has computed every layer of it: vLLM calls
``save_kv_layer(layer)`` after each attention layer, and the part whose last layer
that was is submitted on the caller's current stream, so its copies are ordered
after that layer's compute (the engine records its ready event there at submit).
Each store reports as one result under vLLM's job id once all its parts are done.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offload_engine import Direction, JobFence, KVLayout, OffloadError

from .bridge import EngineBridge, IdsLike
from .timings import StepClock

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class TransferJob:
    """One of vLLM's transfer jobs as the layer-wise paths take it: its blocks in the
    KV cache (block ids, with vLLM's block count per KV group and each group's first
    block index) and its chunks in the tier. A load moves the tier's chunks into the
    cache blocks, a store the other way."""

    job_id: int
    cache_ids: IdsLike
    group_sizes: Sequence[int]
    block_indices: Sequence[int]
    tier_ids: IdsLike


def forward_order(layer_names: Iterable[str]) -> list[str]:
    """Layer names in the order a forward pass reaches them: by the first ``.N.`` index
    in the name (``model.layers.3.self_attn.attn``), names without one last, ties
    (several caches of one layer) in the given order."""
    names = list(layer_names)

    def key(item: tuple[int, str]) -> tuple[int, int]:
        position, name = item
        match = _LAYER_INDEX.search(name)
        return (int(match.group(1)) if match else 1 << 30, position)

    return [name for _, name in sorted(enumerate(names), key=key)]


def tensor_of(layout: KVLayout, address: int) -> int | None:
    """The index of the layout tensor whose bytes hold ``address``, if exactly one does."""
    found = [
        i
        for i, t in enumerate(layout.tensors)
        if t.data_ptr() <= address < t.data_ptr() + int(t.shape[0]) * t.stride(0) * t.element_size()
    ]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class LayerPlan:
    """Which part loads each layer, and the KV tensors of each part (None: all)."""

    part_of: Mapping[str, int]
    tensor_sets: tuple[tuple[int, ...] | None, ...]

    @classmethod
    def build(
        cls, layout: KVLayout, layer_addresses: Mapping[str, int], layers_per_load: int
    ) -> LayerPlan:
        """Parts of ``layers_per_load`` layers each, in forward order. ``layer_addresses``:
        each layer's KV tensor address as vLLM registered it. Where the layers share one
        tensor (the cross-layer layout) or one is not found, there is one part: the
        whole load, complete before the first layer reads."""
        order = forward_order(layer_addresses)
        tensors = {name: tensor_of(layout, layer_addresses[name]) for name in order}
        distinct = list(dict.fromkeys(t for t in tensors.values() if t is not None))
        if None in tensors.values() or len(distinct) < 2:
            return cls({name: 0 for name in order}, (None,))
        sets: list[tuple[int, ...]] = []
        part_of_tensor: dict[int, int] = {}
        for i in range(0, len(distinct), layers_per_load):
            chunk = distinct[i : i + layers_per_load]
            for t in chunk:
                part_of_tensor[t] = len(sets)
            sets.append(tuple(sorted(chunk)))
        part_of = {name: part_of_tensor[t] for name, t in tensors.items() if t is not None}
        return cls(part_of, tuple(sets))

    @property
    def parts(self) -> int:
        return len(self.tensor_sets)


@dataclass
class _Step:
    """One step's layer-wise loads: per part, (load id, fence); which parts were waited."""

    fences: list[list[tuple[int, JobFence]]]
    started_at: float  # time.perf_counter() at the submit
    waited: int = 0  # parts 0 .. waited-1 have been waited on
    blocked: float = 0.0  # seconds the waits held vLLM's thread


class LayerwiseLoads:
    """A worker's layer-wise loads over its :class:`EngineBridge`."""

    def __init__(
        self, bridge: EngineBridge, plan: LayerPlan, *, timeout: float | None = None
    ) -> None:
        self.bridge = bridge
        self.plan = plan
        self.timeout = timeout
        self._step: _Step | None = None
        self._blocks: dict[int, list[int]] = {}  # load id -> its cache blocks, until its result
        self._invalid: set[int] = set()
        # loads whose blocks were reported already (a failed part's wait and, later, the
        # load's result must not report them twice: by then the blocks may be another's)
        self._reported: set[int] = set()
        self.clock = StepClock()
        bridge.timings["layerwise_loads"] = self.clock.summary

    def start(self, loads: Iterable[TransferJob]) -> None:
        """Submit the step's loads (tier -> cache), part by part in layer order across
        all of them."""
        self.finish_step()
        loads = list(loads)
        step = _Step([[] for _ in range(self.plan.parts)], time.perf_counter())
        for job in loads:
            self._blocks[job.job_id] = [int(b) for b in job.cache_ids]
            fences = self.bridge.submit_load_layers(
                job.job_id,
                job.tier_ids,
                job.cache_ids,
                job.group_sizes,
                job.block_indices,
                self.plan.tensor_sets,
            )
            for part, fence in enumerate(fences):
                step.fences[part].append((job.job_id, fence))
        self._step = step if loads else None

    def wait_for_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: its part (and any earlier one not yet
        waited on) is ordered before the model's next work on its stream."""
        step = self._step
        if step is None:
            return
        part = self.plan.part_of.get(layer_name, self.plan.parts - 1)
        if step.waited > part:
            return
        t0 = time.perf_counter()
        while step.waited <= part:
            for job_id, fence in step.fences[step.waited]:
                try:
                    fence.wait_on_stream(self.timeout)
                except OffloadError as exc:
                    self._fail(job_id, self._blocks.get(job_id, []), exc)
            step.waited += 1
        step.blocked += time.perf_counter() - t0

    def wait_all(self) -> None:
        """Every part of the step ordered before the model's next work on its stream."""
        self.wait_for_layer("")  # an unknown name waits for the last part

    def finish_step(self) -> None:
        """The forward pass is over: order whatever part no layer waited on before the
        stream's next work (a model whose layers skip the wait still reads whole loads)."""
        step = self._step
        if step is not None:
            self.wait_all()
            self._step = None
            self.clock.step(time.perf_counter() - step.started_at, step.blocked, self.plan.parts)

    def owns(self, job_id: int) -> bool:
        return job_id in self._blocks

    def finished(self, job_id: int, success: bool, error: BaseException | None) -> None:
        """A layer-wise load's result: a failed one's blocks are reported invalid."""
        blocks = self._blocks.pop(job_id, [])
        if not success:
            self._fail(job_id, blocks, error)
        self._reported.discard(job_id)

    def take_invalid(self) -> set[int]:
        """Cache blocks whose loads failed since the last call (for vLLM to recompute)."""
        out, self._invalid = self._invalid, set()
        return out

    def _fail(self, job_id: int, blocks: list[int], error: Any) -> None:
        if not blocks or job_id in self._reported:
            return
        self._reported.add(job_id)
        logger.error(
            "offload-engine layer-wise load %d failed (%d cache blocks reported for "
            "recomputation): %s: %s",
            job_id,
            len(blocks),
            type(error).__name__,
            error,
        )
        self._invalid.update(blocks)


class LayerwiseStores:
    """A worker's layer-wise stores over its :class:`EngineBridge`: per step, the
    stores of the blocks this step's forward pass computes, part by part."""

    def __init__(self, bridge: EngineBridge, plan: LayerPlan) -> None:
        self.bridge = bridge
        self.plan = plan
        # each part's layers: a part goes out once every one of them was saved
        self._layers: list[set[str]] = [set() for _ in range(plan.parts)]
        for name, part in plan.part_of.items():
            self._layers[part].add(name)
        # this step's job ids, from start to finish_step (the bridge holds their blocks)
        self._jobs: list[int] | None = None
        self._saved: list[set[str]] = []
        self._sent: list[bool] = []
        # parts submitted once their layers were saved, and by finish_step (in the
        # bridge's stats, so a run shows which path its stores took)
        bridge.counters.update(store_parts_at_layer=0, store_parts_at_step_end=0)

    @property
    def open(self) -> bool:
        """Whether a step's stores are started and not finished yet."""
        return self._jobs is not None

    def start(self, jobs: Iterable[TransferJob]) -> None:
        """This step's stores: each announced to the bridge, with its blocks, as one job
        of ``plan.parts`` parts; nothing is submitted until its layers are computed. A
        store whose blocks the bridge refuses is logged there and ends as one failed
        result once its parts are handed in."""
        self.finish_step()
        self._jobs = []
        self._saved = [set() for _ in range(self.plan.parts)]
        self._sent = [False] * self.plan.parts
        for job in jobs:
            self.bridge.open_parts(
                job.job_id,
                Direction.STORE,
                self.plan.parts,
                cache_ids=job.cache_ids,
                group_sizes=job.group_sizes,
                block_indices=job.block_indices,
                tier_ids=job.tier_ids,
            )
            self._jobs.append(job.job_id)

    def saved(self, layer_name: str) -> None:
        """``layer_name`` is computed (its KV written): submit its part if that was the
        part's last layer to be computed. A name not in the plan waits for
        :meth:`finish_step`."""
        if not self._jobs:  # no step open, or a step with nothing to store
            return
        part = self.plan.part_of.get(layer_name)
        if part is None or self._sent[part]:
            return
        saved = self._saved[part]
        saved.add(layer_name)
        if len(saved) == len(self._layers[part]):
            self._submit(part, "store_parts_at_layer")

    def finish_step(self) -> None:
        """The forward pass is over: submit every part no layer completed (a model
        whose layers skip ``save_kv_layer`` still stores everything)."""
        if self._jobs is None:
            return
        for part in range(self.plan.parts):
            if not self._sent[part]:
                self._submit(part, "store_parts_at_step_end")
        self._jobs = None

    def _submit(self, part: int, counter: str) -> None:
        self._sent[part] = True
        jobs = self._jobs or []
        self.bridge.counters[counter] += len(jobs)
        tensors = self.plan.tensor_sets[part]
        for job_id in jobs:
            # a refusal is logged by the bridge and fails the job's result
            self.bridge.submit_part(job_id, tensors)
