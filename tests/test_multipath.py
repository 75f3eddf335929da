"""Borrowing peers' host links on the fake runtime: a staged job split over the own
link and peers' (device/multipath.py), and the fake's several devices it runs on."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from offload_engine import RuntimeUnavailableError
from offload_engine.testing import FakeDeviceError, FakeRuntime
from offload_engine.vocabulary import Direction


@pytest.fixture
def four() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime(devices=4)
    yield runtime
    runtime.close()


# --------------------------------------------------------------------------- the fake's devices


def test_a_fake_of_several_devices_offers_its_peers_and_their_memory(four: FakeRuntime) -> None:
    assert four.device_index == 0 and four.peer_devices() == (1, 2, 3)
    staging = four.alloc_device_on(2, 64)
    assert four.memory_of(staging.data_ptr(), staging.data_ptr() + 64) == 2
    assert not four.is_device_tensor(staging)  # a peer's memory is not this device's
    assert four.new_stream_on(3).device == 3 and four.new_stream().device == 0
    narrow = FakeRuntime(devices=4, device_index=1, peer_access=(2,))
    try:
        assert narrow.device_index == 1 and narrow.peer_devices() == (2,)
        with pytest.raises(RuntimeUnavailableError, match="no peer access to device 3"):
            narrow.alloc_device_on(3, 64)
        with pytest.raises(RuntimeUnavailableError, match="no peer access to device 1"):
            narrow.new_stream_on(1)
    finally:
        narrow.close()
    single = FakeRuntime()
    try:
        assert single.peer_devices() == ()
    finally:
        single.close()
    with pytest.raises(ValueError, match="not in"):
        FakeRuntime(devices=2, peer_access=(0,))


def test_a_fake_dma_moves_only_its_streams_devices_memory(four: FakeRuntime) -> None:
    host = torch.zeros(64, dtype=torch.uint8)
    release = four.pin_host(host)
    peer = four.alloc_device_on(1, 64)
    peer.fill_(7)
    one = np.array([64], dtype=np.uint64)
    dst = np.array([host.data_ptr()], dtype=np.uint64)
    src = np.array([peer.data_ptr()], dtype=np.uint64)
    with pytest.raises(FakeDeviceError, match="stream of device 0"):
        four.memcpy_batch(four.new_stream(), dst, src, one, Direction.STORE)
    stream = four.new_stream_on(1)
    four.memcpy_batch(stream, dst, src, one, Direction.STORE)
    event = four.new_event()
    four.record(event, stream)
    four.synchronize(event)
    assert bytes(host.numpy()) == bytes([7]) * 64 and four.batch_calls[-1].device == 1
    release()


def test_fake_faults_aimed_at_a_device(four: FakeRuntime) -> None:
    four.fail_allocations_on(2)
    with pytest.raises(FakeDeviceError, match="out of memory on fake device 2"):
        four.alloc_device_on(2, 8)
    four.alloc_device_on(1, 8)
    four.fail_next("copy", device=3)
    assert four._faults("copy", 1) == (None, False)
    error, hang = four._faults("copy", 3)
    assert isinstance(error, FakeDeviceError) and not hang
    four.hang_next("copy", device=1)
    assert four._faults("copy", 0) == (None, False)
    assert four._faults("copy", 1)[1]
