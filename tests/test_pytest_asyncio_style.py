"""The testing kit under pytest-asyncio, the way most asyncio users write tests.

Every other async test in this suite runs on the anyio plugin (asyncio and
trio). pytest-asyncio runs in strict mode, so it serves only the tests marked
``@pytest.mark.asyncio`` here, and these run on asyncio alone.
"""

from __future__ import annotations

import pytest
import torch

from offload_engine import (
    HostCopyHandler,
    JobCancelledError,
    Medium,
    OffloadingQueueManager,
    TransferError,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
)
from offload_engine.testing import (
    FakeHandler,
    FakeTransferFailure,
    Fault,
    FaultPlan,
    FaultyHandler,
    Ledger,
    assert_exactly_once,
    cache_block_bytes,
    poisoned_tier,
    random_host_cache,
)

STORE = TransferSpec(gpu_blocks([1, 2]), cpu_blocks([3, 4]))


@pytest.mark.asyncio
async def test_fake_handler_in_manual_mode_delivers_scripted_results() -> None:
    fake = FakeHandler(manual=True, fail={1})
    async with OffloadingQueueManager([fake]) as mgr:
        ids = [mgr.submit_nowait(STORE, job_id=i) for i in range(3)]
        await fake.wait_launched(3)
        assert mgr.get_finished() == []
        fake.complete_all()
        results = await mgr.wait(ids)
    assert_exactly_once(ids, results)
    assert [r.success for r in results] == [True, False, True]
    assert isinstance(results[1].error, TransferError)
    assert isinstance(results[1].error.__cause__, FakeTransferFailure)


@pytest.mark.asyncio
async def test_cancel_of_a_queued_job_under_pytest_asyncio() -> None:
    fake = FakeHandler(manual=True, max_inflight=1)
    async with OffloadingQueueManager([fake]) as mgr:
        first = mgr.submit_nowait(STORE)
        second = mgr.submit_nowait(STORE)
        await fake.wait_launched(1)
        assert mgr.cancel(second) is True
        fake.complete(first)
        done, cancelled = await mgr.wait([first, second])
    assert done.success
    assert isinstance(cancelled.error, JobCancelledError)


@pytest.mark.asyncio
async def test_faulty_handler_and_ledger_account_for_every_job() -> None:
    plan = FaultPlan(Medium.GPU, Medium.CPU)
    ledger = Ledger()
    faults = [Fault.OK, Fault.FAIL, Fault.RAISE, Fault.OK]
    async with OffloadingQueueManager([FaultyHandler(plan)]) as mgr:
        ids = []
        for fault in faults:
            jid = mgr.submit_nowait(plan.spec(fault))
            ledger.accepted(jid, fault, nbytes=plan.nbytes)
            ids.append(jid)
        ledger.collected(await mgr.wait(ids))
    report = ledger.report()
    assert report.clean, report
    assert report.jobs == report.results == len(faults)


@pytest.mark.asyncio
async def test_host_copy_round_trip_is_bit_exact() -> None:
    tensors, layout = random_host_cache(num_layers=2, num_blocks=8, seed=7)
    tier = poisoned_tier(layout, 4)
    blocks = [2, 5, 6]
    before = [cache_block_bytes(layout, b) for b in blocks]
    async with OffloadingQueueManager([HostCopyHandler(layout, tier)]) as mgr:
        [stored] = await mgr.wait(
            [mgr.submit_nowait(TransferSpec(host_cache_blocks(blocks), cpu_blocks([0, 1, 2])))]
        )
        assert stored.success, stored.error
        gen = torch.Generator().manual_seed(8)
        for t in tensors:  # overwrite the cache, so the load must bring the bytes back
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        assert [cache_block_bytes(layout, b) for b in blocks] != before
        [loaded] = await mgr.wait(
            [mgr.submit_nowait(TransferSpec(cpu_blocks([0, 1, 2]), host_cache_blocks(blocks)))]
        )
    assert loaded.success, loaded.error
    assert [cache_block_bytes(layout, b) for b in blocks] == before
