"""``pytest --require-deps`` (``tests/required_deps.py``, what ``.ci/run`` passes): a skip
for a dependency the README's test command installs fails the run; other skips do not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from offload_engine.remote.mooncake_store import NOT_INSTALLED, mooncake_import_problem
from tests.required_deps import missing_group, promised_groups

ROOT = Path(__file__).resolve().parents[1]

NO_VERBS = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")


@pytest.mark.parametrize(
    ("reason", "group"),
    [
        # pytest.importorskip, at the top of the vLLM test modules
        ("could not import 'vllm.v1.kv_offload.base': No module named 'vllm'", "vLLM"),
        (
            "vLLM 0.33.0 source not found at /x/.vllm-src/0.33.0: "
            "python tools/fetch_vllm_source.py 0.33.0 /x/.vllm-src/0.33.0",
            "vLLM",
        ),
        ("redis-server is not installed (apt-get install redis-server)", "Redis"),
        ("needs redis-server (apt-get install redis-server)", "Redis"),
        ("needs openssl and redis-server", "Redis"),
        ("needs redis-server and redis-cli", "Redis"),
        (NOT_INSTALLED, "Mooncake"),
        (mooncake_import_problem(NO_VERBS), "Mooncake"),
        (
            "MooncakeMaster needs the mooncake_master binary "
            "(pip install mooncake-transfer-engine-non-cuda)",
            "Mooncake",
        ),
        # what stays a skip: hardware, slow variants, a compiler or a mount refused here
        ("needs a CUDA device", None),
        ("torch has CUDA", None),
        ("slow variant: pass --run-slow or set OFFLOAD_ENGINE_SLOW=1", None),
        ("no C compiler ($CC or cc) to build the native launch", None),
        ("mounting a tmpfs is refused here", None),
        ("needs EngineTieringSpec (issue [tiering])", None),
    ],
)
def test_reasons_that_name_a_promised_dependency(reason: str, group: str | None) -> None:
    if group is not None and group not in promised_groups():
        pytest.skip(f"the README's test command does not install {group} on this machine")
    assert missing_group(reason) == group


SKIPS = """
import pytest

def test_needs_redis():
    pytest.skip("redis-server is not installed (apt-get install redis-server)")

def test_needs_cuda():
    pytest.skip("needs a CUDA device")

def test_runs():
    pass
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest on the tests in ``tmp_path``, with this plugin loaded on its own."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.required_deps", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), *args, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


#: a module skipped as it is collected (as pytest.importorskip does)
MODULE_SKIP = """
import pytest

pytest.skip("needs redis-server (apt-get install redis-server)", allow_module_level=True)
"""


def test_the_option_fails_a_run_that_skipped_for_a_missing_dependency(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_skips.py").write_text(SKIPS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    # a folder with its own conftest.py, as the suite has: collecting beside it, pytest
    # calls the hooks of every plugin but that conftest (pluggy needs them hashable)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "conftest.py").write_text("")
    (tmp_path / "sub" / "test_sub.py").write_text("def test_here():\n    pass\n")
    without = _pytest(tmp_path)
    assert without.returncode == 0, without.stdout
    found = _pytest(tmp_path, "--require-deps")
    assert found.returncode == 1, found.stdout
    assert "--require-deps: skipped for a missing dependency" in found.stdout
    assert (
        "Redis: test_skips.py::test_needs_redis: redis-server is not installed "
        "(apt-get install redis-server)"
    ) in found.stdout
    assert "Redis: test_module_skip.py: needs redis-server" in found.stdout
    assert "test_needs_cuda" not in found.stdout.split("skipped for a missing dependency")[1]


def test_the_option_lets_other_skips_pass(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    other = SKIPS.replace(
        "redis-server is not installed (apt-get install redis-server)", "no C compiler (cc)"
    )
    (tmp_path / "test_skips.py").write_text(other)
    run = _pytest(tmp_path, "--require-deps")
    assert run.returncode == 0, run.stdout
    assert "skipped for a missing dependency" not in run.stdout
