"""``offload-engine bench --tier disk``: the engine, fio and vLLM's fs tier, one run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from offload_engine.cli import main


def test_quick_disk_bench_writes_a_report_with_every_system(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    drive = tmp_path / "drive"
    drive.mkdir()
    out = tmp_path / "out"
    assert main(["bench", "--tier", "disk", "--quick", "--dir", str(drive), "-o", str(out)]) == 0
    report = json.loads((out / "disk-report.json").read_text())
    systems = {(f["system"], f["direction"]) for f in report["figures"]}
    assert {("engine", "write"), ("engine", "read")} <= systems
    if shutil.which("fio"):
        assert {("fio", "write"), ("fio", "read")} <= systems
        assert set(report["ratios"]) >= {"write engine/fio", "read engine/fio"}
    for f in report["figures"]:
        assert f["gbps"] > 0 and f["seconds"] > 0
        if f["system"] != "fio":
            assert f["submit_us_per_chunk"] > 0
    assert report["command"].startswith("offload-engine bench --tier disk")
    assert list(drive.iterdir()) == []  # the bench cleans up after itself
    assert "disk tier, cold (O_DIRECT)" in capsys.readouterr().out


def test_disk_bench_needs_an_existing_directory(tmp_path: Path) -> None:
    code = main(
        ["bench", "--tier", "disk", "--quick", "--dir", str(tmp_path / "no"), "-o", str(tmp_path)]
    )
    assert code != 0
