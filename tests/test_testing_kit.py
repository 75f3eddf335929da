"""The public testing kit behaves as documented."""

from __future__ import annotations

import pytest

from offload_engine import OffloadingQueueManager, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine.testing import FakeHandler, FakeTransferFailure, assert_exactly_once

pytestmark = pytest.mark.anyio

STORE = TransferSpec(gpu_blocks([1, 2, 3]), cpu_blocks([4, 5, 6]))


async def test_latency_falling_with_job_id_finishes_out_of_order() -> None:
    unordered = FakeHandler(latency=lambda jid: 0.02 - 0.004 * jid, ordered=False)
    async with OffloadingQueueManager([unordered]) as mgr:
        ids = [mgr.submit_nowait(STORE, job_id=i) for i in range(4)]
        await mgr.wait(ids)
        assert unordered.completed == [3, 2, 1, 0]


async def test_ordered_fake_with_out_of_order_latency_still_delivers_fifo() -> None:
    fake = FakeHandler(latency=lambda jid: 0.02 - 0.004 * jid, ordered=True)
    async with OffloadingQueueManager([fake]) as mgr:
        for i in range(4):
            mgr.submit_nowait(STORE, job_id=i)
        got = []
        async for r in mgr:
            got.append(r.job_id)
            if len(got) == 4:
                break
        assert got == [0, 1, 2, 3]
        assert fake.completed == [3, 2, 1, 0]


async def test_manual_mode_scripts_success_and_failure() -> None:
    fake = FakeHandler(manual=True, fail=lambda jid: jid == 2)
    async with OffloadingQueueManager([fake]) as mgr:
        ids = [mgr.submit_nowait(STORE, job_id=i) for i in range(4)]
        await fake.wait_launched(4)
        assert sorted(fake.held) == ids
        fake.fail_job(0, ValueError("scripted"))
        fake.complete_all()
        results = await mgr.wait(ids)
    assert_exactly_once(ids, results)
    assert [r.success for r in results] == [False, True, False, True]
    assert isinstance(results[0].error.__cause__, ValueError)  # type: ignore[union-attr]
    assert isinstance(results[2].error.__cause__, FakeTransferFailure)  # type: ignore[union-attr]


def test_fake_checks_block_counts_like_a_real_handler() -> None:
    with pytest.raises(ValueError, match="one to one"):
        FakeHandler().prepare(TransferSpec(gpu_blocks([1]), cpu_blocks([1, 2])))


def test_assert_exactly_once_reports_missing_and_duplicates() -> None:
    from offload_engine import TransferResult

    r = TransferResult(1, True, 0, 0.0)
    assert_exactly_once([1], [r])
    with pytest.raises(AssertionError, match="missing \\[2\\]"):
        assert_exactly_once([1, 2], [r])
    with pytest.raises(AssertionError, match="duplicated \\[1\\]"):
        assert_exactly_once([1], [r, r])
