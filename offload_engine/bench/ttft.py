"""Time to first token on a prefix hit: load then compute, layer by layer, or recompute.

A request's prompt is ``H + N`` tokens; its first ``H`` (the hit) sit in the
engine's pinned host tier, and a prefill computes the ``N`` new ones. Per
``(H, N)`` cell this pass measures, each the median of ``reps`` rounds
(variants interleaved within a round, after one untimed round):

* **a**, load then compute: one whole-block load job of the hit through the
  engine (its handlers' default config, the ``auto`` strategy), a host wait for
  its result, then the forward pass of the ``N`` new tokens;
* **b**, layer by layer, once per ``G`` in ``layers_per_load``: one engine job
  per part of ``G`` consecutive layers (``TransferSpec(..., tensors=<the part's
  KV tensors>, fence=JobFence())``), all submitted up front; before a part's
  first layer the forward pass calls ``fence.wait_on_stream()``, which makes the
  compute stream wait for that part's copies without a host wait;
* **p**, per ``G``, the parts of b with no compute (the compute stream waits on
  every fence, then the host on the stream): the layer-wise load's own pace,
  reported as ``layerwise_load_ms``;
* **f**, per ``G``, the floor of b: the same forward pass, its layers waiting on
  one contiguous copy per part of the same bytes (the hit's tier slots, which
  are consecutive, into a device buffer of their size) on a stream of their own,
  through the runtime's batched copy, no engine: what any layer-wise load of
  this hit would take if each part moved at the link's rate and cost no device
  work (the engine's parts are a slice of every slot, and land in the cache's
  randomly placed blocks by a scatter kernel); reported as ``floor_ms``;
* **s**, per ``G``, the floor of a staged load: f's copies, each followed on
  the same stream by a scatter of the part's bytes into the hit's cache blocks
  of the part's layers (``index_copy_``, one per layer), the layers waiting on
  the scatters: the device work any load that stages into contiguous memory and
  then places the blocks does, without the engine (the bytes are f's, so only
  their amount and placement are the layers'); reported as
  ``staged_floor_ms``;
* **c**, recompute: the whole prompt (``H + N`` tokens) through the model, no load;
* **L**, the load alone (as in a, without compute), and **C**, the compute
  alone with the hit's KV already in place.

A load variant's clock starts with the hit in the tier and the hit's cache
blocks poisoned, after the device is synchronized, and stops when the last
layer's compute has finished (the device synchronized again). Reported per
cell: ``b / max(L, C)`` (the aim is at most 1.10), ``b / a``, and the ideal
``max(L, C) / (L + C)`` that ``b / a`` approaches.

Before ``b`` is timed at a hit size, a layer-wise load per ``G`` runs untimed
and the hit's cache bytes are compared with a copy of them taken before they
were stored (on the device, bit for bit); a mismatch is an error in the row
(``errors``), never a silent pass.

**The model** (:class:`PrefillModel`) has Llama-3-8B shapes by default
(:class:`TtftShape`): per layer an RMS norm, the QKV projection of the new
tokens, their K and V written into their cache blocks, the K and V of all the
request's blocks gathered from the paged cache tensor (``index_select`` on the
block ids), attention of the new tokens' queries over them
(``scaled_dot_product_attention``, grouped-query, causal aligned to the last
key), the output projection, an RMS norm and a SwiGLU MLP. No rotary embedding,
no embedding or head. One layer's random weights serve every layer (the same
FLOPs and weight bytes per layer, a fraction of the memory). The KV cache is one
``(num_blocks, 2, block_tokens, kv_heads, head_dim)`` tensor per layer
(:meth:`KVLayout.flashinfer`: one 64 KiB region per layer and block at the
default shape, a 2 MiB tier block holding all layers); the request's block
table is a fixed random permutation of the cache's blocks.

**The device** is injectable (:class:`TtftDevice`): the runtime, how device
tensors are allocated, how work is put on the runtime's current stream, and how
the host waits for it. :meth:`TtftDevice.cuda` is the real one; on
``offload_engine.testing.FakeRuntime`` (streams are threads) compute is
enqueued on the fake's compute stream and the host waits on an event recorded
there, so the whole pass runs without CUDA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

from offload_engine import (
    JobFence,
    KVLayout,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.bench import first_failure
from offload_engine.device import DeviceHandlerConfig, make_device_handlers, pinned_host_tier
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.errors import ConfigError
from offload_engine.vocabulary import Direction, TransferResult

#: the timed variants of a cell besides ``b`` (one ``b`` per G), in the order a round runs them
LOAD, COMPUTE, LOAD_THEN_COMPUTE, RECOMPUTE = "L", "C", "a", "c"
POISON = -3.0  # what a hit's cache blocks hold before a load variant


@dataclass(frozen=True)
class TtftShape:
    """The model and KV-cache shape (Llama-3-8B by default)."""

    layers: int = 32
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_tokens: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def block_bytes(self) -> int:
        """Bytes of one cache block over all layers (one tier block)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * 2 * self.block_tokens * self.kv_heads * self.head_dim * item

    @property
    def weight_elements(self) -> int:
        """Elements of one layer's weights."""
        s = self
        qkv = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim
        return qkv + s.heads * s.head_dim * s.hidden + 3 * s.hidden * s.intermediate


@dataclass(frozen=True)
class TtftPlan:
    """What :func:`run_ttft_pass` measures."""

    shape: TtftShape = TtftShape()
    hits: tuple[int, ...] = (2048, 8192, 32768)  # H, tokens of the prefix hit
    new: tuple[int, ...] = (128, 512, 2048)  # N, tokens computed
    layers_per_load: tuple[int, ...] = (1, 4)  # G, layers per layer-wise job
    reps: int = 3
    fence_timeout: float = 120.0  # seconds a layer may wait for its job's launch

    def __post_init__(self) -> None:
        bt = self.shape.block_tokens
        for key, values in (
            ("hits", self.hits),
            ("new", self.new),
            ("layers_per_load", self.layers_per_load),
        ):
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(f"TtftPlan.{key} must be positive integers, got {values!r}")
        for key, values in (("hits", self.hits), ("new", self.new)):
            if any(v % bt for v in values):
                raise ConfigError(
                    f"TtftPlan.{key} must be multiples of the block size ({bt} tokens), "
                    f"got {values!r}"
                )
        if not isinstance(self.reps, int) or self.reps < 1:
            raise ConfigError(f"TtftPlan.reps must be a positive integer, got {self.reps!r}")

    @classmethod
    def quick(cls) -> TtftPlan:
        """CI-sized: one hit of 2048 tokens, 128 and 512 new tokens, one round."""
        return cls(hits=(2048,), new=(128, 512), reps=1)

    @property
    def hit_blocks(self) -> int:
        """Tier blocks the largest hit fills."""
        return max(self.hits) // self.shape.block_tokens

    @property
    def cache_blocks(self) -> int:
        """Cache blocks of the largest request."""
        return (max(self.hits) + max(self.new)) // self.shape.block_tokens

    @property
    def variants(self) -> tuple[str, ...]:
        """A round's variants, in the order they run."""
        return (
            LOAD,
            COMPUTE,
            LOAD_THEN_COMPUTE,
            *(f"b{g}" for g in self.layers_per_load),
            *(f"p{g}" for g in self.layers_per_load),
            *(f"f{g}" for g in self.layers_per_load),
            *(f"s{g}" for g in self.layers_per_load),
            RECOMPUTE,
        )

    @property
    def ticks(self) -> int:
        """How many times :func:`run_ttft_pass` calls ``tick``."""
        cells = len(self.hits) * len(self.new) * (self.reps + 1) * len(self.variants)
        return cells + len(self.hits) * len(self.layers_per_load)

    def device_bytes(self) -> int:
        """About how much device memory the pass needs: the KV cache, the hit's reference
        copy and the floor's buffer, one layer's weights, and the recompute's largest
        activations."""
        s = self.shape
        item = torch.empty((), dtype=s.dtype).element_size()
        tokens = max(self.hits) + max(self.new)
        activations = tokens * (4 * s.hidden + 3 * s.intermediate + 2 * s.heads * s.head_dim)
        gathered = 4 * tokens * s.kv_heads * s.head_dim
        return (self.cache_blocks + 2 * self.hit_blocks) * s.block_bytes + (
            s.weight_elements + activations + gathered
        ) * item


def _call(work: Callable[[], None]) -> None:
    work()


def _call_on(stream: Any, work: Callable[[], None]) -> None:
    with torch.cuda.stream(stream):
        work()


@dataclass(frozen=True)
class TtftDevice:
    """Where the pass runs.

    ``empty(shape, dtype)`` allocates a device tensor; ``launch(work)`` puts
    ``work`` (torch calls) on the runtime's current stream: on CUDA calling it
    enqueues its kernels there, on a fake runtime it is enqueued on the fake's
    stream thread; ``launch_on(stream, work)`` puts it on ``stream``;
    ``synchronize`` waits on the host for all of it (default: an event recorded on
    the current stream). ``config`` is the device handlers' config (``None``:
    their defaults).
    """

    runtime: DeviceRuntime
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    launch: Callable[[Callable[[], None]], None] = _call
    launch_on: Callable[[Any, Callable[[], None]], None] = _call_on
    synchronize: Callable[[], None] | None = None
    config: DeviceHandlerConfig | None = None

    @classmethod
    def cuda(cls, runtime: DeviceRuntime) -> TtftDevice:
        """The CUDA device of ``runtime``; the host waits with ``torch.cuda.synchronize``."""
        device = runtime.device

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        # every part of a layer-wise load launches at once, as under the vLLM adapter's
        # layer-wise mode (its device handlers' max_inflight)
        config = DeviceHandlerConfig(max_inflight=LAYERWISE_MAX_INFLIGHT)
        return cls(
            runtime, empty, synchronize=lambda: torch.cuda.synchronize(device), config=config
        )

    def sync(self) -> None:
        """Wait until the work put on the device so far has finished."""
        if self.synchronize is not None:
            self.synchronize()
            return
        event = self.runtime.new_event()
        self.runtime.record(event, self.runtime.current_stream())
        self.runtime.synchronize(event)


#: the device handlers' ``max_inflight`` on CUDA: room for every part of a step's loads
LAYERWISE_MAX_INFLIGHT = 256


class PrefillModel:
    """The prefill's layers over a paged KV cache (see the module docstring)."""

    def __init__(
        self, shape: TtftShape, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    ) -> None:
        self.shape = shape
        s = shape

        def weight(rows: int, cols: int) -> torch.Tensor:
            return empty((rows, cols), s.dtype).normal_(0.0, rows**-0.5)

        self.qkv = weight(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim)
        self.o = weight(s.heads * s.head_dim, s.hidden)
        self.gate_up = weight(s.hidden, 2 * s.intermediate)
        self.down = weight(s.intermediate, s.hidden)
        self.norm = empty((s.hidden,), s.dtype).fill_(1.0)
        self.attention = "sdpa-gqa"  # "sdpa-expanded" where GQA in SDPA is refused
        self.state: torch.Tensor | None = None  # the hidden states between layers

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q`` (the last ``n`` positions) over ``k``, ``v``."""
        f = torch.nn.functional
        mask = causal_lower_right(q.shape[-2], k.shape[-2])
        if self.attention == "sdpa-gqa":
            try:
                return f.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            except RuntimeError:
                self.attention = "sdpa-expanded"
        group = self.shape.heads // self.shape.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return f.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def layer(self, x: torch.Tensor, cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """One layer for the ``x.shape[0]`` newest tokens of the request whose blocks are
        ``table``: their K and V go into the last blocks of ``table``, and they attend to
        every token of ``table``."""
        s = self.shape
        f = torch.nn.functional
        n, total = x.shape[0], table.shape[0] * s.block_tokens
        h = f.rms_norm(x, (s.hidden,), self.norm)
        sizes = [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]
        q, k, v = torch.split(h @ self.qkv, sizes, dim=-1)
        fresh = (n // s.block_tokens, s.block_tokens, s.kv_heads, s.head_dim)
        kv = torch.stack((k.reshape(fresh), v.reshape(fresh)), dim=1)
        cache.index_copy_(0, table[table.shape[0] - fresh[0] :], kv)
        blocks = cache.index_select(0, table)  # (blocks, 2, block_tokens, kv_heads, head_dim)
        keys = blocks[:, 0].reshape(total, s.kv_heads, s.head_dim).transpose(0, 1)
        values = blocks[:, 1].reshape(total, s.kv_heads, s.head_dim).transpose(0, 1)
        queries = q.reshape(n, s.heads, s.head_dim).transpose(0, 1)
        attn = self._attend(queries[None], keys[None], values[None])[0]
        x = x + attn.transpose(0, 1).reshape(n, s.heads * s.head_dim) @ self.o
        h = f.rms_norm(x, (s.hidden,), self.norm)
        gate, up = (h @ self.gate_up).chunk(2, dim=-1)
        return x + (f.silu(gate) * up) @ self.down

    def step(self, i: int, cache: torch.Tensor, table: torch.Tensor, x: torch.Tensor) -> None:
        """Layer ``i``, from ``x`` (layer 0) or from the previous layer's output."""
        self.state = self.layer(x if i == 0 else self.state, cache, table)  # type: ignore[arg-type]


class TtftBench:
    """The KV cache, the pinned tier holding the largest hit, the engine, the model."""

    def __init__(self, device: TtftDevice, plan: TtftPlan, seed: int = 0) -> None:
        self.device, self.plan = device, plan
        s = plan.shape
        self.runtime = device.runtime
        gen = torch.Generator().manual_seed(seed)
        block = (plan.cache_blocks, 2, s.block_tokens, s.kv_heads, s.head_dim)
        self.cache = [device.empty(block, s.dtype).normal_() for _ in range(s.layers)]
        self.layout = KVLayout.flashinfer(self.cache)
        where = self.cache[0].device
        self.table_np = torch.randperm(plan.cache_blocks, generator=gen).numpy()
        self.table = torch.as_tensor(self.table_np, device=where)
        self.model = PrefillModel(s, device.empty)
        tokens = max(plan.hits) + max(plan.new)
        self.x = device.empty((tokens, s.hidden), s.dtype).normal_()
        hit = self.table[: plan.hit_blocks]
        self.reference = [t.index_select(0, hit) for t in self.cache]  # before any store
        device.sync()
        self.tier = pinned_host_tier(self.runtime, self.layout, plan.hit_blocks)
        # the floor's copies: the hit's consecutive tier slots into a buffer of their size
        self.floor_dst = device.empty((plan.hit_blocks * s.block_bytes,), torch.uint8)
        self.floor_stream = self.runtime.new_stream()
        self.floor_events = [self.runtime.new_event() for _ in range(s.layers + 1)]
        self.engine: SyncOffloadingEngine | None = None
        try:
            handlers = make_device_handlers(self.runtime, self.layout, self.tier, device.config)
            self.engine = SyncOffloadingEngine(list(handlers), capacity=100_000)
            store = TransferSpec(
                gpu_blocks(self.table_np[: plan.hit_blocks]), cpu_blocks(np.arange(plan.hit_blocks))
            )
            check_results(self.engine.wait([self.engine.submit(store)]))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.tier.release()

    # ------------------------------------------------------------ pieces of a variant

    def _hit_load(self, hit_tokens: int) -> TransferSpec:
        """The whole-block load of the hit."""
        nh = hit_tokens // self.plan.shape.block_tokens
        return TransferSpec(cpu_blocks(np.arange(nh)), gpu_blocks(self.table_np[:nh]))

    def poison(self, hit_tokens: int) -> None:
        """Overwrite the hit's cache blocks and wait for it."""
        hit = self.table[: hit_tokens // self.plan.shape.block_tokens]
        for t in self.cache:
            t.index_fill_(0, hit, POISON)
        self.device.sync()

    def mismatched(self, hit_tokens: int) -> int:
        """How many of the hit's cache blocks differ in any byte from the reference."""
        nh = hit_tokens // self.plan.shape.block_tokens
        hit = self.table[:nh]
        bad = torch.zeros(nh, dtype=torch.bool, device=hit.device)
        for t, ref in zip(self.cache, self.reference, strict=True):
            got = t.index_select(0, hit).reshape(nh, -1).view(torch.uint8)
            bad |= (got != ref[:nh].reshape(nh, -1).view(torch.uint8)).any(dim=1)
        return int(bad.sum())

    def _forward(
        self, tokens: int, blocks: int, fences: Mapping[int, JobFence | _StreamEvent] | None = None
    ) -> None:
        """Launch the forward pass of the last ``tokens`` tokens of the request's first
        ``blocks`` blocks; before layer ``i``, wait on the stream for ``fences[i]``."""
        table = self.table[:blocks]
        x = self.x[:tokens]
        for i in range(self.plan.shape.layers):
            if fences is not None and i in fences:
                fences[i].wait_on_stream(self.plan.fence_timeout)
            self.device.launch(partial(self.model.step, i, self.cache[i], table, x))

    def _engine(self) -> SyncOffloadingEngine:
        if self.engine is None:
            raise RuntimeError("the TTFT bench is closed")
        return self.engine

    # ------------------------------------------------------------ the variants

    def run(self, variant: str, hit_tokens: int, new_tokens: int) -> float:
        """Seconds of one run of ``variant`` (see the module docstring)."""
        bt = self.plan.shape.block_tokens
        blocks = (hit_tokens + new_tokens) // bt
        engine = self._engine()
        load = self._hit_load(hit_tokens)
        if variant != COMPUTE:
            self.poison(hit_tokens)
        jobs: list[int] = []
        self.device.sync()
        t0 = time.perf_counter()
        if variant in (LOAD, LOAD_THEN_COMPUTE):
            check_results(engine.wait([engine.submit(load)]))
        if variant in (COMPUTE, LOAD_THEN_COMPUTE):
            self._forward(new_tokens, blocks)
        elif variant == RECOMPUTE:
            self._forward(hit_tokens + new_tokens, blocks)
        elif variant.startswith("b"):
            jobs, fences = self._submit_parts(hit_tokens, int(variant[1:]))
            self._forward(new_tokens, blocks, fences)
        elif variant.startswith("p"):  # the layer-wise load alone
            jobs, fences = self._submit_parts(hit_tokens, int(variant[1:]))
            for fence in fences.values():
                fence.wait_on_stream()
        elif variant.startswith("f"):
            self._forward(new_tokens, blocks, self._floor_parts(hit_tokens, int(variant[1:])))
        elif variant.startswith("s"):
            parts = self._floor_parts(hit_tokens, int(variant[1:]), scatter=True)
            self._forward(new_tokens, blocks, parts)
        self.device.sync()
        seconds = time.perf_counter() - t0
        if jobs:
            check_results(engine.wait(jobs))
        return seconds

    def _submit_parts(
        self, hit_tokens: int, per_load: int
    ) -> tuple[list[int], dict[int, JobFence]]:
        """One load job per ``per_load`` layers, all submitted; the fence of each part,
        keyed by its first layer."""
        engine = self._engine()
        load = self._hit_load(hit_tokens)
        jobs: list[int] = []
        fences: dict[int, JobFence] = {}
        for first in range(0, self.plan.shape.layers, per_load):
            part = range(first, min(first + per_load, self.plan.shape.layers))
            fences[first] = JobFence()
            spec = TransferSpec(load.src, load.dst, tensors=tuple(part), fence=fences[first])
            jobs.append(engine.submit(spec))
        return jobs, fences

    def _floor_parts(
        self, hit_tokens: int, per_load: int, *, scatter: bool = False
    ) -> dict[int, _StreamEvent]:
        """The floor of a layer-wise load: one contiguous copy per ``per_load`` layers'
        share of the hit's bytes, enqueued on the floor's stream (with ``scatter``, each
        followed there by its scatter into the part's layers); each part's event, keyed
        by its first layer."""
        rt = self.runtime
        layers = self.plan.shape.layers
        nh = hit_tokens // self.plan.shape.block_tokens
        nbytes = nh * self.plan.shape.block_bytes
        src, dst = self.tier.span.data_ptr(), self.floor_dst.data_ptr()
        stream, events = self.floor_stream, self.floor_events
        rt.record(events[-1], rt.current_stream())
        rt.wait_event(stream, events[-1])
        waits: dict[int, _StreamEvent] = {}
        for first in range(0, layers, per_load):
            lo, hi = nbytes * first // layers, nbytes * min(first + per_load, layers) // layers
            at = np.array([lo], dtype=np.uint64)
            size = np.array([hi - lo], dtype=np.uint64)
            rt.memcpy_batch(stream, at + dst, at + src, size, Direction.LOAD)
            if scatter:
                work = partial(self._scatter, nh, first, min(first + per_load, layers), lo)
                self.device.launch_on(stream, work)
            rt.record(events[first], stream)
            waits[first] = _StreamEvent(rt, events[first])
        return waits

    def _scatter(self, nh: int, first: int, last: int, at: int) -> None:
        """Place the floor buffer's bytes from ``at`` into the first ``nh`` hit blocks of
        layers ``first`` to ``last - 1`` (one layer's share of each block per layer)."""
        cache = self.cache[first]
        per = cache[0].numel() * cache.element_size()  # one block of one layer
        for i, layer in enumerate(range(first, last)):
            lo = at + i * nh * per
            view = self.floor_dst[lo : lo + nh * per].view(cache.dtype).view(nh, *cache.shape[1:])
            self.cache[layer].index_copy_(0, self.table[:nh], view)


@dataclass(frozen=True)
class _StreamEvent:
    """A floor part's event, waited on the way a fence is: by the current stream."""

    runtime: DeviceRuntime
    event: Any

    def wait_on_stream(self, timeout: float | None = None) -> None:
        self.runtime.wait_event(self.runtime.current_stream(), self.event)


def check_results(results: Sequence[TransferResult]) -> None:
    """Raise the first failed result's error, if any."""
    error = first_failure(results)
    if error is not None:
        raise error


T = TypeVar("T")


def timed_rounds(
    variants: Sequence[str],
    reps: int,
    run: Callable[[str], T],
    tick: Callable[[str], None],
    label: str,
) -> dict[str, list[T]]:
    """Each variant's samples (what ``run(variant)`` returns) from ``reps`` rounds after
    one untimed round, the variants interleaved within a round; ``tick(f"{label}
    {variant}")`` before each run."""
    samples: dict[str, list[T]] = {v: [] for v in variants}
    for rep in range(reps + 1):
        for v in variants:
            tick(f"{label} {v}")
            sample = run(v)
            if rep:
                samples[v].append(sample)
    return samples


def _row(
    plan: TtftPlan, hit: int, new: int, samples: dict[str, list[float]], mismatches: dict[int, int]
) -> dict[str, Any]:
    ms = {v: statistics.median(x) * 1e3 for v, x in samples.items()}
    load, compute, both = ms[LOAD], ms[COMPUTE], ms[LOAD_THEN_COMPUTE]
    layerwise = {str(g): ms[f"b{g}"] for g in plan.layers_per_load}
    best = min(layerwise, key=layerwise.__getitem__)
    floor = {str(g): ms[f"f{g}"] for g in plan.layers_per_load}
    staged = {str(g): ms[f"s{g}"] for g in plan.layers_per_load}
    best_floor = min(floor, key=floor.__getitem__)
    bound = max(load, compute)
    hit_bytes = hit // plan.shape.block_tokens * plan.shape.block_bytes
    errors = [
        f"G={g}: {n} of {hit // plan.shape.block_tokens} hit blocks differ after the "
        "layer-wise load"
        for g, n in mismatches.items()
        if n
    ]
    return {
        "hit_tokens": hit,
        "new_tokens": new,
        "hit_bytes": hit_bytes,
        "load_ms": load,
        "compute_ms": compute,
        "load_then_compute_ms": both,
        "recompute_ms": ms[RECOMPUTE],
        "layerwise_ms": layerwise,
        # the same parts with no compute: the layer-wise load's own pace (its pieces are
        # one layer's share of a block each)
        "layerwise_load_ms": {str(g): ms[f"p{g}"] for g in plan.layers_per_load},
        # the floor: the same layers waiting on one contiguous copy per part, no engine;
        # and a staged load's floor: those copies each followed by a scatter
        "floor_ms": floor,
        "staged_floor_ms": staged,
        "staged_floor_vs_bound": min(staged.values()) / bound,
        "best_floor_ms": floor[best_floor],
        "floor_vs_bound": floor[best_floor] / bound,
        "best_vs_floor": layerwise[best] / floor[best_floor],
        "best_layers_per_load": int(best),
        "layerwise_best_ms": layerwise[best],
        "layerwise_vs_bound": {g: t / bound for g, t in layerwise.items()},
        "best_vs_bound": layerwise[best] / bound,
        "best_vs_load_then_compute": layerwise[best] / both,
        "ideal_vs_load_then_compute": bound / (load + compute),
        "load_gbps": hit_bytes / (load / 1e3) / 1e9,
        "bit_exact": not errors,
        "mismatched_blocks": {str(g): n for g, n in mismatches.items()},
        "errors": errors,
        "reps": plan.reps,
        "samples_ms": {v: [t * 1e3 for t in x] for v, x in samples.items()},
    }


def run_ttft_pass(
    device: TtftDevice,
    plan: TtftPlan | None = None,
    *,
    tick: Callable[[str], None] = lambda what: None,
) -> list[dict[str, Any]]:
    """One row (a plain dict) per ``(H, N)`` of ``plan`` (see the module docstring)."""
    plan = plan or TtftPlan()
    bench = TtftBench(device, plan)
    try:
        rows = []
        for hit in plan.hits:
            mismatches = {}
            for g in plan.layers_per_load:
                tick(f"ttft H {hit} check G={g}")
                bench.run(f"b{g}", hit, min(plan.new))
                mismatches[g] = bench.mismatched(hit)
            for new in plan.new:
                samples = timed_rounds(
                    plan.variants,
                    plan.reps,
                    partial(bench.run, hit_tokens=hit, new_tokens=new),
                    tick,
                    f"ttft H {hit} N {new}",
                )
                row = _row(plan, hit, new, samples, mismatches)
                row["attention"] = bench.model.attention
                rows.append(row)
        return rows
    finally:
        bench.close()


def format_ttft_rows(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The rows as a text table, one line per ``(H, N)``, milliseconds and ratios."""
    if not rows:
        return []
    gs = list(rows[0]["layerwise_ms"])
    head = (
        f"{'H':>6} {'N':>5} {'L':>8} {'C':>8} {'a':>8} {'c':>8} "
        + " ".join(f"{'b G=' + g:>8}" for g in gs)
        + f" {'best':>4} {'b/max':>6} {'f/max':>6} {'s/max':>6} {'b/f':>6} {'b/a':>6} {'ideal':>6}"
        + "  check"
    )
    out = [head]
    for r in rows:
        cells = " ".join(f"{r['layerwise_ms'][g]:8.2f}" for g in gs)
        check = "bit-exact" if r["bit_exact"] else "ERROR: " + "; ".join(r["errors"])
        out.append(
            f"{r['hit_tokens']:6} {r['new_tokens']:5} {r['load_ms']:8.2f} {r['compute_ms']:8.2f} "
            f"{r['load_then_compute_ms']:8.2f} {r['recompute_ms']:8.2f} {cells} "
            f"{r['best_layers_per_load']:4} {r['best_vs_bound']:6.3f} {r['floor_vs_bound']:6.3f} "
            f"{r['staged_floor_vs_bound']:6.3f} "
            f"{r['best_vs_floor']:6.3f} {r['best_vs_load_then_compute']:6.3f} "
            f"{r['ideal_vs_load_then_compute']:6.3f}  {check}"
        )
    out.append(
        "ms, median of each row's reps: L load alone, C compute alone, a load then compute, "
        "c recompute, b layer-wise per G layers a job; b/max = best b / max(L, C) (aim <= 1.10), "
        "f/max = the floor's best (one contiguous copy per part, no engine) / max(L, C), "
        "s/max = the staged floor's best (those copies, each then scattered) / max(L, C), "
        "b/f = best b / best floor, b/a = best b / a, ideal = max(L, C) / (L + C)"
    )
    return out
