"""``CUDA_DEVICE_MAX_CONNECTIONS`` below CUDA's default: a note in ``info`` and the runtime.

With fewer hardware queues than streams, a load's DMAs queue behind model kernels
that wait for SMs (docs/performance.md, session 6: staged loads under a long GEMM
at about half the rate with 1). Training stacks set 1, so a serving engine
started in their environment inherits it; the probe must say so.
"""

from __future__ import annotations

import json

import pytest
import torch

from offload_engine.cli import main
from offload_engine.device.runtimes import probe as runtimes
from offload_engine.runtimes import CUDA_DEFAULT_CONNECTIONS, connections_note


@pytest.mark.parametrize("value", ["1", "2", str(CUDA_DEFAULT_CONNECTIONS - 1)])
def test_fewer_connections_than_cuda_default_give_a_note(value: str) -> None:
    note = connections_note({"CUDA_DEVICE_MAX_CONNECTIONS": value})
    assert note is not None
    assert note.startswith(f"CUDA_DEVICE_MAX_CONNECTIONS={value} (CUDA's default is 8)")
    assert "share hardware queues" in note


@pytest.mark.parametrize("value", [None, "8", "32", "0", "-1", "many", ""])
def test_default_or_more_or_unparsable_give_none(value: str | None) -> None:
    environ = {} if value is None else {"CUDA_DEVICE_MAX_CONNECTIONS": value}
    assert connections_note(environ) is None


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert connections_note() == connections_note({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert connections_note() is None


@pytest.fixture
def simulated_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """probe_cuda's view of a machine with one CUDA device (nothing is initialised)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Simulated GPU")


def test_probe_and_info_show_the_note(
    simulated_cuda: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert not any("CUDA_DEVICE_MAX_CONNECTIONS" in n for n in runtimes.probe_cuda().notes)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    found = runtimes.probe_cuda()
    assert found.available
    assert connections_note() in found.notes
    assert main(["info", "--json"]) == 0
    cuda = json.loads(capsys.readouterr().out)[0]
    assert cuda["name"] == "cuda" and connections_note() in cuda["notes"]


def test_a_dotted_module_of_a_missing_package_is_not_importable() -> None:
    # find_spec("cuda.bindings") raises without the ``cuda`` package (no cuda-python);
    # probe_cuda, and so ``info``, crashed there on a CUDA machine
    assert runtimes._importable("no_such_package_for_offload_engine.bindings") is False
    assert runtimes._importable("importlib.util") is True


def test_probe_on_a_cuda_machine_without_cuda_python(
    simulated_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = runtimes._importable
    monkeypatch.setattr(runtimes, "_importable", lambda n: n != "cuda.bindings" and real(n))
    found = runtimes.probe_cuda()
    assert "cuda-python is not installed: dma copies one descriptor at a time" in found.notes
