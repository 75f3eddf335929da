"""``offload-engine bench --tier remote``: the engine, the raw client and redis-benchmark
measured on a real server, and the report written (a tiny plan: correctness, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload_engine.bench.remote import RemotePlan, run_remote_bench
from offload_engine.cli import main
from tests.remote.conftest import REDIS_MISSING, skip_unless_installed

TINY = RemotePlan(volume_mib=2, chunk_mib=(0.5,), concurrency=(1, 2), reps=1)


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
def test_each_case_measures_engine_and_raw(backend: str) -> None:
    skip_unless_installed(backend)
    points = run_remote_bench(backend, TINY)
    assert [(p.chunk_bytes, p.concurrency) for p in points] == [(1 << 19, 1), (1 << 19, 2)]
    for p in points:
        assert p.chunks == 4 and p.engine_put_gbps > 0 and p.raw_get_gbps > 0
        assert all(c > 0 for c in p.cpu_ms_per_mib) and p.submit_us_per_chunk > 0
        assert (p.redis_benchmark_set_gbps is not None) == (backend == "redis")


@pytest.mark.skipif(REDIS_MISSING is not None, reason=str(REDIS_MISSING))
def test_the_command_writes_a_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(RemotePlan, "quick", classmethod(lambda cls: TINY))
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe: rich would assume 80 columns
    assert main(["bench", "--tier", "remote", "--backend", "redis", "--quick", "-o",
                 str(tmp_path)]) == 0  # fmt: skip
    # the table into a pipe keeps every value whole, one row a line
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│ redis ")]
    assert len(rows) == 2 and "…" not in out, out
    assert "┃ CPU ms/MiB put e/r ┃" in out  # headers on one line too
    report = json.loads((tmp_path / "remote-report.json").read_text())
    assert report["schema"] == "offload-engine-bench-remote/1"
    assert report["command"].startswith("offload-engine bench --tier remote")
    assert len(report["points"]) == 2 and report["plan"]["volume_mib"] == 2
    assert "RDMA" in report["loopback_cannot_show"]
