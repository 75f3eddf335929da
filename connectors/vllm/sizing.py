"""How big vLLM's CPU primary tier must be for its secondary tiers to give hits.

vLLM's tiering manager (``vllm/v1/kv_offload/tiering/manager.py``) finds a
request's prefix one chunk at a time; a chunk found in a secondary tier is
promoted at once, which takes a free (or evictable) chunk of the CPU primary
tier for it at lookup time (``_initiate_promotion`` -> ``prepare_write``). When
none is left the chunk is answered a MISS (counted by
``on_promotion_allocation_failure``), and the request's prefix hit ends there.
Chunks still being written from the GPU, being cascaded down, or promoted and
not yet loaded cannot be evicted, so every running request holds up to one
chunk per ``chunk_tokens`` of its prompt per KV group.

So a tier of fewer chunks than one full-length request needs,
``ceil(max_model_len / chunk_tokens) * kv_groups``, can never promote such a
request whole; and ``max_num_seqs`` requests running at once need that many
times as much for all of them to get their hits.

This module does not import vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PrimarySizing:
    """The CPU primary tier against the scheduler's limits."""

    num_chunks: int
    """Chunks the tier holds (``cpu_bytes_to_use // kv_bytes_per_chunk``)."""
    kv_bytes_per_chunk: int
    """Bytes of one chunk row of the tier, alignment padding included."""
    chunk_tokens: int
    """Tokens per chunk: tokens per hash block times ``blocks_per_chunk``."""
    kv_groups: int
    max_model_len: int
    max_num_seqs: int

    @property
    def chunks_per_request(self) -> int:
        """Primary chunks one request of ``max_model_len`` tokens promotes at once."""
        return math.ceil(self.max_model_len / self.chunk_tokens) * self.kv_groups

    @property
    def chunks_for_all(self) -> int:
        """Primary chunks for ``max_num_seqs`` such requests at once."""
        return self.chunks_per_request * self.max_num_seqs

    def too_small_warning(self) -> str | None:
        """The startup warning, or ``None`` when one full-length request fits."""
        need = self.chunks_per_request
        if self.num_chunks >= need:
            return None
        return (
            f"the CPU primary tier holds {self.num_chunks} chunks "
            f"(cpu_bytes_to_use / {self.kv_bytes_per_chunk} bytes per chunk), fewer than one "
            f"request of max_model_len={self.max_model_len} tokens promotes from the "
            f"secondary tiers at once ({need} chunks of {self.chunk_tokens} tokens x "
            f"{self.kv_groups} KV group(s)); vLLM counts each chunk it cannot make room for "
            f"as a miss. Set cpu_bytes_to_use to at least {need * self.kv_bytes_per_chunk} "
            f"bytes, and {self.chunks_for_all * self.kv_bytes_per_chunk} bytes for "
            f"max_num_seqs={self.max_num_seqs} such requests at once"
        )


__all__ = ["PrimarySizing"]
