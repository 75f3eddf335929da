"""Probes behind issue 14's third round (run on a CUDA machine).

    python benchmarks/device/probe_step_perf.py

1. CPU per batched-copy call by descriptor count and size (the staged DMA's cost).
2. The block-copy kernel's latency while a long GEMM occupies the SMs, by the copy
   stream's priority (torch's -1 and the device's highest) and grid size.
3. Where ``prepare`` and ``_enqueue`` spend their time at 8 and 512 blocks, driver
   calls timed one by one (thread CPU), with no engine thread running.
4. ``prepare`` hot (back to back), after a 20 ms sleep and after 20 ms of spinning.
5. A staged 512-block job's device timeline (each piece's DMA and gather/scatter,
   from timing events around each call) alone and under a long GEMM: how long the
   link idles.
6. The staged 512-block launch (allocator tier slots) called directly and through
   the engine's launcher thread, unwrapped and with every driver call timed, hot and
   after the thread slept: where the engine path's extra CPU goes.

``PROBE_SECTIONS=35`` runs sections 3 and 5 only.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from profile_launch import cpu_us  # this folder's profile_launch.py (sys.path[0])

from offload_engine import KVLayout, SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.bench.slots import allocator_slots
from offload_engine.device import (
    CopyStrategy,
    DeviceHandlerConfig,
    make_device_handlers,
    pinned_host_tier,
)
from offload_engine.device.runtimes.cuda import CudaRuntime
from offload_engine.vocabulary import Direction


def timeline(rt: CudaRuntime, layout: KVLayout, tier: Any, rng: Any, nb: int) -> None:
    """Section 5: device timeline of two back-to-back 512-block staged jobs."""
    print("5. staged 512-block jobs, device timeline (ms from the first submit)")
    ops: list[tuple[str, Any, Any]] = []
    real_copy, real_batch = rt.copy_blocks, rt.memcpy_batch

    def timed(label: str, stream: Any, fn: Any, *args: Any) -> Any:
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        out = fn(stream, *args)
        e1.record(stream)
        ops.append((label, e0, e1))
        return out

    rt.copy_blocks = lambda stream, copy: timed("sm", stream, real_copy, copy)  # type: ignore[method-assign]
    rt.memcpy_batch = lambda stream, *a: timed(f"dma{id(stream) % 997}", stream, real_batch, *a)  # type: ignore[method-assign]
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm = torch.cuda.Stream()
    python = (
        {"native_launch": False}
        if "native_launch" in DeviceHandlerConfig.__dataclass_fields__
        else {}
    )  # the runtime's calls are what is timed here
    cfg = DeviceHandlerConfig(strategy=CopyStrategy.STAGED, max_inflight=8, **python)
    store, load = make_device_handlers(rt, layout, tier, cfg)
    with SyncOffloadingEngine([store, load]) as engine:
        for direction in ("load", "store"):
            specs = []
            for _ in range(2):
                c = rng.choice(nb // 2, size=512, replace=False)
                t = rng.choice(nb // 2, size=512, replace=False)
                specs.append(
                    TransferSpec(gpu_blocks(c), cpu_blocks(t))
                    if direction == "store"
                    else TransferSpec(cpu_blocks(t + nb // 2), gpu_blocks(c + nb // 2))
                )
            engine.wait([engine.submit(x) for x in specs])
            for busy in (False, True):
                if busy:
                    with torch.cuda.stream(gemm):
                        for _ in range(40):
                            torch.mm(a, b)
                    time.sleep(0.005)
                ops.clear()
                zero = torch.cuda.Event(enable_timing=True)
                zero.record(rt.new_stream())
                t0 = time.perf_counter()
                engine.wait([engine.submit(x) for x in specs])
                wall = (time.perf_counter() - t0) * 1e3
                torch.cuda.synchronize()
                spans = sorted(
                    (zero.elapsed_time(e0), zero.elapsed_time(e1), label) for label, e0, e1 in ops
                )
                dma = [(x, y) for x, y, label in spans if label != "sm"]
                busy_ms, last_end = 0.0, 0.0
                for x, y in dma:
                    busy_ms += max(0.0, y - max(x, last_end))
                    last_end = max(last_end, y)
                first = min(x for x, _ in dma)
                print(
                    f"  {direction} {'under GEMM' if busy else 'alone':10}: wall {wall:6.2f} ms, "
                    f"DMA from {first:6.2f} to {last_end:6.2f} ms, link busy {busy_ms:6.2f} ms "
                    f"({busy_ms / (last_end - first):.2f} of that span)",
                    flush=True,
                )
                for x, y, label in spans:
                    print(f"      {label:6} {x:7.2f} {y:7.2f}")
    rt.copy_blocks, rt.memcpy_batch = real_copy, real_batch  # type: ignore[method-assign]


def _calibrate(reps: int = 15) -> str:
    """A fixed piece of pure Python (about 100 us hot) timed hot, after a 20 ms sleep
    and after 20 ms of waiting on the device: does this machine run code slower
    right after a thread idled (clock, caches), whatever the code?"""

    def work() -> int:
        total = 0
        for i in range(3000):
            total += i & 7
        return total

    out = []
    for how in ("hot", "sleep", "device"):
        samples = []
        for _ in range(reps):
            if how == "sleep":
                time.sleep(0.02)
            elif how == "device":
                torch.cuda._sleep(20_000_000)  # about 10-20 ms of device time
                torch.cuda.synchronize()
            t0 = time.thread_time_ns()
            work()
            samples.append((time.thread_time_ns() - t0) / 1e3)
        out.append(f"{how} {statistics.median(samples):.0f} us")
    t0 = time.thread_time_ns()
    for _ in range(1000):
        time.thread_time_ns()
    clock = (time.thread_time_ns() - t0) / 1e3 / 1000
    return ", ".join(out) + f"; one thread_time_ns call {clock:.2f} us"


def _breakdown(parts: list[dict[str, int]]) -> str:
    """Median CPU and count per timed call over the jobs in ``parts``."""
    if not parts:
        return ""
    keys = sorted(k for k in parts[0] if not k.endswith("#"))
    return (
        " ["
        + ", ".join(
            f"{k} {statistics.median([p.get(k, 0) for p in parts]) / 1e3:.0f}us"
            f" x{statistics.median([p.get(k + '#', 0) for p in parts]):.0f}"
            for k in keys
        )
        + "]"
    )


def _timed_enqueue(
    local: Any, real: Any, samples: list[float], parts: list[dict[str, int]], where: dict[str, Any]
) -> Any:
    """``real`` (a handler's ``_enqueue``) timed in whichever thread calls it."""
    import threading

    def timed(plan: Any) -> None:
        local.acc = {} if where["wrapped"] else None
        t0 = time.thread_time_ns()
        real(plan)
        samples.append((time.thread_time_ns() - t0) / 1e3)
        if local.acc is not None:
            parts.append(local.acc)
        local.acc = None
        where["thread"] = threading.current_thread().name

    return timed


def engine_path(rt: CudaRuntime, layout: KVLayout, tier: Any, rng: Any, nb: int) -> None:
    """Section 6: the staged 512-block launch, direct and in the launcher thread."""
    import threading

    import offload_engine.device.handler as dmod

    print("6. staged 512-block launch (allocator slots): direct vs the engine's launcher thread")
    print(f"  calibration (pure Python, this thread): {_calibrate()}")
    local = threading.local()  # per thread: the running _enqueue's per-call totals
    names = ("record", "wait_event", "memcpy_batch", "copy_blocks", "upload_ids", "new_event")
    reals = {name: getattr(rt, name) for name in names}
    # descriptor merging: merge_runs per piece (main before stepperf5) or the runs
    # planned once per job (stepperf5's DeviceCopyHandler._runs)
    merge_owner, merge_name = (
        (dmod, "merge_runs") if hasattr(dmod, "merge_runs") else (dmod.DeviceCopyHandler, "_runs")
    )
    real_merge = getattr(merge_owner, merge_name)

    def wrap(real: Any, label: str) -> Any:
        def timed(*args: Any, **kw: Any) -> Any:
            acc = getattr(local, "acc", None)
            if acc is None:
                return real(*args, **kw)
            t0 = time.thread_time_ns()
            try:
                return real(*args, **kw)
            finally:
                acc[label] = acc.get(label, 0) + time.thread_time_ns() - t0
                acc[label + "#"] = acc.get(label + "#", 0) + 1

        return timed

    def instrument(on: bool, handlers: tuple[Any, ...] = ()) -> None:
        for name in names:
            setattr(rt, name, wrap(reals[name], name) if on else reals[name])
        setattr(merge_owner, merge_name, wrap(real_merge, "merge") if on else real_merge)
        for h in handlers:  # the native launch: its program's one call
            program = getattr(h, "_native", None)
            if program is not None:
                # stepperf7: a staged job's pieces planned by the library, one call
                calls = [n for n in ("run", "build_staged") if hasattr(program, n)]
                for call in calls:
                    if on:
                        label = "native run" if call == "run" else "native plan"
                        setattr(program, call, wrap(getattr(program, call), label))
                    else:
                        vars(program).pop(call, None)

    jobs = 24
    # the default launch (a 512-block job goes to the launcher thread), then the same
    # job launched by the submitting thread (inline_launch_blocks above 512); on a tree
    # with the native launch (stepperf6), each with it off and on
    natives: tuple[Any, ...] = (
        (False, True) if "native_launch" in DeviceHandlerConfig.__dataclass_fields__ else (None,)
    )
    for variant, native in [(v, n) for v in ("launcher", "submitter") for n in natives]:
        extra = {} if native is None else {"native_launch": native}
        cfg = DeviceHandlerConfig(
            strategy=CopyStrategy.STAGED,
            max_inflight=8,
            inline_launch_blocks=1024 if variant == "submitter" else 64,
            submitter_launch=variant == "submitter",
            **extra,
        )
        store, load = make_device_handlers(rt, layout, tier, cfg)
        with SyncOffloadingEngine([store, load]) as engine:
            for handler, direction in ((store, "store"), (load, "load")):
                tiers = allocator_slots(nb, 512, jobs)
                specs = []
                for j in range(jobs):
                    c = gpu_blocks(rng.choice(nb, size=512, replace=False))
                    t = cpu_blocks(tiers[j])
                    specs.append(TransferSpec(c, t) if direction == "store" else TransferSpec(t, c))
                engine.wait([engine.submit(x) for x in specs[:3]])
                real_enqueue = handler._enqueue
                samples: list[float] = []
                parts: list[dict[str, int]] = []
                where: dict[str, Any] = {"thread": "", "wrapped": False}
                timed_enqueue = _timed_enqueue(local, real_enqueue, samples, parts, where)
                handler._enqueue = timed_enqueue  # type: ignore[method-assign]
                cases: list[tuple[str, Any]] = [
                    ("engine, one at a time", "alone"),
                    ("engine, back to back", "b2b"),
                ]
                if variant == "launcher":
                    cases = [
                        ("direct, hot", None),
                        ("direct, after 20 ms sleep", 0.02),
                        *cases,
                    ]
                try:
                    for wrapped in (False, True):
                        instrument(wrapped, (handler,))
                        where["wrapped"] = wrapped
                        for label, how in cases:
                            samples.clear()
                            parts.clear()
                            if how == "alone":
                                for x in specs:
                                    engine.wait([engine.submit(x)])
                            elif how == "b2b":
                                engine.wait([engine.submit(x) for x in specs])
                            else:
                                for x in specs:
                                    p = handler.prepare(x)
                                    if how:
                                        time.sleep(how)
                                    handler._enqueue(p)
                                    torch.cuda.synchronize()
                                    handler._recycle(p)
                            name = f"{label}, submitter" if variant == "submitter" else label
                            name += {None: "", False: ", python", True: ", native"}[native]
                            print(
                                f"  {direction:5} {'timed calls' if wrapped else 'plain':11} "
                                f"{name:45}: _enqueue {statistics.median(samples):6.0f} us "
                                f"(min {min(samples):5.0f}, thread {where['thread']})"
                                f"{_breakdown(parts)}",
                                flush=True,
                            )
                finally:
                    instrument(False, (handler,))
                    handler._enqueue = real_enqueue  # type: ignore[method-assign]


def main() -> int:
    rt = CudaRuntime()
    nb = 1536
    layers = [
        torch.randn(2, nb, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(32)
    ]
    layout = KVLayout.flash_attention(layers)
    tier = pinned_host_tier(rt, layout, nb)
    rng = np.random.default_rng(0)
    s = rt.new_stream()
    dev = torch.empty(512 * layout.slot_bytes, dtype=torch.uint8, device="cuda")
    sections = os.environ.get("PROBE_SECTIONS", "1234")
    print("1. batched copy CPU per call (d2h, random tier slots)")
    for size in (2 << 20, 32 << 10) if "1" in sections else ():
        for n in (8, 64, 256, 512):
            ids = rng.choice(nb, size=n, replace=False).astype(np.uint64)
            src = np.uint64(dev.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(size)
            dst = np.uint64(tier.memory.data_ptr()) + ids * np.uint64(tier.slot_bytes)
            sizes = np.full(n, size, dtype=np.uint64)
            copy = lambda: rt.memcpy_batch(s, dst, src, sizes, Direction.STORE)  # noqa: B023, E731
            us = cpu_us(copy, 30, sync_each=True)
            print(f"  {n:4} x {size >> 10:5} KiB: {us:8.1f} us, {us / n:.2f} us per descriptor")
    lo, hi = torch.cuda.Stream.priority_range()
    print(f"2. stream priority range (least, greatest): {(lo, hi)}")
    cfg = DeviceHandlerConfig(strategy=CopyStrategy.KERNEL, max_inflight=8)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm = torch.cuda.Stream()
    stage = torch.empty(64 * layout.slot_bytes, dtype=torch.uint8, device="cuda")
    for prio in (0, -1, hi) if "2" in sections else ():
        cs = torch.cuda.Stream(priority=prio)
        store, load = make_device_handlers(rt, layout, tier, cfg)
        with SyncOffloadingEngine([store, load]) as engine:
            spec = TransferSpec(
                gpu_blocks(rng.choice(nb, 64, replace=False)), cpu_blocks(np.arange(64))
            )
            engine.wait([engine.submit(spec)])
            # a 64-block gather into staging (the staged store's first half) on ``cs``
            plan = store.prepare(spec)
            ids = store._upload_ids(plan, cs, [plan.groups[0].cache_ids])[0]
            staging_view = stage.view(-1, layout.slot_bytes)

            def gather() -> None:
                group = plan.groups[0]  # noqa: B023 - called within this iteration
                address = stage.data_ptr()
                store._block_copy(cs, group, ids, None, 64, address, staging_view)  # noqa: B023

            t = []
            for busy in (False, True):
                lat = []
                for _ in range(10):
                    if busy:
                        with torch.cuda.stream(gemm):
                            for _ in range(6):
                                torch.mm(a, b)
                        time.sleep(0.003)
                    e0, e1 = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    e0.record(cs)
                    gather()
                    e1.record(cs)
                    e1.synchronize()
                    lat.append(e0.elapsed_time(e1) * 1e3)
                    torch.cuda.synchronize()
                t.append(statistics.median(lat))
            print(
                f"  priority {prio:3}: 64-block gather alone {t[0]:7.0f} us, "
                f"under GEMM {t[1]:7.0f} us"
            )
            store._recycle(plan)
    if "5" in sections:
        timeline(rt, layout, tier, rng, nb)
    if "6" in sections:
        engine_path(rt, layout, tier, rng, nb)
    if not {"3", "4"} & set(sections):
        tier.release()
        return 0
    # PROBE_SLOTS=allocator: section 3's tier slots as vLLM's allocator hands them out
    by_allocator = os.environ.get("PROBE_SLOTS") == "allocator"
    print(
        "3. where the CPU goes, no engine thread running (median thread CPU per job; "
        f"{'allocator' if by_allocator else 'random'} tier slots)"
    )
    timers: dict[str, list[int]] = defaultdict(list)

    def wrap(obj: Any, name: str, label: str) -> None:
        real = getattr(obj, name)

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return real(*args, **kw)
            finally:
                timers[label].append(time.thread_time_ns() - t0)

        setattr(obj, name, timed)

    for name in (
        "record",
        "wait_event",
        "memcpy_batch",
        "copy_blocks",
        "upload_ids",
        "record_current",
    ):
        wrap(rt, name, name)
    import offload_engine.device.handler as dmod

    if hasattr(dmod, "merge_runs"):  # main before stepperf5: merged per piece
        wrap(dmod, "merge_runs", "merge_runs")
    if hasattr(dmod.DeviceCopyHandler, "_runs"):  # stepperf5: runs planned once per job
        wrap(dmod.DeviceCopyHandler, "_runs", "runs")
    wrap(dmod, "map_transfer", "map_transfer")
    for strategy in (CopyStrategy.STAGED, CopyStrategy.KERNEL):
        cfg = DeviceHandlerConfig(strategy=strategy, max_inflight=8)
        store, load = make_device_handlers(rt, layout, tier, cfg)
        for h in (store, load):  # the native launch (stepperf6): its one call, timed
            if getattr(h, "_native", None) is not None:
                wrap(h._native, "run", "native run")
                if hasattr(h._native, "build_staged"):  # stepperf7: the planner's call
                    wrap(h._native, "build_staged", "native plan")
        print(f"  {strategy.value}: native launch {getattr(store, '_native', None) is not None}")
        with SyncOffloadingEngine([store, load]) as engine:
            for per_job in (8, 512):
                for handler, direction in ((store, "store"), (load, "load")):
                    specs = []
                    tiers = allocator_slots(nb, per_job, 30) if by_allocator else None
                    for j in range(30):
                        c = rng.choice(nb, size=per_job, replace=False)
                        t = (
                            tiers[j]
                            if tiers is not None
                            else rng.choice(nb, size=per_job, replace=False)
                        )
                        specs.append(
                            TransferSpec(gpu_blocks(c), cpu_blocks(t))
                            if direction == "store"
                            else TransferSpec(cpu_blocks(t), gpu_blocks(c))
                        )
                    engine.wait([engine.submit(x) for x in specs[:2]])
                    prep, enq = [], []
                    totals: dict[str, list[int]] = defaultdict(list)
                    for x in specs:
                        timers.clear()
                        t0 = time.thread_time_ns()
                        p = handler.prepare(x)
                        t1 = time.thread_time_ns()
                        handler._enqueue(p)
                        t2 = time.thread_time_ns()
                        prep.append((t1 - t0) / 1e3)
                        enq.append((t2 - t1) / 1e3)
                        for k, v in timers.items():
                            totals[k].append(sum(v))
                            totals[k + "#"].append(len(v))
                        torch.cuda.synchronize()
                        handler._recycle(p)
                    parts = ", ".join(
                        f"{k} {statistics.median(v) / 1e3:.0f}us "
                        f"x{statistics.median(totals[k + '#']):.0f}"
                        for k, v in totals.items()
                        if not k.endswith("#")
                    )
                    print(
                        f"  {strategy.value:6} {direction:5} {per_job:3}: prepare "
                        f"{statistics.median(prep):6.0f} us, "
                        f"enqueue {statistics.median(enq):6.0f} us "
                        f"[{parts}]",
                        flush=True,
                    )
    print("4. prepare at 512 blocks: hot (back to back), after a 20 ms sleep, after 20 ms spinning")
    cfg = DeviceHandlerConfig(strategy=CopyStrategy.STAGED, max_inflight=8)
    store, load = make_device_handlers(rt, layout, tier, cfg)
    with SyncOffloadingEngine([store, load]) as engine:
        for per_job in (8, 512):
            specs = [
                TransferSpec(
                    gpu_blocks(rng.choice(nb, per_job, replace=False)),
                    cpu_blocks(rng.choice(nb, per_job, replace=False)),
                )
                for _ in range(30)
            ]
            engine.wait([engine.submit(specs[0])])
            out = {}
            for how in ("hot", "sleep", "spin"):
                samples = []
                for x in specs:
                    if how == "sleep":
                        time.sleep(0.02)
                    elif how == "spin":
                        t_end = time.perf_counter() + 0.02
                        while time.perf_counter() < t_end:
                            pass
                    t0 = time.thread_time_ns()
                    p = store.prepare(x)
                    samples.append((time.thread_time_ns() - t0) / 1e3)
                    store._recycle(p)
                out[how] = statistics.median(samples)
            print(f"  {per_job:3} blocks: " + ", ".join(f"{k} {v:.0f} us" for k, v in out.items()))
    tier.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
