"""Probe: why a staged load's pieces cross the link slower than a contiguous copy.

    python benchmarks/device/probe_load_pieces.py

A staged 512-block load moves 128 MiB pieces host -> staging, each piece gathered
from 64 random 2 MiB pinned tier slots, consecutive pieces on alternate DMA
streams. This times 16 such pieces (2 GiB) by pattern, alone and while a bf16
8192^3 GEMM loop runs on another stream, beside the same bytes as contiguous
pieces. Patterns:

- ``contiguous``: one 128 MiB descriptor per piece, alternate streams;
- ``alternate``: 64 descriptors per piece, alternate streams (the engine's order);
- ``one-stream``: 64 descriptors per piece, all on one stream;
- ``split``: each piece's descriptors halved between the two streams;
- ``alternate+scatter``: ``alternate``, with a copy kernel reading each piece out
  of its staging buffer on a third stream before the buffer is reused (two
  buffers), as the engine does.

Then the engine's own staged 512-block loads (two jobs per round, random tier
slots): with the native launch, with the Python launch, and with the Python
launch and the scatter kernel left out (the bytes stop in staging), to see
whether the engine's pieces cross the link slower than these patterns, and why.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Literal

import numpy as np
import torch

from offload_engine.device.runtimes.cuda import CudaRuntime
from offload_engine.vocabulary import Direction

MB2 = 2 << 20
SLOTS = 1536
PER_PIECE = 64
PIECES = 16


def main() -> int:
    rt = CudaRuntime()
    host = torch.empty(SLOTS * MB2, dtype=torch.uint8)
    release = rt.pin_host(host.view(SLOTS, MB2))
    staging = [torch.empty(PER_PIECE * MB2, dtype=torch.uint8, device="cuda") for _ in range(2)]
    cache = torch.empty(PER_PIECE * MB2, dtype=torch.uint8, device="cuda")
    dmas = [rt.new_stream(), rt.new_stream()]
    sm = rt.new_stream(priority=torch.cuda.Stream.priority_range()[1])
    rng = np.random.default_rng(0)
    base = np.uint64(host.data_ptr())
    rows = np.arange(PER_PIECE, dtype=np.uint64) * np.uint64(MB2)
    sizes = np.full(PER_PIECE, MB2, dtype=np.uint64)
    pieces = [
        base + rng.choice(SLOTS, size=PER_PIECE, replace=False).astype(np.uint64) * np.uint64(MB2)
        for _ in range(PIECES)
    ]
    pieces = [np.sort(p) for p in pieces]  # the engine sorts by tier address
    contiguous = base + (np.arange(PIECES, dtype=np.uint64) % np.uint64(8)) * np.uint64(
        PER_PIECE * MB2
    )
    one = np.array([PER_PIECE * MB2], dtype=np.uint64)

    def run(pattern: str) -> float:
        free: list[torch.cuda.Event | None] = [None, None]
        t0 = time.perf_counter()
        ends = []
        for k in range(PIECES):
            b = k % 2
            dst = np.uint64(staging[b].data_ptr()) + rows
            stream = dmas[0] if pattern == "one-stream" else dmas[k % 2]
            if free[b] is not None:
                stream.wait_event(free[b])
            if pattern == "contiguous":
                rt.memcpy_batch(
                    stream,
                    np.array([staging[b].data_ptr()], dtype=np.uint64),
                    contiguous[k : k + 1],
                    one,
                    Direction.LOAD,
                )
            elif pattern == "split":
                h = PER_PIECE // 2
                if free[b] is not None:
                    dmas[1].wait_event(free[b])
                rt.memcpy_batch(dmas[0], dst[:h], pieces[k][:h], sizes[:h], Direction.LOAD)
                rt.memcpy_batch(dmas[1], dst[h:], pieces[k][h:], sizes[h:], Direction.LOAD)
                e = torch.cuda.Event()
                e.record(dmas[1])
                dmas[0].wait_event(e)
                stream = dmas[0]
            else:
                rt.memcpy_batch(stream, dst, pieces[k], sizes, Direction.LOAD)
            done = torch.cuda.Event()
            done.record(stream)
            if pattern == "alternate+scatter":
                sm.wait_event(done)
                with torch.cuda.stream(sm):
                    cache.copy_(staging[b])
                freed = torch.cuda.Event()
                freed.record(sm)
                free[b] = freed
                ends.append(freed)
            else:
                free[b] = done
                ends.append(done)
        for e in ends:
            e.synchronize()
        return time.perf_counter() - t0

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bm = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm = torch.cuda.Stream()
    patterns = ("contiguous", "alternate", "one-stream", "split", "alternate+scatter")
    if os.environ.get("PROBE_ENGINE_ONLY"):
        patterns = ()
    nbytes = PIECES * PER_PIECE * MB2
    for p in patterns:
        run(p)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name(0)}: 16 pieces of 128 MiB host -> device, GB/s")
    for busy in (False, True) if patterns else ():
        for _round in range(2):
            line = []
            for p in patterns:
                if busy:
                    with torch.cuda.stream(gemm):
                        for _ in range(40):  # about 64 ms, longer than any pattern
                            torch.mm(a, bm)
                    time.sleep(0.003)
                seconds = statistics.median(run(p) for _ in range(1 if busy else 3))
                if busy:
                    gemm.synchronize()
                line.append(f"{p} {nbytes / seconds / 1e9:5.1f}")
            print(f"  {'under GEMM' if busy else 'alone':10}: " + ", ".join(line), flush=True)
    release()
    engine_loads(rt, a, bm, gemm)
    return 0


def engine_loads(rt: CudaRuntime, a: torch.Tensor, bm: torch.Tensor, gemm: Any) -> None:
    from offload_engine import KVLayout, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
    from offload_engine.device import (
        CopyStrategy,
        DeviceHandlerConfig,
        make_device_handlers,
        pinned_host_tier,
    )

    layers = [
        torch.randn(2, SLOTS, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(32)
    ]
    layout = KVLayout.flash_attention(layers)
    tier = pinned_host_tier(rt, layout, SLOTS)
    rng = np.random.default_rng(1)
    half = SLOTS // 2
    specs = [
        TransferSpec(
            cpu_blocks(rng.choice(half, size=512, replace=False) + half),
            gpu_blocks(rng.choice(half, size=512, replace=False) + half),
        )
        for _ in range(2)
    ]
    nbytes = 2 * 512 * layout.slot_bytes
    real_copy = rt.copy_blocks
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")
    print(
        "engine, two staged 512-block loads per round, GB/s (median of 3 rounds; "
        f"CUDA_DEVICE_MAX_CONNECTIONS {connections})"
    )
    variants: tuple[tuple[str, bool | Literal["auto"], bool], ...] = (
        ("native", "auto", True),
        ("python", False, True),
        ("python-noscatter", False, False),
    )
    for name, native, scatter in variants:
        if not scatter:
            rt.copy_blocks = lambda stream, copy: None  # type: ignore[method-assign]
        cfg = DeviceHandlerConfig(
            strategy=CopyStrategy.STAGED, max_inflight=8, native_launch=native
        )
        handlers = make_device_handlers(rt, layout, tier, cfg)
        try:
            with SyncOffloadingEngine(list(handlers)) as engine:

                def round_s() -> float:
                    t0 = time.perf_counter()
                    results = engine.wait([engine.submit(x) for x in specs])
                    if not all(r.success for r in results):
                        raise RuntimeError(results)
                    return time.perf_counter() - t0

                round_s()
                alone = statistics.median(round_s() for _ in range(3))

                def busy_s() -> float:
                    with torch.cuda.stream(gemm):
                        for _ in range(40):  # about 64 ms, longer than a round
                            torch.mm(a, bm)
                    time.sleep(0.003)
                    seconds = round_s()
                    gemm.synchronize()
                    return seconds

                busy = statistics.median(busy_s() for _ in range(3))
                print(
                    f"  {name:16}: alone {nbytes / alone / 1e9:5.1f}, "
                    f"under GEMM {nbytes / busy / 1e9:5.1f}",
                    flush=True,
                )
        finally:
            rt.copy_blocks = real_copy  # type: ignore[method-assign]
    if os.environ.get("PROBE_SPREAD"):
        spread(rt, layout, tier, specs, nbytes)
    if os.environ.get("PROBE_HARNESS"):
        harness(rt, layout, tier, specs, nbytes, a, bm, gemm)
    tier.release()


def spread(rt: CudaRuntime, layout: Any, tier: Any, specs: list[Any], nbytes: int) -> None:
    """Alone, round by round: the engine's native loads (two 512-block jobs) beside the
    same pieces as raw batched copies (64 of the tier's 2 MiB slots per 128 MiB piece,
    alternate streams, straight into a staging-sized buffer), 20 rounds interleaved:
    are the engine's occasional slow rounds the link's or the engine's?"""
    from offload_engine import SyncOffloadingEngine
    from offload_engine.device import CopyStrategy, DeviceHandlerConfig, make_device_handlers

    dmas = [rt.new_stream(), rt.new_stream()]
    staging = torch.empty(2 * PER_PIECE * MB2, dtype=torch.uint8, device="cuda")
    base = np.uint64(tier.memory.data_ptr())
    slot = np.uint64(tier.slot_bytes)
    slots = [np.sort(np.asarray(s.src.block_ids, dtype=np.uint64)) for s in specs]
    pieces = [b * slot + base for ids in slots for b in np.split(ids, len(ids) // PER_PIECE)]
    rows = np.arange(PER_PIECE, dtype=np.uint64) * np.uint64(MB2)
    sizes = np.full(PER_PIECE, MB2, dtype=np.uint64)

    def raw() -> float:
        t0 = time.perf_counter()
        ends = []
        for k, src in enumerate(pieces):
            dst = np.uint64(staging.data_ptr() + (k % 2) * PER_PIECE * MB2) + rows
            rt.memcpy_batch(dmas[k % 2], dst, src, sizes, Direction.LOAD)
            done = torch.cuda.Event()
            done.record(dmas[k % 2])
            ends.append(done)
        for e in ends:
            e.synchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9

    cfg = DeviceHandlerConfig(strategy=CopyStrategy.STAGED, max_inflight=8)
    with SyncOffloadingEngine(list(make_device_handlers(rt, layout, tier, cfg))) as engine:

        def engine_round() -> float:
            t0 = time.perf_counter()
            results = engine.wait([engine.submit(x) for x in specs])
            if not all(r.success for r in results):
                raise RuntimeError(results)
            return nbytes / (time.perf_counter() - t0) / 1e9

        engine_round()
        raw()
        got_raw, got_engine = [], []
        for _ in range(20):
            got_raw.append(raw())
            got_engine.append(engine_round())
        print("spread, alone, 20 rounds interleaved, GB/s")
        print("  raw:    " + " ".join(f"{x:.1f}" for x in got_raw), flush=True)
        print("  engine: " + " ".join(f"{x:.1f}" for x in got_engine), flush=True)


def harness(
    rt: CudaRuntime,
    layout: Any,
    tier: Any,
    specs: list[Any],
    nbytes: int,
    a: torch.Tensor,
    bm: torch.Tensor,
    gemm: Any,
) -> None:
    """Loads under the GEMM measured four ways with the same native engine: why the
    gemm pass (a thread loops rounds while the main thread launches 400 GEMMs and
    waits on their end event) reads lower than this probe's isolated rounds."""
    import threading

    from offload_engine import SyncOffloadingEngine
    from offload_engine.device import CopyStrategy, DeviceHandlerConfig, make_device_handlers

    cfg = DeviceHandlerConfig(strategy=CopyStrategy.STAGED, max_inflight=8)
    with SyncOffloadingEngine(list(make_device_handlers(rt, layout, tier, cfg))) as engine:

        def one_round() -> None:
            results = engine.wait([engine.submit(x) for x in specs])
            if not all(r.success for r in results):
                raise RuntimeError(results)

        def launch(count: int) -> Any:
            end = torch.cuda.Event()
            with torch.cuda.stream(gemm):
                for _ in range(count):
                    torch.mm(a, bm)
                end.record()
            return end

        def isolated() -> float:
            launch(40)
            time.sleep(0.003)
            t0 = time.perf_counter()
            one_round()
            seconds = time.perf_counter() - t0
            gemm.synchronize()
            return nbytes / seconds / 1e9

        def looped(how: str) -> float:
            stop = threading.Event()
            out = [0.0]
            ended: list[Any] = []

            def work() -> None:
                t0 = time.perf_counter()
                rounds = 0
                while not (stop.is_set() or (ended and ended[0].query())):
                    one_round()
                    rounds += 1
                out[0] = rounds * nbytes / (time.perf_counter() - t0) / 1e9

            if how == "pre-launched":
                ended.append(launch(400))
                worker = threading.Thread(target=work)
                worker.start()
                worker.join()
                return out[0]
            worker = threading.Thread(target=work)
            worker.start()
            end = launch(400)
            if how == "main spins":
                end.synchronize()
            else:
                while not end.query():
                    time.sleep(0.001)
            stop.set()
            worker.join()
            return out[0]

        one_round()
        print("harness: native engine, staged 512-block loads under the GEMM, GB/s")
        for _ in range(2):
            line = [f"isolated {statistics.median(isolated() for _ in range(3)):5.1f}"]
            for how in ("main spins", "main sleeps", "pre-launched"):
                line.append(f"{how} {looped(how):5.1f}")
            print("  " + ", ".join(line), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
