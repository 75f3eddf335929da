"""The adapter's configuration: every ``kv_connector_extra_config`` key it reads.

:func:`parse_extra_config` turns vLLM's untyped mapping into a frozen
:class:`EngineOffloadingConfig` at the boundary, once, when the spec is built
(in the scheduler and in each worker). Every problem it finds is reported in
one :class:`~offload_engine.ConfigError` whose lines each name a key.

Keys the adapter does not read (vLLM reads many of its own: ``spec_name``,
``spec_module_path``, ``self_describing_kv_events``, tier filters, ...) are
left alone. This module does not import vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from offload_engine import ConfigError

CopyStrategy: TypeAlias = Literal["auto", "dma", "staged", "kernel"]

#: Values of ``strategy``: the device handler's copy strategies (see docs/vllm.md).
STRATEGIES: tuple[CopyStrategy, ...] = ("auto", "dma", "staged", "kernel")

LoadMode: TypeAlias = Literal["async", "layerwise"]

#: Values of ``load_mode`` (read by :class:`~offload_engine.connectors.vllm.EngineConnector`).
LOAD_MODES: tuple[LoadMode, ...] = ("async", "layerwise")

StoreMode: TypeAlias = Literal["step", "layerwise"]

#: Values of ``store_mode`` (read by :class:`~offload_engine.connectors.vllm.EngineConnector`).
STORE_MODES: tuple[StoreMode, ...] = ("step", "layerwise")

#: ``layers_per_load``'s default: the KV tensors (layers) one part of a layer-wise load moves.
DEFAULT_LAYERS_PER_LOAD = 4

#: Set in ``kv_connector_extra_config`` by ``EngineConnector`` (never by a user): a
#: layer-wise ``load_mode`` or ``store_mode`` under vLLM's own OffloadingConnector
#: would be ignored.
ENGINE_CONNECTOR_KEY = "_offload_engine_connector"

#: The device handler's default (two buffers of 128 MiB).
DEFAULT_STAGING_BYTES = 256 * 1024 * 1024
DEFAULT_QUEUE_CAPACITY = 4096
# vLLM's CPUOffloadingSpec defaults, restated so the parsed config is complete.
DEFAULT_STORE_THRESHOLD = 0
DEFAULT_MAX_TRACKER_SIZE = 64_000


@dataclass(frozen=True)
class EngineOffloadingConfig:
    """The parsed ``kv_connector_extra_config`` of :class:`EngineOffloadingSpec`.

    ``blocks_per_chunk`` is vLLM's: the number of KV-cache blocks in one
    offloaded chunk (one tier block), resolved by vLLM from the
    ``blocks_per_chunk`` or ``block_size`` key.
    """

    cpu_bytes_to_use: int
    blocks_per_chunk: int = 1
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    store_threshold: int = DEFAULT_STORE_THRESHOLD
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    offload_prompt_only: bool = True
    strategy: CopyStrategy = "auto"
    staging_bytes: int = DEFAULT_STAGING_BYTES
    submitter_launch: bool = False
    polled_completion: bool = False
    native_launch: bool | Literal["auto"] | None = None  # None: DeviceHandlerConfig's default
    job_timeout_s: float | None = None
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    host_workers: int = 1
    stats_path: str | None = None
    load_mode: LoadMode = "async"
    layers_per_load: int = DEFAULT_LAYERS_PER_LOAD
    store_mode: StoreMode = "step"
    # borrowing idle peer GPUs' host links (DeviceHandlerConfig's keys; None: its default)
    peers: tuple[int, ...] | Literal["auto"] | None = None
    peer_staging_bytes: int | None = None
    peer_min_blocks: int | None = None
    # announce this worker's own traffic in the host's peer ledger (None: where it borrows)
    peer_ledger: bool | None = None


class _Reader:
    """Reads keys of one mapping, collecting a line per invalid key."""

    def __init__(self, extra: Mapping[str, Any]) -> None:
        self.extra = extra
        self.problems: list[str] = []

    def bad(self, key: str, want: str) -> None:
        value = self.extra.get(key)
        self.problems.append(
            f"kv_connector_extra_config[{key!r}] must be {want}, "
            f"got {value!r} ({type(value).__name__})"
        )

    def int_(self, key: str, default: int | None, *, minimum: int, want: str) -> int | None:
        if key not in self.extra or self.extra[key] is None:
            return default
        value = self.extra[key]
        parsed: int | None = None
        if isinstance(value, bool):
            parsed = None
        elif isinstance(value, int):
            parsed = value
        elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
            parsed = int(value)  # JSON such as 4e9
        elif isinstance(value, str):
            try:
                parsed = int(value.strip().replace("_", ""))
            except ValueError:
                parsed = None
        if parsed is None or parsed < minimum:
            self.bad(key, want)
            return default
        return parsed

    def float_(self, key: str, want: str) -> float | None:
        if key not in self.extra or self.extra[key] is None:
            return None
        value = self.extra[key]
        parsed: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parsed = float(value)
        elif isinstance(value, str):
            try:
                parsed = float(value)
            except ValueError:
                parsed = None
        if parsed is None or not math.isfinite(parsed) or parsed <= 0:
            self.bad(key, want)
            return None
        return parsed

    def str_(self, key: str, default: str | None, want: str) -> str | None:
        if key not in self.extra or self.extra[key] is None:
            return default
        value = self.extra[key]
        if not isinstance(value, str) or not value.strip():
            self.bad(key, want)
            return default
        return value.strip()

    def bool_(self, key: str, default: bool) -> bool:
        if key not in self.extra or self.extra[key] is None:
            return default
        value = self.extra[key]
        if isinstance(value, bool):
            return value
        # strings are refused: vLLM itself reads these keys with bool(), so "false" is True
        self.bad(key, "a JSON bool (true or false, not a string)")
        return default


def _mode(r: _Reader, extra: Mapping[str, Any], key: str, modes: tuple[str, ...]) -> str:
    """``load_mode`` or ``store_mode`` (EngineConnector's keys): its first value is vLLM's
    own behaviour, and any other one needs EngineConnector."""
    default = modes[0]
    mode = r.str_(key, default, f"one of {', '.join(modes)}") or default
    if mode not in modes:
        r.bad(key, f"one of {', '.join(modes)}")
        return default
    if mode != default and not extra.get(ENGINE_CONNECTOR_KEY):
        r.problems.append(
            f'kv_connector_extra_config[{key!r}]={mode!r} needs "kv_connector": '
            '"EngineConnector" with "kv_connector_module_path": '
            '"offload_engine.connectors.vllm" (vLLM\'s OffloadingConnector '
            + ("loads asynchronously only)" if key == "load_mode" else "stores after the step)")
        )
    return mode


def _load_keys(r: _Reader, extra: Mapping[str, Any]) -> tuple[LoadMode, int, StoreMode]:
    """``load_mode``, ``layers_per_load`` and ``store_mode`` (EngineConnector's keys)."""
    mode = _mode(r, extra, "load_mode", LOAD_MODES)
    per = r.int_("layers_per_load", DEFAULT_LAYERS_PER_LOAD, minimum=1, want="a positive int")
    store = _mode(r, extra, "store_mode", STORE_MODES)
    return mode, per or DEFAULT_LAYERS_PER_LOAD, store  # type: ignore[return-value]


def _peer_keys(
    r: _Reader, native_launch: object
) -> tuple[tuple[int, ...] | Literal["auto"] | None, int | None, int | None, bool | None]:
    """``peers`` (``"auto"``, a list of device indices as this process numbers its
    visible devices, or null: the own link only), ``peer_staging_bytes`` and
    ``peer_min_blocks`` (null: the device handler's defaults), and ``peer_ledger``
    (null: on where ``peers`` names any)."""
    value = r.extra.get("peers")
    peers: tuple[int, ...] | Literal["auto"] | None = None
    if value == "auto":
        peers = "auto"
    elif value is not None:
        if (
            isinstance(value, (list, tuple))
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)
            and len(set(value)) == len(value)
        ):
            peers = tuple(value)
        else:
            r.bad("peers", '"auto", a list of distinct device indices (e.g. [1, 2, 3]) or null')
    if peers and native_launch is True:
        r.problems.append(
            "kv_connector_extra_config: 'peers' needs 'native_launch' false or unset (a job "
            "split over peers' links launches from Python)"
        )
    staging = r.int_("peer_staging_bytes", None, minimum=1, want="a positive number of bytes")
    least = r.int_("peer_min_blocks", None, minimum=1, want="a positive int")
    ledger = r.extra.get("peer_ledger")
    if ledger is not None and not isinstance(ledger, bool):
        r.bad("peer_ledger", "a JSON bool (true or false, not a string) or null")
        ledger = None
    return peers, staging, least, ledger


def parse_extra_config(
    extra: Mapping[str, Any], *, blocks_per_chunk: int | None = None
) -> EngineOffloadingConfig:
    """Parse and validate ``kv_connector_extra_config``.

    ``blocks_per_chunk`` is vLLM's resolved value (``OffloadingConfig.cache``);
    without it the raw ``blocks_per_chunk`` key is used (default 1). Raises one
    :class:`ConfigError` listing every invalid key.
    """
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
        )
    r = _Reader(extra)

    cpu_bytes = r.int_("cpu_bytes_to_use", None, minimum=1, want="a positive number of bytes")
    if "cpu_bytes_to_use" not in extra or extra["cpu_bytes_to_use"] is None:
        r.problems.append(
            "kv_connector_extra_config['cpu_bytes_to_use'] is required: the bytes of host "
            "memory the offload tier may use (e.g. 4000000000)"
        )

    raw_bpc = r.int_("blocks_per_chunk", 1, minimum=1, want="a positive int")
    r.int_("block_size", None, minimum=1, want="a positive number of tokens")
    if extra.get("blocks_per_chunk") is not None and extra.get("block_size") is not None:
        r.problems.append(
            "kv_connector_extra_config: give only one of 'blocks_per_chunk' and 'block_size'"
        )
    if blocks_per_chunk is not None:
        if (
            isinstance(blocks_per_chunk, bool)
            or not isinstance(blocks_per_chunk, int)
            or (blocks_per_chunk < 1)
        ):
            raise ConfigError(f"blocks_per_chunk must be a positive int, got {blocks_per_chunk!r}")
        bpc = blocks_per_chunk
    else:
        bpc = raw_bpc or 1

    # whether the name resolves is checked with vLLM's CachePolicyFactory by the spec
    policy = r.str_("eviction_policy", "lru", "a policy name such as 'lru' or 'arc'") or "lru"
    policy_path = r.str_("cache_policy_module_path", None, "an importable module path")
    store_threshold = r.int_(
        "store_threshold", DEFAULT_STORE_THRESHOLD, minimum=0, want="a non-negative int"
    )
    max_tracker = r.int_(
        "max_tracker_size", DEFAULT_MAX_TRACKER_SIZE, minimum=1, want="a positive int"
    )
    prompt_only = r.bool_("offload_prompt_only", True)
    if r.bool_("canonical_layout", False):
        r.problems.append(
            "kv_connector_extra_config['canonical_layout'] is not supported by "
            "offload-engine's specs: their host tier keeps each worker's own page layout"
        )

    strategy = r.str_("strategy", "auto", f"one of {', '.join(STRATEGIES)}") or "auto"
    if strategy not in STRATEGIES:
        r.bad("strategy", f"one of {', '.join(STRATEGIES)}")
        strategy = "auto"
    staging = r.int_(
        "staging_bytes", DEFAULT_STAGING_BYTES, minimum=1, want="a positive number of bytes"
    )
    # where a device job is launched and how its completion is found (DeviceHandlerConfig)
    submitter_launch = r.bool_("submitter_launch", False)
    polled_completion = r.bool_("polled_completion", False)
    native_launch = r.extra.get("native_launch")
    if not (native_launch is None or isinstance(native_launch, bool) or native_launch == "auto"):
        r.bad("native_launch", "'auto', true or false")
        native_launch = None
    timeout = r.float_("job_timeout_s", "a positive number of seconds (or null for none)")
    capacity = r.int_("queue_capacity", DEFAULT_QUEUE_CAPACITY, minimum=1, want="a positive int")
    workers = r.int_("host_workers", 1, minimum=1, want="a positive int")
    stats_path = r.str_("stats_path", None, "a file path")
    if stats_path is not None:
        try:
            stats_path.format(rank=0)
        except (KeyError, IndexError, ValueError, AttributeError, TypeError):
            # "{rank.x}" raises AttributeError, "{rank[0]}" TypeError: all mean a bad path
            r.bad("stats_path", "a file path whose only {placeholder} is {rank}")
            stats_path = None

    load_mode, layers_per_load, store_mode = _load_keys(r, extra)

    peers, peer_staging, peer_min, peer_ledger = _peer_keys(r, native_launch)

    if r.problems:
        raise ConfigError("invalid offload-engine vLLM config:\n  " + "\n  ".join(r.problems))
    # every value below was checked above; the `or` only narrows the types
    return EngineOffloadingConfig(
        cpu_bytes_to_use=cpu_bytes or 0,
        blocks_per_chunk=bpc,
        eviction_policy=policy,
        cache_policy_module_path=policy_path,
        store_threshold=store_threshold if store_threshold is not None else 0,
        max_tracker_size=max_tracker or DEFAULT_MAX_TRACKER_SIZE,
        offload_prompt_only=prompt_only,
        strategy=strategy,  # type: ignore[arg-type]
        staging_bytes=staging or DEFAULT_STAGING_BYTES,
        submitter_launch=submitter_launch,
        polled_completion=polled_completion,
        native_launch=native_launch,
        job_timeout_s=timeout,
        queue_capacity=capacity or DEFAULT_QUEUE_CAPACITY,
        host_workers=workers or 1,
        stats_path=stats_path,
        load_mode=load_mode,
        layers_per_load=layers_per_load,
        store_mode=store_mode,
        peers=peers,
        peer_staging_bytes=peer_staging,
        peer_min_blocks=peer_min,
        peer_ledger=peer_ledger,
    )
