"""CPU time per job through the async engine on asyncio, with an instant FakeHandler.

    python benchmarks/engine_cpu_per_job.py LABEL

CPU time (``time.process_time``) is far less sensitive than wall time to other load on a
shared machine, so this is the figure to compare two trees by (run them alternately). It uses
only public names, so it runs unchanged on older and newer trees of the package.
"""

from __future__ import annotations

import sys
import time

import anyio

from offload_engine import OffloadingQueueManager, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.testing import FakeHandler

SPEC = TransferSpec(gpu_blocks([1, 2, 3, 4]), cpu_blocks([5, 6, 7, 8]))
N = 50_000


async def main() -> float:
    async with OffloadingQueueManager([FakeHandler()], capacity=4096) as mgr:
        done = anyio.Event()

        async def consume() -> None:
            n = 0
            async for _ in mgr:
                n += 1
                if n == N:
                    break
            done.set()

        t0 = time.process_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for _ in range(N):
                await mgr.submit(SPEC)
            await done.wait()
        return time.process_time() - t0


label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
print(f"{label}: {1e6 * anyio.run(main) / N:.2f} us CPU per job")
