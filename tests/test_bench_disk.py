"""``offload-engine bench --tier disk``: the engine, fio and vLLM's fs tier, one run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from offload_engine import ConfigError
from offload_engine.bench.disk import DiskBenchPlan, bench_engine, engine_sizes
from offload_engine.cli import build_parser, main
from offload_engine.cli._bench import _disk_plans
from offload_engine.disk import DiskStore
from offload_engine.disk.store import MAX_QUEUE_DEPTH
from tests.test_disk import _mounted, digest


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
    # the raw threads: what a reader landing each chunk in its own memory gets
    assert {("raw", "write"), ("raw", "read"), ("raw-reused", "read")} <= systems
    assert {"write engine/raw", "read engine/raw"} <= set(run["ratios"])
    if shutil.which("fio"):
        assert {("fio", "write"), ("fio", "read")} <= systems
        assert set(run["ratios"]) >= {"write engine/fio", "read engine/fio"}
        assert "1 MiB write engine/fio" in report["ratios"]
    for f in run["figures"]:
        assert f["gbps"] > 0 and f["seconds"] > 0
        if not f["system"].startswith(("fio", "raw")):
            assert f["submit_us_per_chunk"] > 0
    assert report["command"].startswith("offload-engine bench --tier disk")
    assert list(drive.iterdir()) == []  # the bench cleans up after itself
    assert "cold (O_DIRECT)" in capsys.readouterr().out


def test_small_chunks_are_compared_with_1_mib_requests(tmp_path: Path) -> None:
    drive = tmp_path / "drive"
    drive.mkdir()
    argv = ["bench", "--tier", "disk", "--quick", "--chunk-mib", "0.25,1", "--dir", str(drive)]
    assert main([*argv, "-o", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "disk-report.json").read_text())
    small, large = report["runs"]
    assert (small["plan"]["chunk_bytes"], large["plan"]["chunk_bytes"]) == (2**18, 2**20)
    for run in (small, large):
        assert {"engine", "engine-reuse"} <= {f["system"] for f in run["figures"]}
    if shutil.which("fio"):
        assert "0.25 MiB read engine/fio-1m" in report["ratios"]
        assert "1 MiB read engine/fio-1m" not in report["ratios"]


def _plans(*argv: str) -> list[DiskBenchPlan]:
    args = build_parser().parse_args(["bench", "--tier", "disk", *argv])
    return _disk_plans(args)


def test_quick_honours_chunk_and_volume_options() -> None:
    [plan] = _plans("--quick")
    assert (plan.chunk_bytes, plan.chunks, plan.chunks_per_job) == (2**20, 32, 8)
    [plan] = _plans("--quick", "--chunk-kib", "512")
    assert (plan.chunk_bytes, plan.chunks) == (2**19, 32)
    [plan] = _plans("--quick", "--chunk-kib", "512", "--volume-mib", "12", "--queue-depth", "2")
    assert (plan.chunk_bytes, plan.chunks, plan.queue_depth) == (2**19, 24, 2)
    [plan] = _plans("--chunk-kib", "256", "--volume-mib", "64")
    assert (plan.chunk_bytes, plan.chunks, plan.chunks_per_job) == (2**18, 256, 16)
    [plan] = _plans()
    assert (plan.chunk_bytes, plan.chunks) == (2 * 2**20, 256)
    [plan] = _plans("--chunk-mib", "2", "--volume-mib", "100")  # whole jobs: 50 -> 64 chunks
    assert plan.chunks == 64 and plan.chunks % plan.chunks_per_job == 0


@pytest.mark.parametrize(
    ("argv", "small"),
    [
        # what benchmarks/disk/ram_device.sh and docs/disk.md run
        (("--chunk-mib", "0.25", "--volume-mib", "256"), ("--volume-mib", "8")),
        (("--chunk-mib", "2", "--volume-mib", "256"), ("--volume-mib", "32")),
        (("--chunk-mib", "0.25,2"), ("--volume-mib", "16")),
        (("--chunk-mib", "0.25,1,2,8", "--volume-mib", "256"), None),  # arithmetic only
    ],
)
def test_the_engine_store_is_sized_by_the_store_and_holds_both_passes(
    tmp_path: Path, argv: tuple[str, ...], small: tuple[str, ...] | None
) -> None:
    """The documented sizes get a cap of whole segments that the store itself says
    holds a pass (plus a segment for the second pass to write into); the same code
    path, at a volume this machine can spare, runs both passes without a full tier."""
    for plan in _plans(*argv):
        segment, capacity = engine_sizes(plan)
        assert segment % 4096 == 0 and capacity % segment == 0
        need = DiskStore.capacity_for(plan.chunks, plan.chunk_bytes, segment_bytes=segment)
        assert capacity == need + segment
        assert need >= plan.chunks * (plan.chunk_bytes + 4096)
    if small is None:
        return
    chunk_mib = argv[1]  # every case starts with --chunk-mib SIZES
    for plan in _plans("--chunk-mib", chunk_mib, *small):
        where = tmp_path / f"store-{plan.chunk_bytes}"
        where.mkdir()
        data = plan.random_chunks()
        figures = bench_engine(where, plan, data)
        assert [(f.system, f.direction) for f in figures] == [
            ("engine", "write"), ("engine", "read"),
            ("engine-reuse", "write"), ("engine-reuse", "read"),
        ]  # fmt: skip


def test_a_plan_larger_than_host_memory_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--tier", "disk", "--quick", "--chunk-mib", "100000", "--dir", str(tmp_path)]
    assert main([*argv, "-o", str(tmp_path / "out")]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "iB of host memory" in line and "Traceback" not in line
    assert list(tmp_path.iterdir()) == []


def test_a_drive_too_small_for_the_plan_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    argv = ["bench", "--tier", "disk", "--quick", "--volume-mib", "64", "--dir", str(small)]
    with _mounted(small, "size=32m") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs is refused here")
        assert main([*argv, "-o", str(tmp_path / "out")]) == 1
        [line] = capsys.readouterr().err.splitlines()
        assert "GiB of free space" in line and "--volume-mib" in line
        assert list(small.iterdir()) == []


def test_chunk_sizes_must_be_whole_kib(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--tier", "disk", "--chunk-mib", "0.0001", "--dir", str(tmp_path)])


def test_disk_bench_needs_an_existing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench",
        "--tier",
        "disk",
        "--quick",
        "--dir",
        str(tmp_path / "no"),
        "-o",
        str(tmp_path),
    ]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2  # a usage error, as the other options' are
    assert f"error: --dir {tmp_path / 'no'} is not a directory\n" in capsys.readouterr().err


def test_a_queue_depth_beyond_the_store_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--tier", "disk", "--quick", "--queue-depth", "100000", "--dir", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "--queue-depth: 100000 threads is too many (at most 256)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="queue_depth"):
        DiskStore(tmp_path, digest(), capacity_bytes=2**30, queue_depth=MAX_QUEUE_DEPTH + 1)


def test_missing_systems_are_named_not_silently_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import offload_engine.bench.disk as bench

    monkeypatch.setattr(bench, "missing_systems", lambda: {"fio": "fio is not on PATH"})
    monkeypatch.setattr(bench, "bench_fio", lambda *a, **k: [])
    drive = tmp_path / "drive"
    drive.mkdir()
    argv = ["bench", "--tier", "disk", "--quick", "--volume-mib", "16", "--dir", str(drive)]
    assert main([*argv, "-o", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "disk-report.json").read_text())
    assert report["runs"][0]["skipped"] == {"fio": "fio is not on PATH"}
    assert "note: no fio rows: fio is not on PATH" in capsys.readouterr().out
