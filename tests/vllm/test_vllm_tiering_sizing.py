"""The CPU primary tier's sizing rule, and EngineTieringSpec's startup warning when
the tier cannot promote one full-length request's chunks (in-process, vLLM's real
tiering manager with its ``fs`` tier)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from offload_engine.connectors.vllm.sizing import PrimarySizing

SPEC_KEYS = {"spec_name": "EngineTieringSpec", "spec_module_path": "offload_engine.connectors.vllm"}


def test_the_rule_counts_chunks_per_request_and_per_batch() -> None:
    sizing = PrimarySizing(
        num_chunks=32,
        kv_bytes_per_chunk=32 << 10,
        chunk_tokens=32,
        kv_groups=1,
        max_model_len=256,
        max_num_seqs=4,
    )
    assert (sizing.chunks_per_request, sizing.chunks_for_all) == (8, 32)
    assert sizing.too_small_warning() is None  # one request fits (four exactly)
    two_groups = PrimarySizing(
        num_chunks=7,
        kv_bytes_per_chunk=4096,
        chunk_tokens=64,
        kv_groups=2,
        max_model_len=200,  # 4 chunks per group, the last one partial
        max_num_seqs=3,
    )
    assert (two_groups.chunks_per_request, two_groups.chunks_for_all) == (8, 24)
    warning = two_groups.too_small_warning()
    assert warning is not None
    assert "holds 7 chunks" in warning
    assert "(8 chunks of 64 tokens x 2 KV group(s))" in warning
    assert "at least 32768 bytes, and 98304 bytes for max_num_seqs=3" in warning


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged() -> Iterator[Records]:
    # vLLM's loggers do not propagate to the root logger: listen on the adapter's own
    handler = Records()
    logger = logging.getLogger("vllm.offload_engine")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def build_manager_like_vllm(spec: Any, max_model_len: int, max_num_seqs: int) -> Any:
    """As vLLM 0.32's ``OffloadingConnectorScheduler.__init__(spec, vllm_config, ...)``
    does: ``spec.get_manager()`` with the engine's config in a local, not current."""
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )
    manager = spec.get_manager()
    assert vllm_config is not None
    return manager


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("fits", [True, False])
def test_a_tier_too_small_for_one_request_warns_once_at_startup(
    tmp_path: Path, warnings_logged: Records, fits: bool
) -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
    import vllm_configs
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    engine_id = f"oe-test-{uuid.uuid4().hex}"
    tier = {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 1, "n_write_threads": 1}
    extra = {"cpu_bytes_to_use": 6 * 8192, "secondary_tiers": [tier]}
    config = vllm_configs.offloading_config(
        extra, spec_keys=SPEC_KEYS, engine_id=engine_id, bytes_per_block=8192
    )
    spec = OffloadingSpecFactory.get_spec_cls(SPEC_KEYS)(config)
    assert (spec.num_chunks, spec.kv_bytes_per_chunk) == (6, 8192)
    # 32-token chunks: 6 chunks promote a request of up to 192 tokens
    max_model_len = 192 if fits else 193
    try:
        manager = build_manager_like_vllm(spec, max_model_len, max_num_seqs=4)
        assert spec.get_manager() is manager  # built once, checked once
    finally:
        spec.get_manager().shutdown()
        for path in Path("/dev/shm").glob(f"vllm_offload_{engine_id}.mmap*"):
            path.unlink()
    if fits:
        assert warnings_logged.messages == []
        return
    [warning] = warnings_logged.messages
    assert "holds 6 chunks (cpu_bytes_to_use / 8192 bytes per chunk)" in warning
    assert "max_model_len=193 tokens" in warning and "(7 chunks of 32 tokens" in warning
    assert f"at least {7 * 8192} bytes, and {28 * 8192} bytes for max_num_seqs=4" in warning


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_no_config_in_reach_skips_the_check() -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
    from offload_engine.connectors.vllm.tiering import scheduler_limits

    assert scheduler_limits() is None
