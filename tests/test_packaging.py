"""How the project installs: ``connectors/`` as ``offload_engine.connectors``, and nothing at the
top level but ``offload_engine`` (the name ``connectors`` belongs to another PyPI project)."""

from __future__ import annotations

import csv
import email
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "offload_engine", "connectors")

# Imports the adapter from the install under test, without vLLM. Run with that install first on
# sys.path and the checkout's root absent, so the checkout's own offload_engine/ cannot stand in.
CHECK = textwrap.dedent(
    """
    import sys
    sys.modules["vllm"] = None  # the adapter's config must not import vLLM
    import offload_engine.connectors.vllm as adapter
    from offload_engine.connectors.vllm import parse_extra_config
    print("adapter", adapter.__file__)
    parse_extra_config({"cpu_bytes_to_use": 1024})
    try:
        adapter.EngineOffloadingSpec
    except ImportError as exc:
        assert "needs vLLM" in str(exc), exc
    else:
        raise AssertionError("EngineOffloadingSpec imported without vLLM")
    print("ok")
    """
)


def _run_check(tmp_path: Path, first: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = f"import sys; sys.path.insert(0, {str(first)!r})\n" + CHECK
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.split("\n")
    assert lines[-2] == "ok", proc.stdout
    return dict(line.split(" ", 1) for line in lines[:-2])


def _record(wheel: zipfile.ZipFile) -> list[str]:
    """The paths the wheel's RECORD lists: what an install writes into site-packages."""
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    return [row[0] for row in csv.reader(io.StringIO(wheel.read(name).decode())) if row]


def test_wheel_installs_connectors_under_offload_engine(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(wheels), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    [wheel] = wheels.glob("offload_engine-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    installed = _record(archive)
    assert set(installed) == names
    # nothing at the top level but offload_engine/ and its metadata: no connectors/ portion
    tops = {n.split("/", 1)[0] for n in installed}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"offload_engine"}, tops
    assert [n for n in installed if n.startswith("connectors/")] == []
    # every module of connectors/ and offload_engine/ is in the wheel, under offload_engine/
    expected = {
        f"offload_engine/connectors/{p.relative_to(ROOT / 'connectors')}"
        for p in (ROOT / "connectors").rglob("*.py")
    } | {str(p.relative_to(ROOT)) for p in (ROOT / "offload_engine").rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    assert "offload_engine/device/runtimes/_native_launch.c" in names  # built on first use

    # what `pip show` and an index page show
    [meta_name] = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(archive.read(meta_name))
    assert meta["Name"] == "offload-engine" and meta["License-Expression"] == "Apache-2.0"
    assert meta["Author"] and meta["Maintainer"] and meta["Keywords"]
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.12" in classifiers
    assert "Typing :: Typed" in classifiers

    target = tmp_path / "site"
    archive.extractall(target)
    files = _run_check(tmp_path, target)
    assert Path(files["adapter"]).is_relative_to(target / "offload_engine" / "connectors")


# The adapter's one import path is offload_engine.connectors.vllm; a bare ``connectors.vllm``
# names another project's package (or nothing). Only this file may spell it.
OLD_PATH_ALLOWED = {"tests/test_packaging.py"}
OLD_PATH = re.compile(r"(^|[^\w.])connectors\.vllm")


def _sources() -> list[Path]:
    dirs = ("offload_engine", "connectors", "tests", "docs", "benchmarks", "examples", "tools")
    found = [p for d in dirs for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
    return found + [p for p in ROOT.glob("*") if p.suffix in (".py", ".md", ".toml")]


def test_no_file_uses_the_top_level_connectors_path() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _sources()
        if str(p.relative_to(ROOT)) not in OLD_PATH_ALLOWED
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if OLD_PATH.search(line)
    ]
    assert offenders == [], (
        "write offload_engine.connectors.vllm (no connectors package installs at the top level)"
    )


def test_connectors_import_each_other_relatively() -> None:
    # mypy checks the folder as the package `connectors`: an absolute offload_engine.connectors
    # import inside it cannot be resolved there (the name exists only once installed)
    absolute = re.compile(r"^\s*(from|import)\s+(offload_engine\.)?connectors\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "connectors").rglob("*.py")
        if absolute.search(p.read_text())
    ]
    assert offenders == [], "inside connectors/, import sibling modules relatively (from .x import)"
