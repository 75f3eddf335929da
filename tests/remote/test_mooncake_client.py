"""What a machine without a usable Mooncake client is told: the pip command where the
package is missing, and the system library and its Debian package where the package is
installed but the dynamic loader cannot find a library it links against (the wheel
bundles most, not libibverbs, libnuma or libcurl). The loader's failure is simulated:
an import hook raises the ImportError that ``import mooncake.store`` raises then."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

from offload_engine import ConfigError, MooncakeStore, MooncakeStoreConfig
from offload_engine.cli import EXIT_UNAVAILABLE, main
from offload_engine.remote.mooncake_store import (
    NOT_INSTALLED,
    mooncake_import_problem,
    mooncake_missing,
)

NO_VERBS = "libibverbs.so.1: cannot open shared object file: No such file or directory"
NO_NUMA = "libnuma.so.1: cannot open shared object file: No such file or directory"


class _LoaderFails(importlib.abc.MetaPathFinder):
    """Finds ``mooncake`` and ``mooncake.store`` first, and fails to load them as the
    dynamic loader does when a library they link against is missing."""

    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name in ("mooncake", "mooncake.store"):
            raise ImportError(self.message, name=name)
        return None


@pytest.fixture
def loader_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import mooncake.store`` raises the loader's error for a missing libibverbs.so.1."""
    for name in ("mooncake", "mooncake.store"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_LoaderFails(NO_VERBS), *sys.meta_path])


def test_a_missing_package_gets_the_pip_command() -> None:
    missing = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
    why = mooncake_import_problem(missing)
    assert why == NOT_INSTALLED
    assert "pip install -e '.[remote]'" in why


@pytest.mark.parametrize(
    ("message", "library", "package"),
    [(NO_VERBS, "libibverbs.so.1", "libibverbs1"), (NO_NUMA, "libnuma.so.1", "libnuma1")],
)
def test_a_missing_system_library_is_named_with_its_debian_package(
    message: str, library: str, package: str
) -> None:
    why = mooncake_import_problem(ImportError(message, name="mooncake.store"))
    assert why == (
        f"the Mooncake client is installed but cannot load {library} (Debian package "
        f"{package}): apt-get install libibverbs1 libnuma1 libcurl4, the system libraries "
        "it links against"
    )
    assert "not installed" not in why


def test_an_unknown_library_and_other_failures_keep_the_loaders_words() -> None:
    odd = "libodd.so.7: cannot open shared object file: No such file or directory"
    why = mooncake_import_problem(ImportError(odd, name="mooncake.store"))
    assert why.startswith("the Mooncake client is installed but cannot load libodd.so.7, ")
    assert odd in why
    other = mooncake_import_problem(ImportError("undefined symbol: foo", name="mooncake.store"))
    assert other == "the Mooncake client does not import: undefined symbol: foo"


@pytest.mark.usefixtures("loader_fails")
def test_the_skip_reason_and_the_store_say_which_library() -> None:
    why = mooncake_missing()
    assert why is not None and "libibverbs.so.1 (Debian package libibverbs1)" in why
    with pytest.raises(ConfigError, match=r"cannot load libibverbs\.so\.1") as refused:
        MooncakeStore(MooncakeStoreConfig("127.0.0.1:1"))
    assert str(refused.value) == why
    assert isinstance(refused.value.__cause__, ImportError)


@pytest.mark.usefixtures("loader_fails")
@pytest.mark.parametrize("backend", ["mooncake", "both"])
def test_bench_names_the_library_in_one_line(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--quick", "--tier", "remote", "--backend", backend, "-o", str(tmp_path)]
    assert main(argv) == EXIT_UNAVAILABLE
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"offload-engine bench: error: --tier remote --backend {backend}: the Mooncake client "
        "is installed but cannot load libibverbs.so.1 (Debian package libibverbs1): "
        "apt-get install libibverbs1 libnuma1 libcurl4, the system libraries it links against"
    )
    assert list(tmp_path.iterdir()) == []  # refused before any server or file
