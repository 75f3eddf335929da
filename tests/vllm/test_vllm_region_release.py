"""Our secondary tiers give back every view of vLLM's shared offload region at shutdown.

vLLM's tiering manager (built by the spec, in-process) shuts its secondary tiers
down, releases the primary memoryview and closes the region's mmap. Any numpy
array, memoryview or tensor of ours still over that memory makes the close fail
(vLLM logs ``Failed to close mmap_obj`` with ``BufferError: cannot close exported
pointers exist``). Each tier here moves chunks first, so its threads and handlers
have touched the rows.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

import vllm_configs

from offload_engine import ConfigError
from offload_engine.connectors.vllm.primary import PrimaryRows
from offload_engine.remote.mooncake_store import mooncake_missing

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SPEC_KEYS = {"spec_name": "EngineTieringSpec", "spec_module_path": "offload_engine.connectors.vllm"}
VLLM_MODULE = "offload_engine.connectors.vllm"
REGION_LOGGER = "vllm.v1.kv_offload.cpu.shared_offload_region"

MOONCAKE_MISSING = mooncake_missing()  # the package, or a system library it links against


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(
            f"{r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else r.getMessage()
            for r in self.records
        )


@pytest.fixture
def region_log() -> Iterator[Records]:
    # vLLM's loggers do not propagate to the root logger: listen on the region's own
    handler = Records()
    logger = logging.getLogger(REGION_LOGGER)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def tier_config(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    name = request.param
    base = {"type": "EngineRemoteTier", "module_path": VLLM_MODULE, "workers": 2}
    if name == "disk":
        (tmp_path / "kv").mkdir()
        yield {
            "type": "EngineDiskTier",
            "module_path": VLLM_MODULE,
            "path": str(tmp_path / "kv"),
            "capacity_bytes": 10_000_000,
        }
    elif name == "redis":
        if shutil.which("redis-server") is None:
            pytest.skip("needs redis-server (apt-get install redis-server)")
        from offload_engine.testing.servers import RedisServer

        with RedisServer() as server:
            yield {**base, "backend": "redis", "url": server.url}
    else:
        if MOONCAKE_MISSING is not None:
            pytest.skip(MOONCAKE_MISSING)
        from offload_engine.testing.servers import MooncakeMaster

        with MooncakeMaster() as master:
            yield {
                **base,
                "backend": "mooncake",
                "master": master.address,
                "segment_bytes": 16 << 20,
                "local_buffer_bytes": 4 << 20,
            }


def move_chunks(tier: Any) -> None:
    """Store chunks 0 and 1, then load them into chunks 2 and 3, through ``tier``."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext("req-0")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in (1, 2)]
    tier.submit_store(TransferJob(1, keys, np.array([0, 1]), False, ctx))
    tier.drain_jobs()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    tier.submit_load(TransferJob(2, keys, np.array([2, 3]), True, ctx))
    tier.drain_jobs()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, True)]


@pytest.mark.parametrize("tier_config", ["disk", "redis", "mooncake"], indirect=True)
def test_vllm_closes_its_region_after_our_tier_shuts_down(
    tier_config: dict[str, Any], region_log: Records
) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    engine_id = f"oe-test-{uuid.uuid4().hex}"
    extra = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier_config]}
    config = vllm_configs.offloading_config(
        extra, spec_keys=SPEC_KEYS, engine_id=engine_id, bytes_per_block=8192
    )
    spec = OffloadingSpecFactory.get_spec_cls(SPEC_KEYS)(config)
    manager = spec.get_manager()
    region = manager.primary_tier._mmap_region
    mapping = region.mmap_obj
    [tier] = manager.secondary_tiers
    try:
        move_chunks(tier)
    finally:
        manager.shutdown()  # the tiers, then the primary view, then the region
    assert "Failed to close mmap_obj" not in region_log.text(), region_log.text()
    assert mapping.closed
    assert tier._primary.released
    tier.shutdown()  # idempotent


def test_release_ends_every_hold_on_the_rows_and_reports_a_buffer_left_alive() -> None:
    rows = np.zeros((4, 64), dtype=np.int8)
    base = memoryview(rows)
    primary = PrimaryRows(base)
    assert primary.tier.memory.shape == (4, 64)
    primary.tier.memory[1].fill_(7)
    assert rows[1].tolist() == [7] * 64  # the tier is the rows, not a copy
    # a tensor object left over does not keep the rows' buffer exported
    left = primary.tier.memory
    assert primary.release() is True
    assert primary.released and primary.tier.released
    base.release()  # vLLM's own view: nothing of ours pins it
    del left
    assert primary.release() is True  # idempotent

    # numpy, ctypes and torch keep a reference (or a view sharing vLLM's export),
    # not an export of the memoryview; a C extension holding one looks like this
    held = PrimaryRows(memoryview(rows))
    export = ctypes.create_string_buffer(256)  # room for a Py_buffer
    get_buffer = ctypes.pythonapi.PyObject_GetBuffer
    get_buffer.argtypes = (ctypes.py_object, ctypes.c_void_p, ctypes.c_int)
    assert get_buffer(held._view, export, 0) == 0
    try:
        assert held.release() is False  # said in a warning, not raised
    finally:
        ctypes.pythonapi.PyBuffer_Release.argtypes = (ctypes.c_void_p,)
        ctypes.pythonapi.PyBuffer_Release(export)
    assert repr(held) == "<PrimaryRows released rows=4 row_bytes=64>"
    with pytest.raises(ConfigError, match="C-contiguous"):
        PrimaryRows(memoryview(rows[:, ::2]))
