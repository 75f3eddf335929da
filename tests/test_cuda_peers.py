"""CudaRuntime's peers without a GPU: which devices it offers, that it refuses the
others before touching CUDA, that peer access is enabled once per pair in the own
device's context (already enabled counts as done), and that a peer's streams are
made with the peer current. torch.cuda's functions are patched; the driver is a
stand-in. tests/gpu/test_multipath_cuda.py runs the real thing."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from offload_engine import RuntimeUnavailableError
from offload_engine.device.runtimes import _cuda_driver
from offload_engine.device.runtimes._cuda_driver import (
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    enable_peer_access,
)
from offload_engine.device.runtimes.cuda import CudaRuntime

#: the contexts the stand-in driver reports, per current device
CONTEXTS = {0: 0xC000, 1: 0xC001, 2: 0xC002, 3: 0xC003}


class Host:
    """A simulated host: which device is current, and every driver call made."""

    def __init__(self, devices: int, access: dict[int, set[int]]) -> None:
        self.devices = devices
        self.access = access
        self.current = 0
        self.calls: list[tuple[Any, ...]] = []
        self.enable_rc = 0

    @contextmanager
    def device(self, index: Any) -> Iterator[None]:
        index = index.index if isinstance(index, torch.device) else int(index)
        before, self.current = self.current, index
        try:
            yield
        finally:
            self.current = before

    # the stand-in driver's entry points
    def ctx_get_current(self, out: Any) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = CONTEXTS[self.current]
        self.calls.append(("get_current", self.current))
        return 0

    def ctx_enable_peer_access(self, context: Any, flags: int) -> int:
        self.calls.append(("enable", self.current, context.value, flags))
        return self.enable_rc

    def stream_create(self, out: Any, flags: int, priority: int) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x5000 + self.current
        self.calls.append(("stream_create", self.current, priority))
        return 0

    @staticmethod
    def error_name(rc: int) -> str:
        return f"CUDA_ERROR_{rc}"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Host:
    """Four devices: 0 reaches 1 and 3, not 2."""
    found = Host(4, {0: {1, 3}, 1: {0}, 2: set(), 3: {0}})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: found.devices)
    monkeypatch.setattr(
        torch.cuda, "can_device_access_peer", lambda a, b: b in found.access.get(a, set())
    )
    monkeypatch.setattr(torch.cuda, "device", found.device)
    monkeypatch.setattr(
        torch.cuda,
        "ExternalStream",
        lambda handle, device: SimpleNamespace(cuda_stream=handle, device=device),
    )
    monkeypatch.setattr(_cuda_driver, "_PEERS", set())
    return found


def runtime(host: Host, index: int = 0) -> CudaRuntime:
    """A CudaRuntime of device ``index`` over the stand-in driver (no CUDA needed)."""
    rt = object.__new__(CudaRuntime)
    rt.device = torch.device("cuda", index)
    rt._index = index
    rt._driver = host
    rt._local = threading.local()
    rt._local.bound = True  # the thread's own device is current
    rt._idle_on = {}
    return rt


def test_a_device_offers_the_devices_torch_says_it_reaches(host: Host) -> None:
    assert runtime(host, 0).peer_devices() == (1, 3)
    assert runtime(host, 2).peer_devices() == ()
    host.devices = 1
    assert runtime(host, 0).peer_devices() == ()  # one device: no peers


@pytest.mark.parametrize("call", ["alloc_device_on", "new_stream_on", "new_event_on"])
@pytest.mark.parametrize("device", [2, 0, 7])
def test_a_device_that_is_no_peer_is_refused_before_cuda_is_touched(
    host: Host, call: str, device: int
) -> None:
    rt = runtime(host)
    args = (device, 64) if call == "alloc_device_on" else (device,)
    with pytest.raises(RuntimeUnavailableError, match=f"no peer access to device {device}"):
        getattr(rt, call)(*args)
    assert host.calls == []


def test_peer_access_is_enabled_once_per_pair_in_the_own_context(host: Host) -> None:
    enable_peer_access(host, 0, 1)
    # the peer's context is read with the peer current, access enabled with the own one
    assert host.calls == [("get_current", 1), ("enable", 0, CONTEXTS[1], 0)]
    enable_peer_access(host, 0, 1)
    assert len(host.calls) == 2  # once per pair and process
    enable_peer_access(host, 0, 3)
    assert host.calls[-1] == ("enable", 0, CONTEXTS[3], 0)
    assert host.current == 0


def test_peer_access_enabled_already_counts_as_done(host: Host) -> None:
    host.enable_rc = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    enable_peer_access(host, 0, 1)
    enable_peer_access(host, 0, 1)
    assert [c[0] for c in host.calls] == ["get_current", "enable"]


def test_peer_access_that_fails_is_an_error_and_is_tried_again(host: Host) -> None:
    host.enable_rc = 217  # CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
    with pytest.raises(RuntimeUnavailableError, match=r"device 0 to device 1 .*CUDA_ERROR_217"):
        enable_peer_access(host, 0, 1)
    host.enable_rc = 0
    enable_peer_access(host, 0, 1)
    assert [c[0] for c in host.calls] == ["get_current", "enable"] * 2


def test_a_peers_stream_is_made_with_the_peer_current(host: Host) -> None:
    rt = runtime(host)
    stream = rt.new_stream_on(3, priority=-1)
    assert host.calls == [("stream_create", 3, -1)]
    assert stream.cuda_stream == 0x5003 and stream.device == torch.device("cuda", 3)
    assert host.current == 0
    own = rt.new_stream()
    assert host.calls[-1] == ("stream_create", 0, 0) and own.cuda_stream == 0x5000


def test_info_names_the_peers_each_device_reaches() -> None:
    """``offload-engine info``'s CUDA note: per device, the peers whose links it may
    borrow; nothing with one device or without peer access."""
    from offload_engine.device.runtimes.probe import peers_note

    pairs = {(0, 1), (1, 0), (0, 2), (2, 0)}
    note = peers_note(3, lambda a, b: (a, b) in pairs)
    assert note is not None and note.endswith(
        "cuda:0 -> cuda:1, cuda:2; cuda:1 -> cuda:0; cuda:2 -> cuda:0"
    )
    assert peers_note(1, lambda a, b: True) is None
    assert peers_note(4, lambda a, b: False) is None
