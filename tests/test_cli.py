"""The offload-engine command: info, demo, bench, usage errors and exit codes.

In-process runs call ``main([...])``; a few runs go through a subprocess
(``python -m offload_engine``) to check what a shell sees. CUDA is simulated
absent (or present but unwired) by replacing ``runtimes.probe_cuda``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_engine import Direction, LaunchedJob, Medium
from offload_engine.bench.cuda import open_rig
from offload_engine.bench.rigs import RigShape, open_device_rig, open_host_rig
from offload_engine.cli import EXIT_UNAVAILABLE, main
from offload_engine.cli._demo import check_demo_sizes, run_demo
from offload_engine.device.runtimes import probe as runtimes
from offload_engine.errors import InsufficientMemoryError
from offload_engine.host.handler import HostCopyHandler, HostPlan
from offload_engine.runtimes import RuntimeInfo
from offload_engine.testing import FakeRuntime

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = RuntimeInfo("cuda", False, "no CUDA device is visible (simulated)")
FAKE_CUDA = RuntimeInfo("cuda", True, "simulated", ("cuda:0 Simulated GPU",), ("dma",))
cpu_torch_only = pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA")


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtimes, "probe_cuda", lambda: NO_CUDA)


@pytest.fixture
def visible_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """probe_cuda() reports a device, but this torch has no CUDA: the runtime cannot start."""
    monkeypatch.setattr(runtimes, "probe_cuda", lambda: FAKE_CUDA)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "offload_engine", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


# ---------------------------------------------------------------- info


def test_info_lists_every_runtime_and_why_cuda_is_missing(
    no_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for text in ("cuda", "npu", "cpu", "unavailable", "simulated", "host-copy"):
        assert text in out
    assert "run on: host memory (CUDA: no CUDA device is visible (simulated))" in out


def test_info_states_the_auto_strategys_rule(
    no_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "device strategy auto (the default), per job: dma when every region is >= 512 KiB or "
        "a job needs <= 256 descriptors (<= 512 while >= 128 MiB are in flight and every region "
        "is >= 128 KiB), else staged"
    ) in out


def test_info_says_why_demo_and_bench_do_not_offer_the_npu(
    no_cuda: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    npu = RuntimeInfo("npu", True, "simulated", ("npu:0",), ("dma", "staged"))
    monkeypatch.setattr(runtimes, "probe_npu", lambda: npu)
    assert main(["info"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "demo and bench: no --device npu yet: their NPU path has not run on Ascend" in out
    with pytest.raises(SystemExit):
        main(["demo", "--device", "npu"])
    assert "invalid choice: 'npu'" in capsys.readouterr().err


def test_info_json(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in found] == ["cuda", "npu", "cpu"]
    assert found[0] == {
        "name": "cuda",
        "available": False,
        "reason": NO_CUDA.reason,
        "devices": [],
        "strategies": [],
        "notes": [],
    }
    assert found[2]["available"] is True and found[2]["strategies"] == ["host-copy"]


# ---------------------------------------------------------------- demo


def test_demo_quick_passes_its_integrity_check(
    no_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "200 steps" in out
    assert "note: no CUDA (no CUDA device is visible (simulated)); running on host memory" in out
    assert "integrity: every load checked when it completed: " in out
    assert " blocks compared byte for byte with their sources" in out and "0 corrupt" in out
    for text in ("store", "load", "GB/s", "p50 ms", "p99 ms", "CPU per step"):
        assert text in out


def test_demo_report_counts_what_it_moved() -> None:
    rig = open_host_rig(RigShape(num_layers=2, num_blocks=256, tier_blocks=128), workers=2)
    try:
        report = run_demo(rig, steps=60, blocks_per_job=4, max_outstanding=8)
    finally:
        rig.close()
    assert report.ok
    assert report.store.jobs == 60 and report.load.jobs > 0
    for tally in (report.store, report.load):
        assert tally.failed == 0
        assert tally.bytes_moved == tally.jobs * 4 * rig.block_bytes
        assert len(tally.latencies_ms) == tally.jobs
    # every successful load was checked, each of its blocks
    assert report.loads_checked == report.load.jobs
    assert report.checked == report.load.jobs * 4 > 128  # more than the 128 destination blocks
    assert report.caller_cpu_s > 0 and report.process_cpu_s >= report.caller_cpu_s


class CorruptingHostHandler(HostCopyHandler):
    """Copies as the host handler does, then flips one byte of the 3rd load's last block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loads = 0

    def execute(self, job: LaunchedJob[HostPlan]) -> int:
        nbytes = super().execute(job)
        if job.prepared.direction is Direction.LOAD:
            self.loads += 1
            if self.loads == 3:
                block = int(job.spec.dst.block_ids[-1])
                self.layout.tensors[0][block].view(torch.uint8).view(-1)[7] ^= 0xFF
        return nbytes


def test_demo_catches_a_load_corrupted_after_the_copy() -> None:
    rig = open_host_rig(RigShape(num_layers=2, num_blocks=256, tier_blocks=128), workers=1)
    handler = CorruptingHostHandler(rig.layout, rig.tier, workers=1)
    rig.handlers = [handler]
    try:
        report = run_demo(rig, steps=40, blocks_per_job=4, max_outstanding=4)
    finally:
        rig.close()
    assert handler.loads > 3
    assert report.corrupt == 1 and not report.ok
    assert report.loads_checked == report.load.jobs


def test_integrity_check_sees_a_corrupt_block() -> None:
    rig = open_host_rig(RigShape(num_layers=2, num_blocks=16, tier_blocks=4))
    try:
        for t in rig.layout.tensors:
            t[8:12] = t[0:4]  # blocks 8..11 become copies of 0..3
        assert rig.mismatched([8, 9, 10, 11], [0, 1, 2, 3]) == 0
        rig.layout.tensors[-1][10, 1, 3, 0, 5] += 1  # one element of one block, last layer
        assert rig.mismatched([8, 9, 10, 11], [0, 1, 2, 3]) == 1
        assert rig.mismatched([], []) == 0
    finally:
        rig.close()


@cpu_torch_only
def test_auto_falls_back_to_host_when_the_cuda_runtime_cannot_start(
    visible_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rig, notes = open_rig("auto", RigShape(num_layers=1, num_blocks=8, tier_blocks=4))
    rig.close()
    assert rig.medium == "host"
    assert notes == [
        "CUDA is present but not used: CUDA is not available: torch is a CPU-only build; "
        "running on host memory"
    ]
    assert main(["info"]) == 0
    assert "run on: the GPU, cuda:0 Simulated GPU" in capsys.readouterr().out


def test_demo_on_a_device_rig_passes_its_integrity_check() -> None:
    runtime = FakeRuntime()  # device memory is host memory, streams are threads
    try:
        shape = RigShape(num_layers=2, num_blocks=128, tier_blocks=64, kv_heads=2, head_dim=32)
        rig = open_device_rig(runtime, shape, empty=runtime.empty, medium="fake:0")
        assert [h.pair for h in rig.handlers] == [
            (Medium.GPU, Medium.CPU),
            (Medium.CPU, Medium.GPU),
        ]
        try:
            report = run_demo(rig, steps=40, blocks_per_job=4, max_outstanding=8)
        finally:
            rig.close()
    finally:
        runtime.close()
    assert report.ok and report.checked > 0
    assert report.store.jobs == 40 and report.load.jobs > 0
    assert rig.tier.released


# tier 512 blocks, cache 1,024 as in the demo: the combinations where 512 / blocks-per-job is
# at most max-outstanding (in-flight stores could hold the whole tier), and their neighbours
@pytest.mark.parametrize(
    ("blocks_per_job", "max_outstanding"),
    [(32, 16), (31, 16), (32, 15), (8, 64), (8, 65), (8, 1000), (32, 1000), (1, 1), (32, 1),
     (1, 512), (1, 513), (16, 32), (16, 33)],
)  # fmt: skip
def test_every_demo_step_stores_and_loads_whatever_the_options(
    blocks_per_job: int, max_outstanding: int
) -> None:
    shape = RigShape(num_layers=1, num_blocks=1024, tier_blocks=512, kv_heads=1, head_dim=8)
    rig = open_host_rig(shape, workers=2)
    try:
        report = run_demo(
            rig, steps=30, blocks_per_job=blocks_per_job, max_outstanding=max_outstanding
        )
    finally:
        rig.close()
    assert report.ok
    assert report.store.jobs == report.load.jobs == report.loads_checked == 30
    assert report.checked == 30 * blocks_per_job and report.corrupt == 0


def test_demo_refuses_a_rig_too_small_for_its_jobs() -> None:
    check_demo_sizes(tier_blocks=64, cache_blocks=64, blocks_per_job=32)
    with pytest.raises(ValueError, match="need a tier of at least 66 blocks"):
        check_demo_sizes(tier_blocks=65, cache_blocks=1024, blocks_per_job=33)
    with pytest.raises(ValueError, match="a cache of at least 64"):
        check_demo_sizes(tier_blocks=512, cache_blocks=62, blocks_per_job=32)


@pytest.mark.parametrize(
    "options",
    [
        ["--blocks-per-job", "32"],
        ["--blocks-per-job", "31"],
        ["--max-outstanding", "65"],
        ["--max-outstanding", "1000"],
    ],
)
def test_demo_options_at_their_limits_store_load_and_check(
    options: list[str], no_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--quick", "--steps", "40", "--layers", "1", *options])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "integrity: every load checked when it completed: 40 loads, " in out
    assert "nan" not in out and "0 corrupt" in out


# ---------------------------------------------------------------- bench


def test_bench_quick_writes_its_report_and_figures(
    no_cuda: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "nested" / "out"
    assert main(["bench", "--quick", "-o", str(out_dir), "--machine-label", "test VM"]) == 0
    assert "wrote" in capsys.readouterr().out
    report = json.loads((out_dir / "report.json").read_text())
    assert report["schema"] == "offload-engine-bench/1"
    assert report["command"] == (
        f"offload-engine bench --quick -o {out_dir} --machine-label 'test VM'"
    )
    assert report["quick"] is True
    assert report["machine"]["label"] == "test VM" and report["machine"]["cores"] >= 1
    assert report["gpu"] == {"run": False, "reason": f"no CUDA: {NO_CUDA.reason}"}
    sweep = report["transfers"]["sweep"]
    assert {(p["direction"], p["blocks_per_job"]) for p in sweep} == {
        (d, n) for d in ("store", "load") for n in (1, 8, 64)
    }
    for p in sweep:
        assert p["strategy"] == "host-copy" and p["gbps"] > 0
        assert len(p["wall_s"]) == report["plan"]["repeats"] == 1
        assert p["bytes_moved"] == p["jobs"] * p["blocks_per_job"] * p["block_bytes"]
    latency = report["transfers"]["latency"]
    assert {(s["direction"], s["depth"]) for s in latency} == {
        (d, k) for d in ("store", "load") for k in (1, 16)
    }
    assert all(len(s["latencies_ms"]) == s["jobs"] == 100 for s in latency)
    assert set(report["overhead"]["hosts"]) >= {"async_asyncio", "sync"}
    for name in ("throughput.png", "latency.png"):
        data = (out_dir / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_bench_output_dir_under_a_file_is_a_usage_error_naming_o(
    tier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--tier", tier, "-o", str(blocker / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"offload-engine bench: error: -o {blocker / 'out'}: {blocker} is not a directory\n"
    )
    assert "Traceback" not in err


def test_bench_output_dir_it_cannot_create_is_one_line_naming_o(
    no_cuda: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def refused(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refused)
    assert main(["bench", "--quick", "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (
        f"offload-engine bench: error: -o {tmp_path / 'out'}: cannot create it: Permission denied\n"
    )


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--bogus", "--worse"], "unrecognized arguments: --bogus --worse"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--steps", "0"], "argument --steps: 0 is not positive"),
        (["demo", "--steps", "many"], "argument --steps: 'many' is not an integer"),
        (["demo", "--blocks-per-job", "33"], "--blocks-per-job 33 is too large (at most 32)"),
        (["demo", "--workers", "100000"], "--workers: 100000 threads is too many (at most 256)"),
        (["bench", "--workers", "257"], "--workers: 257 threads is too many (at most 256)"),
        (
            ["bench", "--tier", "disk", "--queue-depth", "100000"],
            "--queue-depth: 100000 threads is too many (at most 256)",
        ),
        (["bench", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["bench", "--dir", "/tmp"], "--dir is for --tier disk, not --tier host"),
        (
            ["bench", "--tier", "remote", "--dir", "."],
            "--dir is for --tier disk, not --tier remote",
        ),
        (["bench", "--queue-depth", "8"], "--queue-depth is for --tier disk, not --tier host"),
        (["bench", "--chunk-mib", "2"], "--chunk-mib is for --tier disk, not --tier host"),
        (
            ["bench", "--tier", "disk", "--backend", "redis"],
            "--backend is for --tier remote, not --tier disk",
        ),
        (["bench", "--device", "cpu", "--ttft-stores"], "--ttft-stores is a GPU pass"),
        (["bench", "-o", "/dev/null"], "-o /dev/null is not a directory"),
        (
            ["bench", "--tier", "disk", "--dir", "/nonexistent/x"],
            "--dir /nonexistent/x is not a directory",
        ),
        (["bench", "--tier", "disk", "--ttft-stores"], "--ttft-stores is a GPU pass"),
    ],
)
def test_bad_usage_exits_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = (
        " ".join(["offload-engine", *argv[:1]])
        if argv[:1] in (["demo"], ["bench"])
        else "offload-engine"
    )
    assert err.startswith(f"usage: {prog} ")
    assert f"\n{prog}: error: " in err and message in err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_device_cuda_without_cuda_is_one_clear_line(
    command: str, no_cuda: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                command,
                "--device",
                "cuda",
                "--quick",
                *(["-o", str(tmp_path)] * (command == "bench")),
            ]
        )
        == EXIT_UNAVAILABLE
    )
    captured = capsys.readouterr()
    assert captured.err == (
        f"offload-engine {command}: error: --device cuda: CUDA is not available: {NO_CUDA.reason}\n"
    )
    assert list(tmp_path.iterdir()) == []  # nothing was measured or written


@cpu_torch_only
def test_device_cuda_when_the_cuda_runtime_cannot_start(
    visible_cuda: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--device", "cuda"]) == EXIT_UNAVAILABLE
    assert main(["bench", "--device", "cuda", "-o", str(tmp_path)]) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err.splitlines()
    why = "--device cuda: CUDA is not available: torch is a CPU-only build"
    assert err == [f"offload-engine demo: error: {why}", f"offload-engine bench: error: {why}"]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- as a shell sees it


def test_console_script_points_at_main() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"offload-engine": "offload_engine.cli:main"}


def test_subprocess_bad_flag_exits_2() -> None:
    usage = run_cli("demo", "--bogus")
    assert usage.returncode == 2
    assert usage.stderr.startswith("usage: offload-engine demo") and "Traceback" not in usage.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_subprocess_device_cuda_without_cuda() -> None:
    proc = run_cli("demo", "--device", "cuda")
    assert proc.returncode == EXIT_UNAVAILABLE
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("offload-engine demo: error: --device cuda: CUDA is not available: ")


def test_demo_too_large_for_memory_is_one_clear_line(
    no_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # a 15.3 TiB KV cache and a 7.6 TiB tier, refused before anything is allocated
    code = main(["demo", "--layers", "1000000", "--device", "cpu", "--quick"])
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("offload-engine demo: error: --layers 1000000: the KV cache and the tier")
    assert "need 22.9 TiB of host memory" in err and "Traceback" not in err


def test_memory_messages_use_a_unit_people_read(
    no_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--layers", "100000000", "--device", "cpu", "--quick"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    assert "need 2.2 PiB of host memory" in err


def test_a_thread_the_system_refuses_is_one_line(
    no_cuda: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name.startswith("offload-engine-host"):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    code = main(["demo", "--quick", "--layers", "1", "--workers", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines() == [
        "offload-engine demo: error: --workers 3: the system would not start another thread "
        "(can't start new thread); ask for fewer threads or raise the process limit (ulimit -u)"
    ]


def test_other_runtime_errors_are_not_taken_for_a_thread_limit(
    no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from offload_engine.cli import _demo

    def broken(args: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(_demo, "cmd_demo", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["demo", "--quick"])


@pytest.mark.parametrize(
    ("backend", "blocked", "why"),
    [
        ("redis", "redis", "the redis client is not installed"),
        ("mooncake", "mooncake.store", "the Mooncake client is not installed"),
        ("both", "mooncake.store", "the Mooncake client is not installed"),
    ],
)
def test_bench_remote_without_its_client_is_one_line(
    backend: str,
    blocked: str,
    why: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, blocked, None)  # import raises ImportError
    argv = ["bench", "--quick", "--tier", "remote", "--backend", backend, "-o", str(tmp_path)]
    assert main(argv) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"offload-engine bench: error: --tier remote --backend {backend}: {why}: "
        + err.split(f"{why}: ", 1)[1].rstrip("\n")
    ]
    assert "pip install -e '.[remote]'" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no server started, nothing written


def test_bench_disk_chunks_too_large_for_memory_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--quick", "--tier", "disk", "--dir", str(tmp_path), "--chunk-mib", "100000"]
    assert main([*argv, "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "offload-engine bench: error: 32 chunks of 100000 MiB need 9.2 TiB of host memory (the "
        "data, the host tier and vLLM's buffer), but only "
        + err.split("but only ", 1)[1].rstrip("\n")
    ]
    assert list(tmp_path.iterdir()) == []  # refused before any directory or file


def test_memory_check_counts_the_cache_and_the_tier() -> None:
    shape = RigShape(num_layers=8, num_blocks=1024, tier_blocks=512)
    assert shape.block_bytes == 128 * 1024
    need = shape.cache_bytes + shape.tier_bytes + 2 * shape.cache_bytes // 8
    shape.check_memory(cache_on_host=True, available=need)
    with pytest.raises(InsufficientMemoryError, match=r"the KV cache and the tier need 0\.2 GiB"):
        shape.check_memory(cache_on_host=True, available=need - 1)
    shape.check_memory(cache_on_host=False, available=need - shape.cache_bytes)
    with pytest.raises(InsufficientMemoryError, match="the tier need"):
        shape.check_memory(cache_on_host=False, available=need - shape.cache_bytes - 1)


def test_help_epilog_names_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["demo", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        for text in (
            "0 success",
            "1 the run failed",
            "2 usage error",
            "3 the requested device",
            "130 interrupted",
        ):
            assert text in out, (argv, text)
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    for status in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 130 |"):
        assert status in cli_md, status
