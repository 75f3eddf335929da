"""Adapters that let serving systems (vLLM, vllm-ascend) drive offload-engine."""
