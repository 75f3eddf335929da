"""Adapters that let serving systems (vLLM, vllm-ascend) drive offload-engine.

This folder installs as ``offload_engine.connectors`` (a name only this project
owns: the top-level name ``connectors`` belongs to another PyPI project). Import
``offload_engine.connectors.vllm``; modules here import each other relatively.
"""
