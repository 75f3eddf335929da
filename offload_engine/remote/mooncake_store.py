"""Mooncake Store backend (``mooncake.store.MooncakeDistributedStore``).

Every byte moves between registered host memory and the store's segments with
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``: the slot
and its trailer are two parts of one object, and neither is copied in Python.
The tier registers its slot memory through :meth:`MooncakeStore.register`.

The client finds the master at ``master`` (``host:port``) and its peers with
``P2PHANDSHAKE`` (no metadata server). With ``segment_bytes > 0`` the client
contributes that much of its own memory to the store, as one node of the
cluster does; with 0 it only uses others' segments.

Return codes are read per key: the object's size is a hit; ``-704`` (not
found), ``-600`` (another size), ``-707`` (the read outlived its lease),
``-800`` (the holder is gone) are misses;
``-900`` (the master cannot be reached) fails the call with
:class:`~offload_engine.StoreUnavailableError`.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from offload_engine.errors import ConfigError, StoreError, StoreUnavailableError
from offload_engine.remote.store import Parts, RemoteStore, check_parts

RPC_FAILED = -900

#: The system libraries the Mooncake wheels link against without bundling them, and the
#: Debian (and Ubuntu) package that ships each; libibverbs1 brings the two libnl ones.
SYSTEM_LIBRARIES = {
    "libibverbs.so.1": "libibverbs1",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}
#: what to install for all of them at once (the loader names only the first one missing)
SYSTEM_PACKAGES = ("libibverbs1", "libnuma1", "libcurl4")

NOT_INSTALLED = (
    "the Mooncake client is not installed: from the offload-engine checkout, "
    "pip install -e '.[remote]' (x86_64, Python 3.11), or pip install "
    "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA)"
)

# the dynamic loader's words for a library it cannot find, as ImportError carries them
_CANNOT_OPEN = re.compile(r"([\w.+-]+\.so(?:\.[\w.]+)?): cannot open shared object file")


def mooncake_import_problem(exc: ImportError) -> str:
    """Why ``import mooncake.store`` raised ``exc``, in one line that names the fix: the
    pip command where the package is missing; where it is installed but a system library
    it links against is not, that library and its Debian package."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mooncake":
        return NOT_INSTALLED
    found = _CANNOT_OPEN.search(str(exc))
    if found is None:
        return f"the Mooncake client does not import: {exc}"
    library = found[1]
    package = SYSTEM_LIBRARIES.get(library)
    if package is None:
        return (
            f"the Mooncake client is installed but cannot load {library}, a system library "
            f"it links against: install the package that ships it ({exc})"
        )
    return (
        f"the Mooncake client is installed but cannot load {library} (Debian package "
        f"{package}): apt-get install {' '.join(SYSTEM_PACKAGES)}, the system libraries "
        "it links against"
    )


def mooncake_missing() -> str | None:
    """Why the Mooncake client cannot be used on this machine
    (:func:`mooncake_import_problem`), or None when ``mooncake.store`` imports."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return mooncake_import_problem(exc)
    return None


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """How to join a Mooncake Store.

    ``master``: the master's ``host:port``. ``local_hostname``: the address peers
    reach this client on. ``segment_bytes``: memory this client contributes (0:
    none). ``local_buffer_bytes``: the client's own transfer buffer.
    ``protocol``: ``"tcp"`` or ``"rdma"`` (with ``rdma_devices``).
    ``metadata_server``: ``"P2PHANDSHAKE"`` (default, no service) or a URL.
    ``connect_timeout``: seconds to wait for the master's port at construction
    (the client itself would retry for about 90 s).
    """

    master: str
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 512 << 20
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    rdma_devices: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    connect_timeout: float = 2.0

    def __post_init__(self) -> None:
        host, sep, port = self.master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"mooncake master must be host:port, got {self.master!r}")
        for key in ("segment_bytes", "local_buffer_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"mooncake {key} must be a non-negative int, got {value!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake protocol must be tcp or rdma, got {self.protocol!r}")
        t = self.connect_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"mooncake connect_timeout must be a positive number, got {t!r}")

    @property
    def master_address(self) -> tuple[str, int]:
        host, _, port = self.master.rpartition(":")
        return host, int(port)


class MooncakeStore(RemoteStore):
    """A :class:`RemoteStore` on a Mooncake Store cluster.

    Construction checks that the master listens (:class:`StoreUnavailableError`
    within ``connect_timeout`` if not), then sets the client up.
    """

    backend = "mooncake"

    def __init__(self, config: MooncakeStoreConfig) -> None:
        if not isinstance(config, MooncakeStoreConfig):
            raise TypeError(
                f"MooncakeStore takes a MooncakeStoreConfig, got {type(config).__name__}"
            )
        super().__init__()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ConfigError(mooncake_import_problem(exc)) from exc
        self.config = config
        self._registered: list[torch.Tensor] = []
        try:
            socket.create_connection(config.master_address, config.connect_timeout).close()
        except OSError as exc:
            raise StoreUnavailableError(
                f"no Mooncake master listens on {config.master}: {exc}"
            ) from exc
        self._client: Any = MooncakeDistributedStore()
        rc = self._client.setup(
            config.local_hostname,
            config.metadata_server,
            config.segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            config.rdma_devices,
            config.master,
        )
        if rc != 0:
            self._client.close()
            raise StoreUnavailableError(
                f"Mooncake client setup against master {config.master} failed (code {rc})"
            )

    def register(self, memory: torch.Tensor) -> None:
        self._check_open()
        if memory.device.type != "cpu" or not memory.is_contiguous():
            raise ConfigError("Mooncake registers contiguous host memory only")
        rc = self._client.register_buffer(memory.data_ptr(), memory.numel() * memory.element_size())
        if rc != 0:
            raise StoreError(f"Mooncake register_buffer failed (code {rc})")
        self._registered.append(memory)

    @staticmethod
    def _pointers(objects: Sequence[Parts]) -> tuple[list[list[int]], list[list[int]]]:
        return (
            [[p.data_ptr() for p in parts] for parts in objects],
            [[p.numel() for p in parts] for parts in objects],
        )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        codes = self._client.batch_is_exist(list(keys))
        if any(c < 0 for c in codes):
            raise StoreUnavailableError(
                f"Mooncake batch_is_exist via master {self.config.master} failed (codes "
                f"{sorted({c for c in codes if c < 0})})"
            )
        return [c == 1 for c in codes]

    def put(self, keys: Sequence[str], objects: Sequence[Parts]) -> None:
        self._check_open()
        check_parts(keys, objects)
        if not keys:
            return
        ptrs, sizes = self._pointers(objects)
        codes = self._client.batch_put_from_multi_buffers(list(keys), ptrs, sizes)
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
        if not bad:
            return
        kind = StoreUnavailableError if any(c == RPC_FAILED for _, c in bad) else StoreError
        raise kind(
            f"Mooncake put failed for {len(bad)} of {len(keys)} keys (first: {bad[0][0]!r}, "
            f"code {bad[0][1]})"
        )

    def get_into(self, keys: Sequence[str], objects: Sequence[Parts]) -> list[bool]:
        self._check_open()
        want = check_parts(keys, objects)
        if not keys:
            return []
        ptrs, sizes = self._pointers(objects)
        codes = self._client.batch_get_into_multi_buffers(list(keys), ptrs, sizes)
        if codes and all(c == RPC_FAILED for c in codes):
            raise StoreUnavailableError(
                f"Mooncake get via master {self.config.master} failed (code {RPC_FAILED})"
            )
        return [c == n for c, n in zip(codes, want, strict=True)]

    def remove(self, keys: Sequence[str]) -> None:
        self._check_open()
        if keys:
            self._client.batch_remove(list(keys), True)

    @property
    def client(self) -> Any:
        return self._client

    def _close(self) -> None:
        try:
            for memory in self._registered:
                self._client.unregister_buffer(memory.data_ptr())
        finally:
            self._registered.clear()
            self._client.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<MooncakeStore master={self.config.master} {self.config.protocol} {state}>"
