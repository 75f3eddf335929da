"""House rules that code review keeps catching, checked mechanically."""

from __future__ import annotations

import ast
import pathlib

import offload_engine

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = [
    p for d in ("offload_engine", "connectors", "deprecated") for p in (ROOT / d).rglob("*.py")
]

PUBLIC_API = {
    "BlockCountMismatchError", "BlockSpec", "CacheBlocks", "ConfigError", "Direction",
    "DuplicateJobIdError", "EngineBrokenError", "EngineClosedError", "EngineNotRunningError",
    "EngineNotStartedError", "EngineStats", "HandlerContext", "HandlerRegistrationError",
    "HandlerStats", "HostCopyHandler", "HostTier", "InvalidBlockIdsError", "InvalidTransferError",
    "JobCancelledError", "JobFailedError", "JobTimeoutError", "KVLayout", "LaunchedJob",
    "LayoutError", "Medium", "NoHandlerError", "OffloadError", "OffloadingQueueManager",
    "QueueFullError", "Region", "RuntimeUnavailableError", "SyncOffloadingEngine",
    "ThreadPoolHandler", "TierBlocks", "TransferError", "TransferHandler", "TransferResult",
    "TransferSpec", "UnknownJobError", "WrongThreadError", "__version__", "cpu_blocks",
    "gpu_blocks", "host_cache_blocks", "npu_blocks",
}  # fmt: skip


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
