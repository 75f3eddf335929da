"""How the project installs: ``connectors/`` as ``offload_engine.connectors``, and the old
``connectors.vllm`` path as a warning alias that owns no ``connectors/__init__.py``."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "offload_engine", "connectors", "deprecated")

# Imports the new path, then the old one, and checks that the old one warns once and hands out
# the very same objects. Run with the install under test first on sys.path and the checkout's
# root absent (its connectors/ folder is a regular package that would shadow the alias).
CHECK = textwrap.dedent(
    """
    import sys, warnings
    sys.modules["vllm"] = None  # the alias must not import vLLM either
    import offload_engine.connectors.vllm as new
    import offload_engine.connectors.vllm.config as new_config
    print("new", new.__file__)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import connectors.vllm as old
        from connectors.vllm import parse_extra_config
        from connectors.vllm.config import EngineOffloadingConfig
        import connectors.vllm.config as old_config
    print("old", old.__file__)
    kinds = [(w.category.__name__, str(w.message)) for w in caught]
    assert len(kinds) == 1 and kinds[0][0] == "DeprecationWarning", kinds
    assert "offload_engine.connectors.vllm" in kinds[0][1], kinds
    assert old_config is new_config
    assert parse_extra_config is new.parse_extra_config
    assert EngineOffloadingConfig is new_config.EngineOffloadingConfig
    assert sorted(old.__all__) == sorted(new.__all__)
    try:
        old.EngineOffloadingSpec
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


def test_old_path_warns_and_aliases_the_new_one(tmp_path: Path) -> None:
    files = _run_check(tmp_path, ROOT / "deprecated")
    assert Path(files["old"]).is_relative_to(ROOT / "deprecated" / "connectors" / "vllm")


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
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"offload_engine", "connectors"}, tops
    # only our own portion of the shared name: no connectors/__init__.py to overwrite PyPI's
    assert "connectors/__init__.py" not in names
    assert {n for n in names if n.startswith("connectors/")} == {
        f"connectors/vllm/{p.name}" for p in (ROOT / "deprecated/connectors/vllm").glob("*.py")
    }
    # every module of connectors/ and offload_engine/ is in the wheel, under offload_engine/
    expected = {
        f"offload_engine/connectors/{p.relative_to(ROOT / 'connectors')}"
        for p in (ROOT / "connectors").rglob("*.py")
    } | {str(p.relative_to(ROOT)) for p in (ROOT / "offload_engine").rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    assert "offload_engine/device/runtimes/_native_launch.c" in names  # built on first use

    # what `pip show` and an index page show
    [meta_name] = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(meta_name))
    assert meta["Name"] == "offload-engine" and meta["License-Expression"] == "Apache-2.0"
    assert meta["Author"] and meta["Maintainer"] and meta["Keywords"]
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.12" in classifiers
    assert "Typing :: Typed" in classifiers

    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    files = _run_check(tmp_path, target)
    assert Path(files["new"]).is_relative_to(target / "offload_engine" / "connectors")
    assert Path(files["old"]).is_relative_to(target / "connectors" / "vllm")


# Where the old path may appear: the alias itself, and the pages that explain it.
OLD_PATH_ALLOWED = {
    "README.md", "setup.py", "docs/vllm.md", "docs/architecture.md", "tests/test_packaging.py",
}  # fmt: skip
OLD_PATH = re.compile(r"(^|[^\w.])connectors\.vllm")


def _sources() -> list[Path]:
    dirs = ("offload_engine", "connectors", "tests", "docs", "benchmarks", "examples", "tools")
    found = [p for d in dirs for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
    return found + [p for p in ROOT.glob("*") if p.suffix in (".py", ".md", ".toml")]


def test_only_the_alias_uses_the_old_import_path() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _sources()
        if str(p.relative_to(ROOT)) not in OLD_PATH_ALLOWED
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if OLD_PATH.search(line)
    ]
    assert offenders == [], "write offload_engine.connectors.vllm (connectors.vllm is deprecated)"


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
