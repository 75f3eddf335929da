"""Deprecated alias of :mod:`offload_engine.connectors.vllm.spec` (the same module object)."""

from connectors.vllm import _alias

_alias(__name__)
