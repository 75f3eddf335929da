"""Deprecated alias of :mod:`offload_engine.connectors.vllm.platform` (the same module object)."""

from connectors.vllm import _alias

_alias(__name__)
