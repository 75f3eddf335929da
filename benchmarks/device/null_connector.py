"""A vLLM KV connector that finds no hits and moves nothing.

The decode bench's ``null`` mode runs it: vLLM then takes its connector path every step
(metadata built and bound, the worker's hooks called, their outputs gathered) with no
offloading behind it, so the gap between ``plain`` and ``null`` is vLLM's own cost of
having a connector, and the gap between ``null`` and an offloading mode is that mode's.
``vllm_gpu.py`` names it by module path; this folder is on the engine's ``sys.path``
because the script runs from it.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullConnector(KVConnectorBase_V1):
    # worker side: nothing to load or save

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side: never a hit

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
