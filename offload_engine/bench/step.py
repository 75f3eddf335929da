"""How much a model's decode step slows while the engine moves blocks (CUDA).

What a serving user feels is the step, not the link rate. This pass runs a
decode-like step over and over and, each step, stores and loads ``k`` KV blocks
through the device handlers, then compares the step's wall time with the same
step moving nothing, and with the same bytes moved as one contiguous pinned
copy per direction (the physical floor).

**The step** (:class:`DecodeStep`) is the first ``layers`` layers of a
Llama-3-8B-shaped model in bf16 with random weights, decoding one token for
each of ``batch`` sequences with ``context`` tokens of KV each:

* per layer: RMS norm; QKV projection ``hidden -> (heads + 2 kv_heads) x
  head_dim``; grouped-query attention of one query token over the layer's K and
  V (``batch x kv_heads x context x head_dim``, a dense stand-in for paged KV,
  with each KV head's ``heads / kv_heads`` query heads as its query rows); output
  projection; RMS norm; a SwiGLU MLP ``hidden -> 2 x intermediate -> hidden``;
  two residual adds;
* the defaults (16 layers, hidden 4096, intermediate 14336, 32 query and 8 KV
  heads of 128, batch 32, context 1024) read about 7 GB of weights and 2 GiB of
  KV per step: about 3 ms on an H100, memory-bound like a real decode step.

A step, as a serving worker runs it: submit the step's loads; run the forward
pass (eager: about 14 kernel launches per layer from Python; graph: one CUDA
graph replay); submit the step's stores, which wait for the forward pass
through the event the handler records at submit; wait for the compute stream
(the sampler's sync); collect finished results without blocking. Step time is
the wall time of all of that; *calls* is the part of it the step's thread spent
in the submits (or the floor's copy calls) and the poll, which an eager step
pays in full. Compute runs on the default stream or on a side stream
(``torch.cuda.stream``), eager or as a CUDA graph.

The moved blocks live in their own KV cache (32 layers, K and V, 8 x 128 bf16,
16-token blocks: 2 MiB a block, as in ``bench_cuda.py``), in one of two layouts
(:data:`LAYOUTS`): ``per-layer``, FlashAttention's tensor per layer (64 regions
of 32 KiB a block), or ``cross-layer``, one tensor holding each block's layers
together (one 2 MiB region a block). Each layout gets its own cache, tier and
engines, built after the previous layout's are freed. Stores read random cache
blocks of one half into random tier slots of one half, loads read the other
half of the tier into the other half of the cache.

The step respects backpressure: when a submit finds its handler's queue full
(:class:`~offload_engine.errors.QueueFullError`, at the engine's ``capacity``),
the step waits for the oldest pending job of the same direction and submits
again. Each row counts those waits (``queue_full``); a refusal with nothing of
its direction pending would be a bug, and is raised.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from offload_engine import (
    KVLayout,
    Medium,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes.base import DeviceRuntime
from offload_engine.errors import ConfigError, QueueFullError
from offload_engine.testing import FakeHandler

#: variants measured per (mode, stream, blocks) besides the strategies: nothing moved,
#: the contiguous floor, and the engine with an instant fake handler (the queue alone)
BASELINE, FLOOR, INSTANT = "none", "contiguous", "instant"
#: the moved blocks' KV cache layouts (see the module docstring)
PER_LAYER, CROSS_LAYER = "per-layer", "cross-layer"
LAYOUTS = (PER_LAYER, CROSS_LAYER)
#: the moved blocks' cache shape: layers, and each block's tokens, KV heads and head size
#: (bf16): 2 MiB a block
CACHE_LAYERS, CACHE_BLOCK = 32, (16, 8, 128)
#: where a small job's device work is enqueued, as DeviceHandlerConfig fields: the
#: engine's loop (the default), the submitting thread, or the launcher thread; the
#: ``-polled`` modes also find finished jobs in the caller's ``get_finished``
#: (``polled_completion``) instead of the watcher thread
LAUNCH_MODES: dict[str, dict[str, Any]] = {
    "loop": {},
    "submitter": {"submitter_launch": True},
    "launcher": {"inline_launch_blocks": 0},
    "polled": {"polled_completion": True},
    "submitter-polled": {"submitter_launch": True, "polled_completion": True},
}


@dataclass(frozen=True)
class StepShape:
    """The decode-like step's model shape (see the module docstring)."""

    layers: int = 16
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 32
    context: int = 1024

    @classmethod
    def quick(cls) -> StepShape:
        """A smaller step for CI-sized runs (4 layers: under 1 ms on an H100)."""
        return cls(layers=4)


@dataclass(frozen=True)
class StepRow:
    """One (layout, mode, stream, blocks, variant) measurement; ``slowdown`` is relative
    to the ``none`` variant of the same layout, mode, stream and blocks, in the same run."""

    mode: str  # "eager" or "graph"
    stream: str  # "default" or "side"
    blocks: int  # stored and loaded per step, each way
    variant: str  # "none", "contiguous", "instant", or a strategy
    step_ms: float  # median wall time per step
    slowdown: float
    drain_ms: float  # after the last step, until every transfer had finished
    layout: str = PER_LAYER  # the moved blocks' cache layout (LAYOUTS)
    #: submits refused with QueueFullError, each answered by waiting for the oldest
    #: pending job of its direction (all rounds, warm-up steps included)
    queue_full: int = 0
    #: the jobs per copy strategy they took (``auto`` decides per job), e.g.
    #: ``"dma:66,staged:0"``; empty for the variants that move no engine jobs
    taken: str = ""
    #: median µs per step the step's own thread spent in the variant's calls (the
    #: submits or copies, and the poll for results): CPU the step pays directly,
    #: apart from what other threads take from it
    calls_us: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class DecodeStep:
    """The decode-like step's weights, KV and static buffers, on one CUDA device."""

    def __init__(self, shape: StepShape, device: torch.device, seed: int = 0) -> None:
        self.shape = shape
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        bf16 = torch.bfloat16
        s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, device=device, dtype=bf16, generator=gen)
            return w.mul_(rows**-0.5)

        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(s.layers):
            kv = torch.randn(
                2, s.batch, s.kv_heads, s.context, s.head_dim, device=device, dtype=bf16,
                generator=gen,
            )  # fmt: skip
            self.layers.append(
                {
                    "qkv": weight(s.hidden, qkv),
                    "o": weight(s.heads * s.head_dim, s.hidden),
                    "gate_up": weight(s.hidden, 2 * s.intermediate),
                    "down": weight(s.intermediate, s.hidden),
                    "norm1": torch.ones(s.hidden, device=device, dtype=bf16),
                    "norm2": torch.ones(s.hidden, device=device, dtype=bf16),
                    "k": kv[0],
                    "v": kv[1],
                }
            )
        self.x = torch.randn(s.batch, s.hidden, device=device, dtype=bf16, generator=gen)
        self.out = torch.empty_like(self.x)
        self.graph: torch.cuda.CUDAGraph | None = None

    def forward(self) -> None:
        """One step's forward pass, from ``self.x`` into ``self.out``."""
        s = self.shape
        f = torch.nn.functional
        group = s.heads // s.kv_heads
        x = self.x
        for w in self.layers:
            h = f.rms_norm(x, (s.hidden,), w["norm1"])
            qkv = h @ w["qkv"]
            q = qkv[:, : s.heads * s.head_dim].view(s.batch, s.kv_heads, group, s.head_dim)
            attn = f.scaled_dot_product_attention(q, w["k"], w["v"])
            x = x + attn.reshape(s.batch, s.heads * s.head_dim) @ w["o"]
            h = f.rms_norm(x, (s.hidden,), w["norm2"])
            gate, up = (h @ w["gate_up"]).chunk(2, dim=-1)
            x = x + (f.silu(gate) * up) @ w["down"]
        self.out.copy_(x)

    def capture(self) -> None:
        """Capture :meth:`forward` as a CUDA graph (before any engine thread starts:
        a capture refuses concurrent work from other threads)."""
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.forward()
        torch.cuda.synchronize()
        self.graph = graph

    def run(self, mode: str) -> None:
        if mode == "graph":
            if self.graph is None:
                raise RuntimeError("capture() the graph first")
            self.graph.replay()
        else:
            self.forward()


class _Mover:
    """What moves ``k`` blocks each way per step: nothing, a contiguous copy, or an engine
    (``engine``; :meth:`build` makes the one a variant names)."""

    def __init__(
        self,
        variant: str,
        block_bytes: int,
        max_blocks: int,
        device: torch.device,
        engine: SyncOffloadingEngine | None = None,
    ) -> None:
        self.variant = variant
        self.engine = engine
        #: submitted jobs not yet seen finished, oldest first: (job id, is a store)
        self.pending: list[tuple[int, bool]] = []
        self.queue_full = 0  # submits refused with QueueFullError, each answered by a wait
        self.block_bytes = block_bytes
        self.taken: collections.Counter[str] = collections.Counter()  # jobs per strategy
        if variant == FLOOR:
            nbytes = max_blocks * block_bytes
            self.dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
            self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.streams = [torch.cuda.Stream(device=device) for _ in range(2)]  # type: ignore[no-untyped-call]

    @classmethod
    def build(
        cls,
        variant: str,
        runtime: DeviceRuntime,
        layout: KVLayout,
        tier: Any,
        max_blocks: int,
        config: DeviceHandlerConfig | None,
        capacity: int | None,
    ) -> _Mover:
        """The mover ``variant`` names; its engine (if any) holds ``capacity`` queued +
        in-flight jobs per handler (``None``: the engine's default)."""
        handlers: list[Any] = []
        if variant == INSTANT:
            handlers = [FakeHandler(Medium.GPU, Medium.CPU), FakeHandler(Medium.CPU, Medium.GPU)]
        elif variant not in (BASELINE, FLOOR):
            handlers = list(make_device_handlers(runtime, layout, tier, config))
        engine = None
        if handlers:
            engine = (
                SyncOffloadingEngine(handlers)
                if capacity is None
                else SyncOffloadingEngine(handlers, capacity=capacity)
            )
        return cls(variant, layout.slot_bytes, max_blocks, layout.device, engine)

    def move(self, spec: TransferSpec | None, k: int, *, store: bool) -> None:
        """Submit this step's load (before the forward pass) or store (after it)."""
        if self.engine is not None and spec is not None:
            job = self._submit(self.engine, spec, store)  # may replace self.pending
            self.pending.append((job, store))
        elif self.variant == FLOOR:
            side = 0 if store else 1
            stream = self.streams[side]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                n = k * self.block_bytes
                dst, src = (self.host, self.dev) if store else (self.dev, self.host)
                dst[side][:n].copy_(src[side][:n], non_blocking=True)

    def _submit(self, engine: SyncOffloadingEngine, spec: TransferSpec, store: bool) -> int:
        """Submit ``spec``, respecting backpressure: while its handler's queue is full,
        wait for the oldest pending job of the same direction, then try again."""
        while True:
            try:
                return engine.submit_nowait(spec)
            except QueueFullError:
                oldest = next((j for j, is_store in self.pending if is_store == store), None)
                if oldest is None:  # nothing of ours holds the queue: not backpressure
                    raise
                self.queue_full += 1
                _check(engine.wait([oldest]))
                self.pending = [p for p in self.pending if p[0] != oldest]

    def poll(self) -> None:
        if self.engine is not None:
            done = self.engine.get_finished()
            self.taken.update(r.strategy for r in done if r.strategy is not None)
            _check(done)
            finished = {r.job_id for r in done}
            self.pending = [p for p in self.pending if p[0] not in finished]

    def drain(self) -> None:
        if self.engine is not None:
            results = self.engine.wait([j for j, _ in self.pending])
            self.taken.update(r.strategy for r in results if r.strategy is not None)
            self.pending = []
            self.engine.get_finished()
            _check(results)
        elif self.variant == FLOOR:
            for s in self.streams:
                s.synchronize()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _check(results: Sequence[Any]) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"a transfer failed: {failed[0].error}")


@dataclass(frozen=True)
class StepPlan:
    """What :func:`run_step_pass` measures."""

    shape: StepShape = StepShape()
    blocks: tuple[int, ...] = (4, 16, 32)
    strategies: tuple[CopyStrategy, ...] = (CopyStrategy.AUTO, CopyStrategy.DMA)
    modes: tuple[tuple[str, str], ...] = (
        ("eager", "default"),
        ("eager", "side"),
        ("graph", "default"),
        ("graph", "side"),
    )
    steps: int = 30  # timed steps per variant and round
    reps: int = 3  # rounds
    cache_blocks: int = 512
    #: also run each strategy with its small jobs launched elsewhere than the
    #: default (``loop``), as variants ``<strategy>/<mode>`` (see LAUNCH_MODES)
    launch_modes: tuple[str, ...] = ()
    #: the moved blocks' cache layouts, one after the other (see LAYOUTS)
    layouts: tuple[str, ...] = LAYOUTS
    #: queued + in-flight jobs per handler before a submit raises QueueFullError
    #: (the step then waits for its oldest job); ``None``: the engine's default
    capacity: int | None = None

    def __post_init__(self) -> None:
        unknown = [x for x in self.layouts if x not in LAYOUTS]
        if unknown or not self.layouts:
            raise ConfigError(f"StepPlan.layouts must be some of {LAYOUTS}, got {self.layouts!r}")
        if not self.blocks or min(self.blocks) < 1 or max(self.blocks) > self.cache_blocks // 2:
            raise ConfigError(
                f"StepPlan.blocks must be 1 to cache_blocks / 2 = {self.cache_blocks // 2} "
                f"(a step stores from one half of the cache and loads into the other), "
                f"got {self.blocks!r}"
            )
        if self.capacity is not None and self.capacity < 1:
            raise ConfigError(f"StepPlan.capacity must be positive, got {self.capacity!r}")

    @classmethod
    def quick(cls) -> StepPlan:
        """CI-sized: a 4-layer step, 4 and 16 blocks, both layouts, eager and graph on
        the default stream, 10 steps, one round."""
        return cls(
            shape=StepShape.quick(),
            blocks=(4, 16),
            modes=(("eager", "default"), ("graph", "default")),
            steps=10,
            reps=1,
        )

    @property
    def variants(self) -> tuple[str, ...]:
        names = [s.value for s in self.strategies]
        names += [f"{n}/{mode}" for mode in self.launch_modes for n in names]
        return (BASELINE, FLOOR, INSTANT, *names)

    @property
    def ticks(self) -> int:
        """How many times :func:`run_step_pass` calls ``tick``."""
        cells = len(self.layouts) * len(self.modes) * len(self.blocks)
        return cells * self.reps * len(self.variants)


def step_cache(layout: str, blocks: int, device: torch.device) -> KVLayout:
    """The moved blocks' KV cache of ``blocks`` 2 MiB blocks in ``layout`` (see LAYOUTS)."""
    bf16 = torch.bfloat16
    if layout == PER_LAYER:
        layers = [
            torch.randn(2, blocks, *CACHE_BLOCK, device=device, dtype=bf16)
            for _ in range(CACHE_LAYERS)
        ]
        return KVLayout.flash_attention(layers)
    if layout == CROSS_LAYER:
        cache = torch.randn(blocks, CACHE_LAYERS, 2, *CACHE_BLOCK, device=device, dtype=bf16)
        return KVLayout.cross_layer(cache)
    raise ConfigError(f"unknown step cache layout {layout!r}; expected one of {LAYOUTS}")


def _make_movers(
    plan: StepPlan, runtime: DeviceRuntime, layout: KVLayout, tier: Any, movers: dict[str, _Mover]
) -> None:
    """One mover per variant of ``plan`` into ``movers`` (filled as they are built, so the
    caller closes those built before a failure)."""
    for v in plan.variants:
        config = None
        if v not in (BASELINE, FLOOR, INSTANT):
            strategy, _, mode = v.partition("/")
            config = DeviceHandlerConfig(
                strategy=CopyStrategy(strategy), **LAUNCH_MODES[mode or "loop"]
            )
        movers[v] = _Mover.build(v, runtime, layout, tier, max(plan.blocks), config, plan.capacity)


def _step_specs(rng: np.random.Generator, half: int, k: int) -> tuple[TransferSpec, TransferSpec]:
    """A step's load (other half of the tier into the other half of the cache) and store."""
    c = rng.choice(half, size=k, replace=False)
    t = rng.choice(half, size=k, replace=False)
    load = TransferSpec(cpu_blocks(t + half), gpu_blocks(c + half))
    c = rng.choice(half, size=k, replace=False)
    t = rng.choice(half, size=k, replace=False)
    return load, TransferSpec(gpu_blocks(c), cpu_blocks(t))


def _run_steps(
    model: DecodeStep,
    mover: _Mover,
    mode: str,
    k: int,
    steps: int,
    rng: np.random.Generator,
    half: int,
) -> tuple[list[float], list[float], float, int]:
    """``steps`` timed steps (after 3 warm-up steps) on the current stream, then the drain:
    the step times, the time of the mover's calls in each step, and the drain time, in
    seconds, and the submits that waited for room."""
    samples, calls = [], []
    mover.queue_full = 0
    clock = time.perf_counter
    for i in range(steps + 3):
        load = store = None
        if mover.engine is not None:
            load, store = _step_specs(rng, half, k)
        t0 = clock()
        mover.move(load, k, store=False)
        t1 = clock()
        model.run(mode)
        t2 = clock()
        mover.move(store, k, store=True)
        t3 = clock()
        torch.cuda.current_stream().synchronize()
        t4 = clock()
        mover.poll()
        t5 = clock()
        if i >= 3:
            samples.append(t5 - t0)
            calls.append((t1 - t0) + (t3 - t2) + (t5 - t4))
    t0 = clock()
    mover.drain()
    return samples, calls, clock() - t0, mover.queue_full


def _warm_up(model: DecodeStep, plan: StepPlan, device: torch.device) -> None:
    """Run every mode 10 times before the first timed step."""
    for mode, stream_kind in plan.modes:
        warm = torch.cuda.Stream(device=device) if stream_kind == "side" else None  # type: ignore[no-untyped-call]
        with torch.cuda.stream(warm):
            for _ in range(10):
                model.run(mode)
            torch.cuda.current_stream().synchronize()


def run_step_pass(
    runtime: DeviceRuntime,
    plan: StepPlan | None = None,
    *,
    tick: Callable[[str], None] = lambda what: None,
) -> list[StepRow]:
    """Measure every (layout, mode, stream, blocks) with every variant, interleaved: each
    of ``plan.reps`` rounds runs ``plan.steps`` steps of each variant in turn; the median
    step over all rounds is reported, and the slowdown against ``none`` from the same
    rounds. The layouts run one after the other, each on its own cache and engines."""
    plan = plan or StepPlan()
    device = runtime.device
    model = DecodeStep(plan.shape, device)
    if any(mode == "graph" for mode, _ in plan.modes):
        model.capture()  # before any engine thread exists
    _warm_up(model, plan, device)
    rng = np.random.default_rng(0)
    rows: list[StepRow] = []
    for name in plan.layouts:
        rows += _run_layout(runtime, plan, model, name, rng, tick)
        torch.cuda.empty_cache()  # the layout's cache, before the next one is allocated
    return rows


def _run_layout(
    runtime: DeviceRuntime,
    plan: StepPlan,
    model: DecodeStep,
    name: str,
    rng: np.random.Generator,
    tick: Callable[[str], None],
) -> list[StepRow]:
    """Every (mode, stream, blocks) and variant on a fresh cache in layout ``name``."""
    device = runtime.device
    layout = step_cache(name, plan.cache_blocks, device)
    tier = pinned_host_tier(runtime, layout, plan.cache_blocks)
    variants = list(plan.variants)
    movers: dict[str, _Mover] = {}
    half = plan.cache_blocks // 2
    rows: list[StepRow] = []
    try:
        _make_movers(plan, runtime, layout, tier, movers)
        for mode, stream_kind in plan.modes:
            side = torch.cuda.Stream(device=device) if stream_kind == "side" else None  # type: ignore[no-untyped-call]
            for k in plan.blocks:
                samples: dict[str, list[float]] = {v: [] for v in variants}
                calls: dict[str, list[float]] = {v: [] for v in variants}
                drains: dict[str, list[float]] = {v: [] for v in variants}
                waits = dict.fromkeys(variants, 0)
                for v in variants:
                    movers[v].taken.clear()
                for _ in range(plan.reps):
                    for v in variants:
                        tick(f"step {name} {mode}/{stream_kind} {k} blocks {v}")
                        with torch.cuda.stream(side):  # None: the default stream
                            times, spent, drain, full = _run_steps(
                                model, movers[v], mode, k, plan.steps, rng, half
                            )
                        samples[v] += times
                        calls[v] += spent
                        drains[v].append(drain)
                        waits[v] += full
                base = statistics.median(samples[BASELINE])
                rows += [
                    StepRow(
                        mode=mode,
                        stream=stream_kind,
                        blocks=k,
                        variant=v,
                        step_ms=statistics.median(samples[v]) * 1e3,
                        slowdown=statistics.median(samples[v]) / base - 1,
                        drain_ms=statistics.median(drains[v]) * 1e3,
                        layout=name,
                        queue_full=waits[v],
                        taken=",".join(f"{n}:{c}" for n, c in sorted(movers[v].taken.items())),
                        calls_us=statistics.median(calls[v]) * 1e6,
                    )
                    for v in variants
                ]
        return rows
    finally:
        for mover in movers.values():
            mover.close()
        tier.release()


def format_step_rows(rows: Sequence[StepRow]) -> list[str]:
    """One line per (layout, mode, stream, blocks): step ms alone and each variant's
    slowdown, with the submits that waited for room where there were any."""
    out = []
    keys: list[tuple[str, str, str, int]] = []
    for r in rows:
        key = (r.layout, r.mode, r.stream, r.blocks)
        if key not in keys:
            keys.append(key)
    for key in keys:
        group = [r for r in rows if (r.layout, r.mode, r.stream, r.blocks) == key]
        base = next(r for r in group if r.variant == BASELINE)
        parts = [
            f"{r.variant} {r.slowdown * 100:+.1f}% (calls {r.calls_us:.0f} us, "
            f"drain {r.drain_ms:.1f} ms"
            + (f", {r.queue_full} waits for room" if r.queue_full else "")
            + (f"; {r.taken}" if r.variant.startswith("auto") and r.taken else "")
            + ")"
            for r in group
            if r.variant != BASELINE
        ]
        out.append(
            f"  step {key[0]:11} {key[1]:5} {key[2]:7} {key[3]:3} blocks: "
            f"{base.step_ms:.2f} ms alone; " + ", ".join(parts)
        )
    return out
