from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from offload_engine import (
    BlockSpec,
    CacheBlocks,
    Direction,
    InvalidBlockIdsError,
    InvalidTransferError,
    Medium,
    TierBlocks,
    TransferResult,
    TransferSpec,
    cpu_blocks,
    gpu_blocks,
    host_cache_blocks,
    npu_blocks,
)


def test_media_cover_accelerators_host_and_later_tiers() -> None:
    assert {m.name for m in Medium} >= {"GPU", "NPU", "CPU", "DISK", "REMOTE"}
    assert str(Medium.GPU) == "GPU"


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.uint16),
    ],
)
def test_block_ids_become_read_only_int64(ids: object) -> None:
    spec = cpu_blocks(ids)  # type: ignore[arg-type]
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == [3, 1, 2]
    assert not spec.block_ids.flags.writeable
    assert len(spec) == 3


def test_block_ids_do_not_alias_the_callers_array() -> None:
    ids = np.array([1, 2, 3], dtype=np.int64)
    spec = cpu_blocks(ids)
    ids[0] = 99
    assert spec.block_ids.tolist() == [1, 2, 3]
    assert ids.flags.writeable


def test_empty_block_ids_are_allowed() -> None:
    assert cpu_blocks([]).block_ids.shape == (0,)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1.0, 2.0], "integers"),
        (np.array([1.5]), "integers"),
        ([True, False], "integers"),
        ([[1, 2]], "1-D"),
        ([1, -2], "non-negative"),
        ("123", "sequence"),
        (7, "sequence"),
        ([1, "a"], "integers"),
        (np.array([2**63 + 5], dtype=np.uint64), "int64"),
        ([2**70], "integers"),
    ],
)
def test_bad_block_ids_get_a_typed_error(ids: object, match: str) -> None:
    with pytest.raises(InvalidBlockIdsError, match=match):
        cpu_blocks(ids)  # type: ignore[arg-type]
    # and the error is a ValueError for generic handlers
    with pytest.raises(ValueError):
        gpu_blocks(ids)  # type: ignore[arg-type]


def test_medium_must_be_a_medium() -> None:
    with pytest.raises(InvalidTransferError, match="Medium"):
        TierBlocks("CPU", [1])  # type: ignore[arg-type]


def test_cache_blocks_default_to_one_group_starting_at_zero() -> None:
    spec = gpu_blocks([5, 6, 7])
    assert spec.group_sizes == (3,)
    assert spec.block_indices == (0,)
    assert spec.medium is Medium.GPU
    assert npu_blocks([1]).medium is Medium.NPU
    assert host_cache_blocks([1]).medium is Medium.CPU


def test_cache_blocks_groups_are_validated() -> None:
    spec = gpu_blocks([1, 2, 3], group_sizes=[1, 2], block_indices=[4, 0])
    assert spec.group_sizes == (1, 2)
    assert spec.block_indices == (4, 0)
    with pytest.raises(InvalidTransferError, match="sum to 2"):
        gpu_blocks([1, 2, 3], group_sizes=[1, 1])
    with pytest.raises(InvalidTransferError, match="2 groups"):
        gpu_blocks([1, 2, 3], group_sizes=[1, 2], block_indices=[0])
    with pytest.raises(InvalidTransferError, match="non-negative"):
        gpu_blocks([1, 2], group_sizes=[1, 1], block_indices=[0, -1])
    with pytest.raises(InvalidTransferError, match="ints"):
        gpu_blocks([1, 2], group_sizes=[1.0, 1.0])  # type: ignore[list-item]


def test_specs_are_frozen() -> None:
    spec = cpu_blocks([1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_ids = np.array([2])  # type: ignore[misc]
    result = TransferResult(1, True, 10, 0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.success = False  # type: ignore[misc]


def test_transfer_spec_pair_and_direction() -> None:
    store = TransferSpec(gpu_blocks([1]), cpu_blocks([2]))
    assert store.pair == (Medium.GPU, Medium.CPU)
    assert store.direction is Direction.STORE
    load = TransferSpec(cpu_blocks([2]), gpu_blocks([1]))
    assert load.direction is Direction.LOAD
    copy = TransferSpec(cpu_blocks([2]), TierBlocks(Medium.DISK, [3]))
    assert copy.direction is Direction.COPY
    with pytest.raises(InvalidTransferError, match="KV cache to KV cache"):
        _ = TransferSpec(gpu_blocks([1]), gpu_blocks([2])).direction
    with pytest.raises(InvalidTransferError, match="BlockSpec"):
        TransferSpec([1], cpu_blocks([2]))  # type: ignore[arg-type]


def test_repr_is_short_for_long_id_lists() -> None:
    assert "1000 ids" in repr(cpu_blocks(range(1000)))  # type: ignore[arg-type]
    assert repr(cpu_blocks([1, 2])) == "TierBlocks(CPU, [1, 2])"
    assert isinstance(gpu_blocks([1]), BlockSpec)
    assert isinstance(gpu_blocks([1]), CacheBlocks)
