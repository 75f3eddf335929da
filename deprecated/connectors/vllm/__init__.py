"""Deprecated alias of :mod:`offload_engine.connectors.vllm`, kept for one release.

Until 0.1.x the vLLM adapter installed as the top-level package ``connectors``,
a name that the PyPI project ``connectors`` also installs. It now installs as
``offload_engine.connectors.vllm``. This portion of the ``connectors``
namespace ships no ``connectors/__init__.py``, so it overwrites nothing; its
modules warn once and hand out the new modules' objects.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType
from typing import Any

NEW = "offload_engine.connectors.vllm"

warnings.warn(
    f"'connectors.vllm' is deprecated and will be removed in the next release; "
    f"use spec_module_path {NEW!r} (import {NEW})",
    DeprecationWarning,
    stacklevel=2,
)

_new = importlib.import_module(NEW)
__all__ = list(_new.__all__)


def __getattr__(name: str) -> Any:
    # EngineOffloadingSpec and EngineOffloadingWorker stay lazy (they import vLLM)
    return getattr(_new, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _alias(old_name: str) -> ModuleType:
    """Make ``connectors.vllm.X`` the very module ``offload_engine.connectors.vllm.X``."""
    module = importlib.import_module(f"{NEW}.{old_name.rsplit('.', 1)[1]}")
    sys.modules[old_name] = module
    return module
