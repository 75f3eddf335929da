"""Platform -> handler selection, with fake vLLM platform objects."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_engine import (
    HostCopyHandler,
    Medium,
    RuntimeUnavailableError,
    SyncOffloadingEngine,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
)
from offload_engine.connectors.vllm import platform
from offload_engine.connectors.vllm.bridge import EngineBridge
from offload_engine.connectors.vllm.config import parse_extra_config
from offload_engine.connectors.vllm.layout import layout_from_canonical
from offload_engine.connectors.vllm.platform import select_backend
from offload_engine.connectors.vllm.testing import fake_canonical_kv_caches
from offload_engine.device import DeviceCopyHandler, peers
from offload_engine.testing import FakeRuntime, cache_block_bytes

#: a device handler's native_note where peers keep it from the native launch
SPLIT_FROM_PYTHON = "jobs split over peers' links launch from Python"


@dataclass
class FakePlatform:
    device_type: str
    rocm: bool = False

    def is_rocm(self) -> bool:
        return self.rocm


def test_cpu_platform_gets_the_host_handler() -> None:
    backend = select_backend(FakePlatform("cpu"))
    assert backend.name == "cpu"
    assert backend.cache_medium is Medium.CPU
    layout = layout_from_canonical(fake_canonical_kv_caches(num_blocks=4))
    config = parse_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "host_workers": 2}, blocks_per_chunk=2
    )
    handlers, tier = backend.build(layout, 3, config)
    try:
        [handler] = handlers
        assert isinstance(handler, HostCopyHandler)
        assert handler.pair == (Medium.CPU, Medium.CPU)
        assert handler.workers == 2
        assert (tier.num_blocks, tier.factor, tier.slot_bytes) == (3, 2, layout.slot_bytes)
    finally:
        tier.release()


def test_cuda_platform_builds_device_handlers_on_the_cuda_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without a GPU the CUDA runtime refuses to start, with a clear error
    backend = select_backend(FakePlatform("cuda"))
    assert (backend.name, backend.cache_medium) == ("CUDA", Medium.GPU)
    layout = layout_from_canonical(fake_canonical_kv_caches(num_blocks=4))
    config = parse_extra_config({"cpu_bytes_to_use": 1 << 20})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeUnavailableError, match="CUDA is not available"):
            backend.build(layout, 2, config)


def _cuda_backend_over(
    fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch, *, num_blocks: int
) -> tuple[Any, Any]:
    """The CUDA platform's backend with ``fake`` as its runtime, and the layout of a
    KV cache of ``num_blocks`` random blocks in the fake's device memory."""
    fake_module = types.ModuleType("fake_runtime_module")
    fake_module.Runtime = lambda: fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_runtime_module", fake_module)
    monkeypatch.setattr(platform, "CUDA_RUNTIME", "fake_runtime_module:Runtime")
    caches = fake_canonical_kv_caches(
        num_blocks=num_blocks, groups=(((0, 240), (1, 240)),), empty=fake.empty
    )
    return select_backend(FakePlatform("cuda")), layout_from_canonical(caches)


@pytest.mark.parametrize("polled", [False, True])
def test_a_device_platform_runs_real_copies_through_the_device_handler(
    monkeypatch: pytest.MonkeyPatch, polled: bool
) -> None:
    fake = FakeRuntime()
    try:
        backend, layout = _cuda_backend_over(fake, monkeypatch, num_blocks=8)
        config = parse_extra_config(
            {
                "cpu_bytes_to_use": 1 << 20,
                "strategy": "staged",
                "staging_bytes": 4 * layout.slot_bytes,
                "submitter_launch": polled,
                "polled_completion": polled,
                **({"native_launch": False} if polled else {}),
            }
        )
        handlers, tier = backend.build(layout, 4, config)
        assert [h.polled_completion for h in handlers] == [polled, polled]
        # the key reaches the handler (unset: its default); the fake runtime has none
        want = False if polled else "auto"
        assert [h.config.native_launch for h in handlers] == [want, want]  # type: ignore[attr-defined]
        assert all(h._native is None for h in handlers)  # type: ignore[attr-defined]
        try:
            assert [h.pair for h in handlers] == [
                (Medium.GPU, Medium.CPU),
                (Medium.CPU, Medium.GPU),
            ]
            assert all(isinstance(h, DeviceCopyHandler) for h in handlers)
            want = cache_block_bytes(layout, 3)
            with SyncOffloadingEngine(handlers) as engine:
                engine.wait([engine.submit(TransferSpec(gpu_blocks([3]), cpu_blocks([1])))])
                engine.wait([engine.submit(TransferSpec(cpu_blocks([1]), gpu_blocks([6])))])
            assert cache_block_bytes(layout, 6) == want
        finally:
            tier.release()
    finally:
        fake.close()


def test_peers_reach_the_device_handlers_and_their_jobs_cross_the_peers_links(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``peers`` and its sizes reach DeviceHandlerConfig, the handlers launch from
    Python (a split job does), a large staged job's bytes
    cross the peers' links and come back bit-exact, and the handlers share the
    host's peer ledger, which the bridge closes at shutdown."""
    monkeypatch.setattr(peers, "LEDGER_DIRECTORY", str(tmp_path))
    fake = FakeRuntime(devices=4)
    try:
        backend, layout = _cuda_backend_over(fake, monkeypatch, num_blocks=48)
        config = parse_extra_config(
            {
                "cpu_bytes_to_use": 1 << 20,
                "strategy": "staged",
                "staging_bytes": 64 * layout.slot_bytes,
                "peers": [1, 2],
                "peer_staging_bytes": 32 * layout.slot_bytes,
                "peer_min_blocks": 16,
            }
        )
        handlers, tier = backend.build(layout, 40, config)
        try:
            assert [h.config.peers for h in handlers] == [(1, 2), (1, 2)]  # type: ignore[attr-defined]
            assert [h.native_note for h in handlers] == [SPLIT_FROM_PYTHON] * 2  # type: ignore[attr-defined]
            assert [h.config.peer_min_blocks for h in handlers] == [16, 16]  # type: ignore[attr-defined]
            want = [cache_block_bytes(layout, b) for b in range(24)]
            assert len(set(want)) == 24  # random bytes, every block its own
            engine = SyncOffloadingEngine(handlers)
            bridge = EngineBridge(engine, Medium.GPU, tier=tier)
            try:
                assert [h.borrowed for h in handlers] == [(1, 2), (1, 2)]  # type: ignore[attr-defined]
                ids = list(range(24))
                engine.wait([engine.submit(TransferSpec(gpu_blocks(ids), cpu_blocks(ids)))])
                engine.wait(
                    [
                        engine.submit(
                            TransferSpec(cpu_blocks(ids), gpu_blocks([b + 24 for b in ids]))
                        )
                    ]
                )
                ledger = handlers[0].ledger  # type: ignore[attr-defined]
                assert ledger is handlers[1].ledger and ledger is not None  # type: ignore[attr-defined]
                assert Path(ledger.path).parent == tmp_path
            finally:
                bridge.shutdown()
            assert [cache_block_bytes(layout, b + 24) for b in range(24)] == want
            assert {c.device for c in fake.batch_calls} == {0, 1, 2}
            assert ledger.closed and not Path(ledger.path).exists()
        finally:
            tier.release()
    finally:
        fake.close()


@pytest.mark.parametrize(
    ("keys", "opened"),
    [({}, False), ({"peer_ledger": True}, True), ({"peers": [1], "peer_ledger": False}, False)],
)
def test_the_peer_ledger_is_opened_where_asked_or_where_peers_are_borrowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, keys: dict[str, Any], opened: bool
) -> None:
    """An instance that only lends its link announces its traffic with
    ``peer_ledger: true``; one that borrows may turn the ledger off."""
    monkeypatch.setattr(peers, "LEDGER_DIRECTORY", str(tmp_path))
    fake = FakeRuntime(devices=2)
    try:
        backend, layout = _cuda_backend_over(fake, monkeypatch, num_blocks=8)
        config = parse_extra_config({"cpu_bytes_to_use": 1 << 20, "strategy": "staged", **keys})
        handlers, tier = backend.build(layout, 4, config)
        try:
            ledgers = {h.ledger for h in handlers}  # type: ignore[attr-defined]
            assert (ledgers != {None}) is opened
            for ledger in ledgers - {None}:
                ledger.close()
        finally:
            tier.release()
    finally:
        fake.close()


def test_peers_auto_without_a_peer_keeps_the_native_launch_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``"peers": "auto"`` on a device that reaches no peer borrows nothing and does not
    give up the native launch for it (no split job to launch from Python)."""
    fake = FakeRuntime()
    try:
        backend, layout = _cuda_backend_over(fake, monkeypatch, num_blocks=8)
        config = parse_extra_config({"cpu_bytes_to_use": 1 << 20, "peers": "auto"})
        handlers, tier = backend.build(layout, 4, config)
        try:
            assert [h.borrowed for h in handlers] == [(), ()]  # type: ignore[attr-defined]
            assert [h.config.native_launch for h in handlers] == ["auto", "auto"]  # type: ignore[attr-defined]
            assert SPLIT_FROM_PYTHON not in [h.native_note for h in handlers]  # type: ignore[attr-defined]
        finally:
            tier.release()
    finally:
        fake.close()


def test_npu_platform_without_its_runtime_is_refused_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform, "NPU_RUNTIME", "offload_engine.runtimes.no_such:NpuRuntime")
    with pytest.raises(RuntimeUnavailableError, match=r"vLLM runs on NPU.*no_such is missing"):
        select_backend(FakePlatform("npu"))


def test_runtime_module_whose_dependency_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_import(name: str, *args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError("No module named 'cuda'", name="cuda")

    monkeypatch.setattr("importlib.import_module", failing_import)
    with pytest.raises(
        RuntimeUnavailableError, match=r"cannot be imported: No module named 'cuda'"
    ):
        select_backend(FakePlatform("cuda"))


def test_rocm_and_unknown_platforms_are_refused() -> None:
    with pytest.raises(RuntimeUnavailableError, match="ROCm"):
        select_backend(FakePlatform("cuda", rocm=True))
    with pytest.raises(RuntimeUnavailableError, match=r"device_type='xpu'.*cpu, cuda, npu"):
        select_backend(FakePlatform("xpu"))
    with pytest.raises(RuntimeUnavailableError, match="device_type=None"):
        select_backend(object())
