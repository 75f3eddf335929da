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
    [run] = report["runs"]
    systems = {(f["system"], f["direction"]) for f in run["figures"]}
    assert {("engine", "write"), ("engine", "read")} <= systems
    if shutil.which("fio"):
        assert {("fio", "write"), ("fio", "read")} <= systems
        assert set(run["ratios"]) >= {"write engine/fio", "read engine/fio"}
        assert "1 MiB write engine/fio" in report["ratios"]
    for f in run["figures"]:
        assert f["gbps"] > 0 and f["seconds"] > 0
        if not f["system"].startswith("fio"):
            assert f["submit_us_per_chunk"] > 0
    assert report["command"].startswith("offload-engine bench --tier disk")
    assert list(drive.iterdir()) == []  # the bench cleans up after itself
    assert "cold (O_DIRECT)" in capsys.readouterr().out


def test_small_chunks_are_compared_with_one_file_each_and_with_1_mib_requests(
    tmp_path: Path,
) -> None:
    drive = tmp_path / "drive"
    drive.mkdir()
    argv = ["bench", "--tier", "disk", "--quick", "--chunk-mib", "0.25,1", "--dir", str(drive)]
    assert main([*argv, "-o", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "disk-report.json").read_text())
    small, large = report["runs"]
    assert (small["plan"]["chunk_bytes"], large["plan"]["chunk_bytes"]) == (2**18, 2**20)
    assert {"engine", "engine-files"} <= {f["system"] for f in small["figures"]}
    assert "engine-files" not in {f["system"] for f in large["figures"]}
    assert "0.25 MiB write engine/engine-files" in report["ratios"]
    if shutil.which("fio"):
        assert "0.25 MiB read engine/fio-1m" in report["ratios"]
        assert "1 MiB read engine/fio-1m" not in report["ratios"]


def test_chunk_sizes_must_be_whole_kib(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--tier", "disk", "--chunk-mib", "0.0001", "--dir", str(tmp_path)])


def test_disk_bench_needs_an_existing_directory(tmp_path: Path) -> None:
    code = main(
        ["bench", "--tier", "disk", "--quick", "--dir", str(tmp_path / "no"), "-o", str(tmp_path)]
    )
    assert code != 0
