"""House rules that code review keeps catching, checked mechanically."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import offload_engine
from tests.test_docs import api_docs_generator

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = [p for d in ("offload_engine", "connectors") for p in (ROOT / d).rglob("*.py")]

PUBLIC_API = {
    "BlockCountMismatchError", "BlockSpec", "CacheBlocks", "ConfigError", "CopyStrategy",
    "CudaRuntime", "DeviceCopyHandler", "DeviceHandlerConfig", "DeviceRuntime", "Direction",
    "DuplicateJobIdError", "EngineBrokenError", "EngineClosedError", "EngineNotRunningError",
    "EngineNotStartedError", "EngineStats", "HandlerContext", "HandlerRegistrationError",
    "HandlerStats", "HostCopyHandler", "HostTier", "InvalidBlockIdsError", "InvalidTransferError",
    "JobCancelledError", "JobFailedError", "JobFence", "JobTimeoutError", "KVLayout", "LaunchedJob",
    "LayoutError", "Medium", "NoHandlerError", "NpuRuntime", "OffloadError",
    "OffloadingQueueManager", "QueueFullError", "Region", "RuntimeUnavailableError",
    "SyncOffloadingEngine", "ThreadPoolHandler", "TierBlocks", "TransferError", "TransferHandler",
    "TransferResult", "TransferSpec", "UnknownJobError", "WrongThreadError", "__version__",
    "cpu_blocks", "gpu_blocks", "host_cache_blocks", "make_device_handlers", "npu_blocks",
    "pinned_host_tier",
    # keyed tiers (disk, remote)
    "InvalidKeyError", "KeyMissError", "KeyedBlocks", "LayoutDigest", "LayoutMismatchError",
    "TierFullError", "TierUnavailableError", "Trailer", "TrailerError", "disk_blocks",
    "remote_blocks",
    # the remote tier
    "RemoteHandler", "RemoteTier", "RemoteTierStats", "StoreAuthError", "StoreError",
    "StoreUnavailableError", "RemoteStore", "RedisStore", "RedisStoreConfig", "MooncakeStore",
    "MooncakeStoreConfig",
    # the disk tier
    "DiskHandler", "DiskStore", "DiskStoreStats", "EvictionPolicy", "LRUPolicy", "disk_handlers",
    "page_aligned_tier",
    # borrowing peers' links
    "PeerLedger", "LedgerUnavailableError",
}  # fmt: skip


_GENERATOR = api_docs_generator()
PUBLIC_MODULES: set[str] = set(_GENERATOR.PUBLIC_MODULES)
PUBLIC_PACKAGE_TREES: tuple[str, ...] = tuple(_GENERATOR.PUBLIC_TREES)


def test_public_api_is_pinned() -> None:
    assert set(offload_engine.__all__) == PUBLIC_API
    for name in PUBLIC_API:
        assert hasattr(offload_engine, name), name


def test_the_package_docstring_names_the_public_modules() -> None:
    named = set(re.findall(r":mod:`~?([\w.]+)`", offload_engine.__doc__ or ""))
    assert named == PUBLIC_MODULES | set(PUBLIC_PACKAGE_TREES), (
        "offload_engine's docstring and tools/gen_api_docs.py (PUBLIC_MODULES, PUBLIC_TREES) "
        "must name the same public modules"
    )


def test_no_assert_statements_in_library_code() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in LIBRARY
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert offenders == [], "validate with typed errors, not assert (gone under python -O)"


def test_del_methods_only_warn() -> None:
    offenders = []
    for p in LIBRARY:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "__del__":
                src = ast.unparse(node)
                calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
                names = {ast.unparse(c.func) for c in calls}
                if "ResourceWarning" not in src or names - {
                    "warnings.warn",
                    "getattr",
                    "hasattr",
                    "type",
                }:
                    offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], "__del__ may only emit a ResourceWarning; clean up in close()"


def test_errors_are_exported_typed_and_named_for_their_cause() -> None:
    from offload_engine import errors

    for name in dir(errors):
        obj = getattr(errors, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, Exception)
            and obj.__module__ == errors.__name__
        ):
            assert issubclass(obj, errors.OffloadError), name
            assert name.endswith("Error"), name


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every module an import in ``tree`` loads (``from a import b``
    loads ``a``, and ``a.b`` too where ``b`` is a submodule)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module.startswith("offload_engine"):
                found += [
                    (node.lineno, f"{node.module}.{alias.name}")
                    for alias in node.names
                    if _is_module(f"{node.module}.{alias.name}")
                ]
    return found


def _is_private(module: str) -> bool:
    if not module.startswith("offload_engine."):
        return False
    return module not in PUBLIC_MODULES and not module.startswith(
        tuple(tree + "." for tree in PUBLIC_PACKAGE_TREES)
    )


def private_imports(paths: list[pathlib.Path]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}:{line} imports {module}"
        for p in paths
        for line, module in _imported_modules(ast.parse(p.read_text()))
        if _is_private(module)
    ]


def test_connectors_and_examples_import_only_public_names() -> None:
    users = [p for d in ("connectors", "examples") for p in (ROOT / d).rglob("*.py")]
    assert users
    assert private_imports(users) == [], (
        "import from offload_engine, offload_engine.testing, offload_engine.runtimes or "
        "offload_engine.connectors; export a name there if it is missing"
    )


def test_the_private_import_check_catches_a_private_module(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "adapter.py"
    bad.write_text(
        "from offload_engine import KVLayout\n"
        "from offload_engine.runtimes import probe_runtimes\n"
        "from offload_engine.testing import FakeHandler\n"
        "from offload_engine.engine.sync import SyncOffloadingEngine\n"
        "import offload_engine.device.handler\n"
        "from offload_engine.testing._faults import Ledger\n"
        "from offload_engine.device.runtimes.cuda import CudaRuntime\n"
        "from offload_engine.device.runtimes import npu\n"
    )
    found = [line.split(" imports ")[1] for line in private_imports_outside(bad)]
    assert found == [
        "offload_engine.engine.sync",
        "offload_engine.device.handler",
        "offload_engine.testing._faults",
        "offload_engine.device.runtimes.cuda",
        "offload_engine.device.runtimes",
        "offload_engine.device.runtimes.npu",
    ]


def private_imports_outside(path: pathlib.Path) -> list[str]:
    return [
        f"{path.name}:{line} imports {module}"
        for line, module in _imported_modules(ast.parse(path.read_text()))
        if _is_private(module)
    ]


def test_import_offload_engine_loads_no_device_runtime() -> None:
    code = (
        "import sys, offload_engine\n"
        "loaded = [m for m in ('offload_engine.device.runtimes.cuda',"
        " 'offload_engine.device.runtimes.npu',"
        " 'torch_npu', 'cuda.bindings', 'triton') if m in sys.modules]\n"
        "assert loaded == [], loaded\n"
        "assert offload_engine.CudaRuntime.__module__ == 'offload_engine.device.runtimes.cuda'\n"
        "assert offload_engine.NpuRuntime.__module__ == 'offload_engine.device.runtimes.npu'\n"
        "assert 'torch_npu' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module ``from ... import`` names, a relative one resolved from ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    anchor = parts[: len(parts) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _project_imports(tree: ast.Module, modules: set[str], package: str = "") -> set[str]:
    """The project modules ``tree`` imports anywhere: also inside functions, which
    only postpones a cycle, and under ``if TYPE_CHECKING``, which hides one from the
    interpreter but not from a reader. ``package`` is the importing module's package,
    for relative imports."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base in modules:
                out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)
    return out


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            connect(m)
    return cycles


def _package_of(module: str, path: pathlib.Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _import_graph(paths: list[pathlib.Path], root: pathlib.Path) -> dict[str, set[str]]:
    modules = {_module_name(p, root): p for p in paths}
    return {
        m: _project_imports(ast.parse(p.read_text()), set(modules), _package_of(m, p))
        for m, p in modules.items()
    }


def import_cycles(paths: list[pathlib.Path], root: pathlib.Path = ROOT) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (a package
    importing its own submodules is no cycle)."""
    return _strongly_connected(_import_graph(paths, root))


def package_cycles(paths: list[pathlib.Path], root: pathlib.Path = ROOT) -> list[list[str]]:
    """Cycles between the parts of each package, a subpackage taken whole: ``bench`` and
    ``testing`` form one when a module of each imports a module of the other, even if no
    single module closes the loop. A package's ``__init__`` is not one of its parts."""
    graph = _import_graph(paths, root)
    packages = {_module_name(p, root) for p in paths if p.name == "__init__.py"}
    cycles: list[list[str]] = []
    for package in sorted(packages):

        def part(module: str, package: str = package) -> str | None:
            if not module.startswith(package + "."):
                return None
            return f"{package}.{module[len(package) + 1 :].split('.', maxsplit=1)[0]}"

        parts: dict[str, set[str]] = {}
        for module, targets in graph.items():
            a = part(module)
            if a is not None:
                found = {b for b in map(part, targets) if b is not None and b != a}
                parts.setdefault(a, set()).update(found)
        cycles += _strongly_connected(parts)
    return cycles


def test_no_module_imports_in_a_cycle() -> None:
    assert import_cycles(LIBRARY) == []


def test_no_package_imports_in_a_cycle() -> None:
    assert package_cycles(LIBRARY) == []


def test_the_cycle_check_finds_a_cycle(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("import pkg.c\nx = 1\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    # an import for the type checker alone still closes a cycle
    (pkg / "e.py").write_text("from pkg import f\n")
    (pkg / "f.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import X\n"
    )
    assert import_cycles(sorted(pkg.glob("*.py")), tmp_path) == [
        ["pkg.a", "pkg.b", "pkg.c"],
        ["pkg.e", "pkg.f"],
    ]


def test_the_package_cycle_check_finds_a_loop_no_module_closes(tmp_path: pathlib.Path) -> None:
    # the shape bench/ and testing/ once had: the kit's __init__ imported a benchmark module,
    # and another benchmark module imported the kit
    files = {
        "pkg/__init__.py": "",
        "pkg/bench/__init__.py": "",
        "pkg/bench/caches.py": "x = 1\n",
        "pkg/bench/rigs.py": "from pkg.testing import fake\n",
        "pkg/testing/__init__.py": "from pkg.bench.caches import x\nfake = 1\n",
        "pkg/host/__init__.py": "from pkg.host.tier import Tier\n",
        "pkg/host/tier.py": "from pkg.engine import handler\nTier = 1\n",
        "pkg/engine/__init__.py": "",
        "pkg/engine/handler.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    paths = sorted(tmp_path.rglob("*.py"))
    assert import_cycles(paths, tmp_path) == []
    assert package_cycles(paths, tmp_path) == [["pkg.bench", "pkg.testing"]]


# ------------------------------------------------------------------ layers
#
# The ground (errors, vocabulary, fence, _checks, _loop) imports only the ground. The engine imports
# only the ground and itself. A medium (host, device, disk, remote) imports the ground, the
# engine, its own modules, `keyed` (disk and remote), and another medium only through that
# medium's package (``from offload_engine.host import HostTier``), never its modules. `keyed`
# imports as a medium does. The testing kit imports no benchmark and no command. The facades
# above them (``offload_engine``, ``offload_engine.runtimes``) and bench/, cli/ are free.

GROUND = {
    "offload_engine.errors",
    "offload_engine.vocabulary",
    "offload_engine._checks",
    "offload_engine._loop",
    "offload_engine.fence",
}
ENGINE = "offload_engine.engine"
MEDIA = ("host", "device", "disk", "remote")
KEYED = "offload_engine.keyed"
KEYED_USERS = ("disk", "remote")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _medium_of(module: str) -> str | None:
    for medium in MEDIA:
        if _within(module, f"offload_engine.{medium}"):
            return medium
    return None


def _all_imports(path: pathlib.Path, module: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every offload_engine module the file imports: at the top, inside
    functions and under ``if TYPE_CHECKING`` alike, relative imports resolved. ``from a import
    b`` is ``a.b`` where that is a module, else ``a``."""
    found: list[tuple[int, str]] = []
    package = _package_of(module, path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((node.lineno, name if name in modules else base))
    return [(line, m) for line, m in found if _within(m, "offload_engine")]


def _medium_import_broken(medium: str | None, target: str) -> str | None:
    """Why a medium (``None`` for keyed.py) may not import ``target``, or None if it may."""
    if target in GROUND or _within(target, ENGINE):
        return None
    if target == KEYED:
        return None if medium in KEYED_USERS else "only disk and remote import keyed"
    other = _medium_of(target)
    if other is None:
        return "a medium imports the ground, the engine, keyed and other media's packages only"
    if other == medium or target == f"offload_engine.{other}":
        return None
    return f"a medium imports another only through its package: offload_engine.{other}"


def _layer_broken(importer: str, target: str) -> str | None:
    """Why ``importer`` may not import ``target``, or None if it may."""
    if importer in GROUND:
        return None if target in GROUND else "the ground imports only the ground"
    if _within(importer, ENGINE):
        below = target in GROUND or _within(target, ENGINE)
        return None if below else "the engine imports no medium"
    if _within(importer, "offload_engine.testing"):
        above = _within(target, "offload_engine.bench") or _within(target, "offload_engine.cli")
        return "the testing kit imports no benchmark and no command" if above else None
    medium = _medium_of(importer)
    if medium is None and importer != KEYED:
        return None  # the facades, bench/, cli/
    return _medium_import_broken(medium, target)


def layer_breaks(
    paths: list[pathlib.Path], root: pathlib.Path = ROOT
) -> list[tuple[str, str, str]]:
    """(where, importer, target) of each import that breaks the layer rule, with the reason in
    ``where``."""
    modules = {_module_name(p, root): p for p in paths}
    out = []
    for module, path in sorted(modules.items()):
        for line, target in _all_imports(path, module, set(modules)):
            why = _layer_broken(module, target)
            if why is not None:
                out.append((f"{path.relative_to(root)}:{line} ({why})", module, target))
    return out


PACKAGE = sorted((ROOT / "offload_engine").rglob("*.py"))


def test_each_layer_imports_only_what_it_stands_on() -> None:
    broken = [f"{where}: imports {target}" for where, _, target in layer_breaks(PACKAGE)]
    assert broken == [], "docs/architecture.md, 'What may import what'"


def test_the_layer_check_catches_each_kind_of_break(tmp_path: pathlib.Path) -> None:
    files = {
        "offload_engine/__init__.py": "from offload_engine.host.tier import HostTier\n",
        "offload_engine/errors.py": "",
        "offload_engine/vocabulary.py": "from offload_engine import errors\n",
        "offload_engine/_loop.py": "def f():\n    from offload_engine.engine import manager\n",
        "offload_engine/keyed.py": "from offload_engine.host import HostTier\n",
        "offload_engine/engine/__init__.py": "",
        "offload_engine/engine/handler.py": "from offload_engine.errors import OffloadError\n",
        "offload_engine/engine/manager.py": (
            "from typing import TYPE_CHECKING\n"
            "from . import handler\n"
            "if TYPE_CHECKING:\n"
            "    from offload_engine.host import HostTier\n"
        ),
        "offload_engine/host/__init__.py": "from offload_engine.host.tier import HostTier\n",
        "offload_engine/host/tier.py": "from offload_engine.engine.handler import x\n",
        "offload_engine/device/__init__.py": "",
        "offload_engine/device/handler.py": (
            "from offload_engine.host import HostTier\n"
            "from ..host.tier import HostTier\n"
            "from offload_engine.keyed import Trailer\n"
            "from offload_engine import testing\n"
        ),
        "offload_engine/disk/__init__.py": "",
        "offload_engine/disk/handler.py": (
            "from offload_engine.keyed import Trailer\nfrom offload_engine.disk import store\n"
        ),
        "offload_engine/disk/store.py": "import offload_engine.remote.tier\n",
        "offload_engine/remote/__init__.py": "",
        "offload_engine/remote/tier.py": "",
        "offload_engine/testing/__init__.py": "from offload_engine.bench import rigs\n",
        "offload_engine/bench/__init__.py": "",
        "offload_engine/bench/rigs.py": "from offload_engine.testing import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = [
        (where.split(" ")[0], target)
        for where, _, target in layer_breaks(sorted(tmp_path.rglob("*.py")), tmp_path)
    ]
    assert found == [
        ("offload_engine/_loop.py:2", "offload_engine.engine.manager"),
        ("offload_engine/device/handler.py:2", "offload_engine.host.tier"),
        ("offload_engine/device/handler.py:3", "offload_engine.keyed"),
        ("offload_engine/device/handler.py:4", "offload_engine.testing"),
        ("offload_engine/disk/store.py:1", "offload_engine.remote.tier"),
        ("offload_engine/engine/manager.py:4", "offload_engine.host"),
        ("offload_engine/testing/__init__.py:1", "offload_engine.bench.rigs"),
    ]


# ------------------------------------------------------------------ the drawn tree

ARCHITECTURE = ROOT / "docs" / "architecture.md"
DESCRIPTION_COLUMN = 29  # where the tree's descriptions start: anything indented less is an entry


def drawn_tree(text: str) -> list[str]:
    """The paths the first code block of ``text`` draws: one entry a line, two spaces of indent
    per level, a folder ending in ``/``; lines indented to the description column continue the
    entry above."""
    block = text.split("```\n", 2)[1]
    folders: list[str] = []
    paths: list[str] = []
    for line in block.splitlines():
        match = re.match(r"( *)(\S+)", line)
        if match is None or len(match.group(1)) >= DESCRIPTION_COLUMN:
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        del folders[depth:]
        path = "".join(folders) + name
        paths.append(path.rstrip("/"))
        if name.endswith("/"):
            folders.append(name)
    return paths


def tree_mismatches(paths: list[str], root: pathlib.Path = ROOT) -> list[str]:
    """What the drawn tree gets wrong: a path that does not exist, a package of
    offload_engine/ it leaves out, a folder whose modules it lists only in part."""
    drawn = set(paths)
    wrong = [f"{p}: no such file or folder" for p in paths if not (root / p).exists()]
    packages = sorted(
        p.parent.relative_to(root).as_posix()
        for p in (root / "offload_engine").rglob("__init__.py")
    )
    wrong += [f"{p}/: not drawn" for p in packages if p not in drawn]
    listed = {pathlib.PurePosixPath(p).parent.as_posix() for p in paths if p.endswith(".py")}
    for folder in sorted(listed):
        actual = {f"{folder}/{p.name}" for p in (root / folder).glob("*.py")}
        wrong += [f"{p}: not drawn" for p in sorted(actual - drawn)]
    return wrong


def test_the_architecture_page_draws_the_tree_as_it_is() -> None:
    paths = drawn_tree(ARCHITECTURE.read_text())
    assert "offload_engine/engine" in paths and "offload_engine/host/tier.py" in paths
    assert tree_mismatches(paths) == [], "docs/architecture.md: redraw the tree"


def test_the_tree_check_finds_what_is_drawn_wrong(tmp_path: pathlib.Path) -> None:
    for name in (
        "pkg/__init__.py",
        "pkg/a.py",
        "pkg/b.py",
        "pkg/sub/__init__.py",
        "pkg/new/__init__.py",
    ):
        (tmp_path / "offload_engine" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "offload_engine" / name).write_text("")
    (tmp_path / "offload_engine" / "__init__.py").write_text("")
    page = (
        "# Title\n\n```\n"
        "offload_engine/\n"
        "  __init__.py                the API\n"
        "  pkg/                       a package\n"
        "    a.py                     one module, and the description goes on\n"
        "                             on the next line: gone.py is no entry\n"
        "    sub/                     a subpackage, its modules not listed\n"
        "  gone.py                    a module that is not there\n"
        "```\n"
    )
    paths = drawn_tree(page)
    assert paths == [
        "offload_engine",
        "offload_engine/__init__.py",
        "offload_engine/pkg",
        "offload_engine/pkg/a.py",
        "offload_engine/pkg/sub",
        "offload_engine/gone.py",
    ]
    assert tree_mismatches(paths, tmp_path) == [
        "offload_engine/gone.py: no such file or folder",
        "offload_engine/pkg/new/: not drawn",
        "offload_engine/pkg/__init__.py: not drawn",
        "offload_engine/pkg/b.py: not drawn",
    ]
