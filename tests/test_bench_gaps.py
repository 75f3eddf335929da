"""The launch-gap pass's CPU parts: which gaps it keeps, and the pump that keeps one
store and one load in flight (the pass itself needs CUDA: tests/gpu)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from offload_engine import Medium, SyncOffloadingEngine
from offload_engine.bench.gaps import HOLD_US, _Pump, _row, launch_gaps
from offload_engine.testing import FakeHandler


def test_gaps_leave_out_the_ones_that_include_the_threads_own_engine_calls() -> None:

    calls = []

    def slow_poll() -> None:  # 2 ms: a gap that included it would show
        calls.append(1)
        time.sleep(0.002)

    gaps = launch_gaps(torch.zeros(4), 0.05, 8, slow_poll)
    assert calls  # the poll ran
    assert len(gaps) > 0
    assert gaps.max() < 2_000_000  # no kept gap spans a poll
    # every gap but one in eight is kept
    total = len(gaps) + len(calls)
    assert len(gaps) >= 7 * (total // 8) - 1


def test_the_pump_keeps_one_store_and_one_load_in_flight_and_counts_jobs() -> None:
    engine = SyncOffloadingEngine(
        [FakeHandler(Medium.GPU, Medium.CPU), FakeHandler(Medium.CPU, Medium.GPU)]
    )
    try:
        pump = _Pump(engine, 4, 16)
        pump()
        assert pump.store is not None and pump.load is not None
        first = (pump.store, pump.load)
        for _ in range(200):
            pump()
            if pump.jobs >= 4:
                break
            time.sleep(0.001)
        assert pump.jobs >= 4
        assert (pump.store, pump.load) != first
        pump.drain()
        assert pump.store is None and pump.load is None
    finally:
        engine.close()


def test_a_failed_job_stops_the_pump() -> None:
    engine = SyncOffloadingEngine(
        [
            FakeHandler(Medium.GPU, Medium.CPU, fail=lambda job: True),
            FakeHandler(Medium.CPU, Medium.GPU),
        ]
    )
    try:
        pump = _Pump(engine, 2, 8)
        pump()
        with pytest.raises(RuntimeError, match="a transfer failed"):
            for _ in range(500):
                pump()
                time.sleep(0.001)
    finally:
        engine.close()


def test_hold_ups_count_gaps_over_the_baseline_median() -> None:
    gaps_ns = np.array([5_000, 6_000, 5_000 + int(HOLD_US * 1e3) + 1_000, 300_000])
    row = _row("dma", 8, gaps_ns, 5.0, 2.0, 10)
    assert row.holdups_per_s == 1.0  # two hold-ups over two seconds
    assert row.max_us == 300.0
    assert row.jobs_per_s == 5.0
