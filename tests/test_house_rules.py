"""House rules that code review keeps catching, checked mechanically."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

import offload_engine

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = [p for d in ("offload_engine", "connectors") for p in (ROOT / d).rglob("*.py")]

PUBLIC_API = {
    "BlockCountMismatchError", "BlockSpec", "CacheBlocks", "ConfigError", "CopyStrategy",
    "CudaRuntime", "DeviceCopyHandler", "DeviceHandlerConfig", "DeviceRuntime", "Direction",
    "DuplicateJobIdError", "EngineBrokenError", "EngineClosedError", "EngineNotRunningError",
    "EngineNotStartedError", "EngineStats", "HandlerContext", "HandlerRegistrationError",
    "HandlerStats", "HostCopyHandler", "HostTier", "InvalidBlockIdsError", "InvalidTransferError",
    "JobCancelledError", "JobFailedError", "JobTimeoutError", "KVLayout", "LaunchedJob",
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
}  # fmt: skip

#: the public modules below the top level; every other offload_engine.* module is private
PUBLIC_MODULES = {"offload_engine.testing", "offload_engine.runtimes"}
PUBLIC_PACKAGE_TREES = ("offload_engine.connectors",)  # with every module under it


def test_public_api_is_pinned() -> None:
    assert set(offload_engine.__all__) == PUBLIC_API
    for name in PUBLIC_API:
        assert hasattr(offload_engine, name), name


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


def _project_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The project modules ``tree`` imports anywhere (also inside functions, which
    only postpones a cycle), except under ``if TYPE_CHECKING``."""
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                out.add(node.module)
            out.update(
                f"{node.module}.{a.name}"
                for a in node.names
                if f"{node.module}.{a.name}" in modules
            )
    return out


def import_cycles(paths: list[pathlib.Path], root: pathlib.Path = ROOT) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (a package
    importing its own submodules is no cycle)."""
    modules = {_module_name(p, root): p for p in paths}
    graph = {
        m: _project_imports(ast.parse(p.read_text()), set(modules)) for m, p in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
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


def test_no_module_imports_in_a_cycle() -> None:
    assert import_cycles(LIBRARY) == []


def test_the_cycle_check_finds_a_cycle(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("import pkg.c\nx = 1\n")
    (pkg / "c.py").write_text("def f():\n    import pkg.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    assert import_cycles(sorted(pkg.glob("*.py")), tmp_path) == [["pkg.a", "pkg.b", "pkg.c"]]
