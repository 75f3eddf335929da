"""What the engine's threads cost a Python thread that launches work, per job (no GPU).

    python benchmarks/engine_wakeups.py [--steps 300] [--ops 224] [--blocks 4] [--reps 3]
        [--work torch|python] [--device inline|threads]
        [--modes none,instant,loop,submitter,polled,submitter-polled]

A stand-in for an eager model step on the fake CUDA runtime: each step submits one
load of ``--blocks`` blocks, runs ``--ops`` small operations on the calling thread
(``torch``: an in-place add on a 4 KiB CPU tensor, which, like an eager kernel
launch, drops and retakes the GIL in torch's dispatch; ``python``: a few bytecodes
that keep it), submits one store of as many blocks, and collects finished results
without blocking (``get_finished``), as ``offload_engine.bench.step`` does.

Variants, interleaved round by round: ``none`` (no engine), ``instant`` (the engine
with an instant ``FakeHandler`` pair), and the device handler pair on
``FakeRuntime`` in each mode of ``offload_engine.bench.step.LAUNCH_MODES``. For
each it prints the median wall time per step, its slowdown against ``none``, and
per job the wake-ups (voluntary context switches, ``/proc/self/task/*/status``)
and CPU time of the caller, the engine's loop thread, the handlers' launcher and
watcher threads, and the fake device's stream threads. ``--device inline`` (the
default) runs the fake device's work in the thread that enqueues it
(``FakeRuntime(inline=True)``: no stream threads, work done at launch), so only
the engine's threads compete with the caller, as with a real GPU; ``threads``
gives the fake its stream threads, which take the GIL to copy. Linux only.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.bench.step import LAUNCH_MODES
from offload_engine.device import DeviceHandlerConfig, make_device_handlers
from offload_engine.device import pinned_host_tier as tier_for
from offload_engine.testing import FakeHandler, FakeRuntime, build_layout
from offload_engine.vocabulary import Medium


def thread_group(name: str) -> str:
    if name == "MainThread":
        return "caller"
    if name.startswith("offload-engine-fake-stream"):
        return "device"
    for part in ("launch", "watch"):
        if name.endswith(f"-{part}"):
            return part + "er"
    if name.startswith("offload-engine-loop"):
        return "loop"
    return "other"


def snapshot() -> dict[str, tuple[int, int]]:
    """Per thread group: (voluntary context switches, CPU ns)."""
    out: dict[str, tuple[int, int]] = {}
    for t in threading.enumerate():
        if t.native_id is None or t.ident is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                switches = next(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt")
                )
            cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except (OSError, ProcessLookupError, StopIteration):
            continue
        group = thread_group(t.name)
        s, c = out.get(group, (0, 0))
        out[group] = (s + switches, c + cpu)
    return out


def make_work(kind: str, ops: int) -> Callable[[], None]:
    if kind == "torch":
        t = torch.zeros(1024)

        def torch_ops() -> None:
            for _ in range(ops):
                t.add_(1.0)

        return torch_ops

    def python_ops() -> None:
        acc = 0
        for i in range(ops * 40):
            acc += i

    return python_ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ops", type=int, default=224, help="small operations per step")
    parser.add_argument("--blocks", type=int, default=4, help="blocks each way per step")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", choices=("torch", "python"), default="torch")
    parser.add_argument("--device", choices=("inline", "threads"), default="inline")
    parser.add_argument("--modes", default="none,instant," + ",".join(LAUNCH_MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    torch.set_num_threads(1)
    work = make_work(args.work, args.ops)

    fake = FakeRuntime(inline=args.device == "inline")
    layout = build_layout("flash-attention", fake.empty, num_blocks=4 * args.blocks + 8)
    tier = tier_for(fake, layout, 4 * args.blocks)
    rng = np.random.default_rng(0)
    k = args.blocks

    def specs() -> tuple[TransferSpec, TransferSpec]:
        cache = rng.permutation(4 * k)
        slots = rng.permutation(4 * k)
        load = TransferSpec(cpu_blocks(slots[:k].tolist()), gpu_blocks(cache[:k].tolist()))
        store = TransferSpec(
            gpu_blocks(cache[k : 2 * k].tolist()), cpu_blocks(slots[k : 2 * k].tolist())
        )
        return load, store

    def engine_for(mode: str) -> SyncOffloadingEngine | None:
        if mode == "none":
            return None
        if mode == "instant":
            handlers = [FakeHandler(Medium.GPU, Medium.CPU), FakeHandler(Medium.CPU, Medium.GPU)]
            return SyncOffloadingEngine(handlers, capacity=100_000)
        cfg = DeviceHandlerConfig(staging_bytes=8 * layout.slot_bytes, **LAUNCH_MODES[mode])
        return SyncOffloadingEngine(
            list(make_device_handlers(fake, layout, tier, cfg)), capacity=100_000
        )

    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, dict[str, tuple[int, int]]] = {m: {} for m in modes}
    for _ in range(args.reps):
        for mode in modes:
            engine = engine_for(mode)
            try:
                plan = [specs() for _ in range(args.steps)]
                pending: list[int] = []
                for load, store in plan[:20]:  # warm-up, not counted
                    work()
                    if engine is not None:
                        pending += [engine.submit_nowait(load), engine.submit_nowait(store)]
                if engine is not None:
                    engine.wait(pending)
                    engine.get_finished()
                before = snapshot()
                steps = []
                submitted = 0
                for load, store in plan:
                    t0 = time.perf_counter()
                    if engine is not None:
                        engine.submit_nowait(load)
                    work()
                    if engine is not None:
                        engine.submit_nowait(store)
                        for r in engine.get_finished():
                            if not r.success:
                                raise RuntimeError(f"a transfer failed: {r.error}")
                        submitted += 2
                    steps.append(time.perf_counter() - t0)
                after = snapshot()
                times[mode].append(statistics.median(steps))
                for group, (s1, c1) in after.items():
                    s0, c0 = before.get(group, (0, 0))
                    ps, pc = counts[mode].get(group, (0, 0))
                    counts[mode][group] = (ps + s1 - s0, pc + c1 - c0)
                counts[mode]["jobs"] = (counts[mode].get("jobs", (0, 0))[0] + submitted, 0)
            finally:
                if engine is not None:
                    engine.close()
    tier.release()
    fake.close()

    base = statistics.median(times["none"]) if "none" in times else None
    groups = ("caller", "loop", "launcher", "watcher", "device")
    print(
        f"{args.steps} steps x {args.reps} rounds, {args.ops} {args.work} ops and {k} blocks "
        f"each way per step, {args.device} fake device; per job: wake-ups (CPU us)"
    )
    head = f"{'variant':<18} {'step us':>8} {'slowdown':>9}  " + "  ".join(
        f"{g:>14}" for g in groups
    )
    print(head)
    for mode in modes:
        step = statistics.median(times[mode])
        slow = f"{(step / base - 1) * 100:+.1f}%" if base else "-"
        jobs = counts[mode]["jobs"][0]
        cells = []
        for g in groups:
            if not jobs or g not in counts[mode]:
                cells.append(f"{'-':>14}")
                continue
            s, c = counts[mode][g]
            cells.append(f"{s / jobs:>6.2f} ({c / jobs / 1e3:>5.1f})")
        print(f"{mode:<18} {step * 1e6:>8.0f} {slow:>9}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
