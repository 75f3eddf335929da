"""The pieces every keyed tier shares: keyed blocks, the object trailer, the layout digest."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_engine import (
    BlockCountMismatchError,
    ConfigError,
    HostTier,
    InvalidBlockIdsError,
    InvalidKeyError,
    InvalidTransferError,
    KeyedBlocks,
    LayoutDigest,
    LayoutError,
    LayoutMismatchError,
    Medium,
    TierBlocks,
    Trailer,
    TrailerError,
    TransferSpec,
    cpu_blocks,
    disk_blocks,
    host_cache_blocks,
    remote_blocks,
)
from offload_engine.keyed import FORMAT_VERSION, map_keyed
from offload_engine.vocabulary import MAX_KEY_BYTES

# ------------------------------------------------------------------ KeyedBlocks


def test_keyed_blocks_copy_keys_and_never_alias_caller_memory() -> None:
    raw = bytearray(b"hash-0001")
    view_src = bytearray(b"hash-0002")
    blocks = disk_blocks([raw, memoryview(view_src), b"hash-0003"])
    raw[0:4] = b"XXXX"
    view_src[0:4] = b"YYYY"
    assert blocks.keys == (b"hash-0001", b"hash-0002", b"hash-0003")
    assert all(type(k) is bytes for k in blocks.keys)
    assert len(blocks) == 3
    assert blocks.medium is Medium.DISK
    assert remote_blocks([b"k"]).medium is Medium.REMOTE
    assert "DISK" in repr(blocks) and b"hash".hex() in repr(blocks)
    with pytest.raises(dataclasses.FrozenInstanceError):
        blocks.keys = ()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (b"one-key", "sequence of bytes"),
        ("text", "sequence of bytes"),
        (iter([b"a"]), "sequence of bytes"),
        ([b"ok", "str"], r"keys\[1\] must be bytes"),
        ([b"ok", 7], r"keys\[1\] must be bytes"),
        ([b""], "empty"),
        ([b"x" * (MAX_KEY_BYTES + 1)], "at most"),
        ([b"a", b"b", b"a"], "twice"),
    ],
)
def test_keyed_blocks_refuse_bad_keys(keys: object, match: str) -> None:
    with pytest.raises(InvalidKeyError, match=match):
        KeyedBlocks(Medium.DISK, keys)  # type: ignore[arg-type]


def test_keyed_blocks_live_on_keyed_media_only() -> None:
    with pytest.raises(InvalidTransferError, match="keyed medium"):
        KeyedBlocks(Medium.CPU, (b"k",))
    with pytest.raises(InvalidTransferError, match="must be a Medium"):
        KeyedBlocks("DISK", (b"k",))  # type: ignore[arg-type]
    assert KeyedBlocks(Medium.DISK, [b"x" * MAX_KEY_BYTES]).keys == (b"x" * MAX_KEY_BYTES,)
    assert len(disk_blocks([])) == 0


def test_transfer_spec_takes_keyed_blocks() -> None:
    spec = TransferSpec(cpu_blocks([0, 1]), disk_blocks([b"a", b"b"]))
    assert spec.pair == (Medium.CPU, Medium.DISK)
    with pytest.raises(InvalidTransferError, match="BlockSpec or KeyedBlocks"):
        TransferSpec(cpu_blocks([0]), [b"a"])  # type: ignore[arg-type]


# ------------------------------------------------------------------ Trailer


@settings(max_examples=50, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=4096),
    key=st.binary(min_size=1, max_size=MAX_KEY_BYTES),
    align=st.sampled_from([1, 512, 4096]),
    flip=st.integers(min_value=0),
)
def test_trailer_round_trip_and_any_flipped_payload_bit_is_caught(
    payload: bytes, key: bytes, align: int, flip: int
) -> None:
    trailer = Trailer.for_payload(key, payload)
    data = trailer.encode(align)
    assert len(data) == Trailer.size(len(key), align)
    assert len(data) % align == 0
    back = Trailer.decode(data, key=key, length=len(payload))
    assert back == trailer
    back.verify(payload)
    bad = bytearray(payload)
    bit = flip % (len(payload) * 8)
    bad[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(TrailerError) as info:
        back.verify(bad)
    assert info.value.reason == "checksum"


def test_trailer_refuses_foreign_key_other_length_truncation_and_other_formats() -> None:
    payload = os.urandom(1000)
    data = Trailer.for_payload(b"key-a", payload).encode(4096)

    def reason(blob: bytes, *, key: bytes = b"key-a", length: int = 1000) -> str:
        with pytest.raises(TrailerError) as info:
            Trailer.decode(blob, key=key, length=length)
        return info.value.reason

    assert reason(data, key=b"key-b") == "key"
    assert reason(data, length=999) == "length"
    assert reason(data[:20]) == "truncated"
    assert reason(bytes(4096)) == "magic"
    other = bytearray(data)
    other[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    assert reason(bytes(other)) == "version"
    # the checksum covers the key: a trailer rewritten to name another key fails
    forged = bytearray(data)
    at = data.index(b"key-a")
    forged[at : at + 5] = b"key-b"
    trailer = Trailer.decode(bytes(forged), key=b"key-b", length=1000)
    with pytest.raises(TrailerError, match="checksum"):
        trailer.verify(payload)
    with pytest.raises(TrailerError) as info:
        trailer.verify(payload[:-1])
    assert info.value.reason == "length"


# ------------------------------------------------------------------ LayoutDigest


def _digest(**over: object) -> LayoutDigest:
    base: dict[str, object] = dict(
        model="tiny-llama", dtype="float32", block_size=16, chunk_blocks=2, page_bytes=65536
    )
    base.update(over)
    return LayoutDigest(**base)  # type: ignore[arg-type]


def test_layout_digest_round_trips_and_names_each_field() -> None:
    d = _digest(rank=1, world_size=2)
    assert LayoutDigest.from_json(d.to_json()) == d
    assert d.format_version == FORMAT_VERSION
    assert len(d.hexdigest) == 16 and d.hexdigest == _digest(rank=1, world_size=2).hexdigest
    variants = [
        _digest(model="other"),
        _digest(dtype="bfloat16"),
        _digest(block_size=32),
        _digest(chunk_blocks=1),
        _digest(page_bytes=4096),
        _digest(rank=0, world_size=2),
        _digest(format_version=FORMAT_VERSION + 1),
    ]
    assert len({v.hexdigest for v in [d, *variants]}) == len(variants) + 1
    with pytest.raises(LayoutMismatchError, match=r"dtype: 'bfloat16' != 'float32'"):
        _digest().check_same(_digest(dtype="bfloat16"), where="dir /x")
    _digest().check_same(_digest(), where="dir /x")


@pytest.mark.parametrize(
    "over",
    [
        {"model": ""},
        {"dtype": 3},
        {"block_size": 0},
        {"page_bytes": True},
        {"rank": -1},
        {"rank": 2, "world_size": 2},
    ],
)
def test_layout_digest_refuses_bad_fields(over: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _digest(**over)


@pytest.mark.parametrize(
    "text", ["not json", "[]", '{"model": "m"}', _digest().to_json().replace("16", "-16")]
)
def test_layout_digest_from_foreign_json_is_a_mismatch(text: str) -> None:
    with pytest.raises(LayoutMismatchError):
        LayoutDigest.from_json(text)


# ------------------------------------------------------------------ map_keyed


def test_map_keyed_pairs_keys_with_host_blocks() -> None:
    tier = HostTier(4, 256, factor=2)
    store = map_keyed(
        TransferSpec(cpu_blocks([3, 1]), disk_blocks([b"a", b"b"])),
        tier,
        medium=Medium.DISK,
        who="t",
    )
    assert store.store and store.keys == (b"a", b"b") and store.blocks.tolist() == [3, 1]
    assert store.block_bytes == 512 and store.nbytes == 1024
    load = map_keyed(
        TransferSpec(remote_blocks([b"a"]), cpu_blocks([0])), tier, medium=Medium.REMOTE, who="t"
    )
    assert not load.store and load.medium is Medium.REMOTE


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (
            TransferSpec(cpu_blocks([0]), disk_blocks([b"a", b"b"])),
            BlockCountMismatchError,
            "1 host-tier blocks for 2 keys",
        ),
        (
            TransferSpec(cpu_blocks([4]), disk_blocks([b"a"])),
            InvalidBlockIdsError,
            "outside",
        ),
        (
            TransferSpec(disk_blocks([b"a", b"b"]), cpu_blocks([1, 1])),
            InvalidBlockIdsError,
            "twice",
        ),
        (
            TransferSpec(cpu_blocks([0]), remote_blocks([b"a"])),
            InvalidTransferError,
            "DISK keys",
        ),
        (
            TransferSpec(host_cache_blocks([0]), disk_blocks([b"a"])),
            InvalidTransferError,
            "TierBlocks <-> KeyedBlocks",
        ),
        (
            TransferSpec(TierBlocks(Medium.GPU, np.array([0])), disk_blocks([b"a"])),
            InvalidTransferError,
            "CPU tier blocks",
        ),
    ],
)
def test_map_keyed_refuses_bad_jobs(spec: TransferSpec, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        map_keyed(spec, HostTier(4, 256), medium=Medium.DISK, who="t")


def test_map_keyed_refuses_a_released_tier() -> None:
    tier = HostTier(1, 64)
    tier.release()
    with pytest.raises(LayoutError, match="released"):
        map_keyed(
            TransferSpec(cpu_blocks([0]), disk_blocks([b"a"])), tier, medium=Medium.DISK, who="t"
        )
