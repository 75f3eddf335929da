"""The store protocol: what a remote tier asks of a distributed key-value store.

A backend stores **objects** under string keys. An object is written from, and
read into, a list of *parts*: 1-D uint8 CPU tensors whose concatenation is the
object (a tier slot, then its trailer). Three batch calls cover a tier's needs:

* :meth:`RemoteStore.exists` (and :meth:`RemoteStore.longest_prefix` on top of
  it): which keys are stored;
* :meth:`RemoteStore.put`: write each key's parts as one object;
* :meth:`RemoteStore.get_into`: read each key's object into its parts, and say
  per key whether it arrived whole (a *hit*) or not (a *miss*: absent, evicted,
  another size, or lost with a server). A miss is an answer, not an error.

A call the server cannot answer raises :class:`~offload_engine.StoreUnavailableError`
(or :class:`~offload_engine.StoreAuthError` for refused credentials), never a bool.
Every backend is safe to call from several threads at once.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar, Self

import torch

from offload_engine.errors import ConfigError, StoreError

Parts = Sequence[torch.Tensor]


def check_parts(keys: Sequence[str], objects: Sequence[Parts]) -> list[int]:
    """Check that each key has parts (1-D contiguous uint8 CPU tensors); return each
    object's total size."""
    if len(keys) != len(objects):
        raise ConfigError(f"{len(keys)} keys for {len(objects)} objects")
    sizes = []
    for parts in objects:
        total = 0
        for p in parts:
            if p.dtype != torch.uint8 or p.dim() != 1 or p.device.type != "cpu":
                raise ConfigError(
                    f"object parts must be 1-D uint8 CPU tensors, got {p.dtype} "
                    f"{tuple(p.shape)} on {p.device}"
                )
            if not p.is_contiguous():
                raise ConfigError("object parts must be contiguous")
            total += p.numel()
        if total == 0:
            raise ConfigError("an object must hold at least one byte")
        sizes.append(total)
    return sizes


class RemoteStore(abc.ABC):
    """A batch key-value store that a remote tier keeps its objects in."""

    backend: ClassVar[str]

    def __init__(self) -> None:
        self._closed = False

    def register(self, memory: torch.Tensor) -> None:
        """Announce host memory that parts will point into (a tier's slots).

        Backends that move bytes straight from and into registered memory
        (Mooncake) register it here; others ignore it. Call before any put or
        get whose parts lie in ``memory``.
        """
        return None

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored now (a later get may still miss)."""

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are all stored."""
        n = 0
        for present in self.exists(keys):
            if not present:
                break
            n += 1
        return n

    @abc.abstractmethod
    def put(self, keys: Sequence[str], objects: Sequence[Parts]) -> None:
        """Store each key's parts as one object. Raises :class:`StoreError` naming
        the keys that were not stored."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], objects: Sequence[Parts]) -> list[bool]:
        """Fill each key's parts with its object; True where the object arrived
        whole and of exactly the parts' total size. On False the parts' bytes are
        undefined."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> None:
        """Delete the keys (absent ones are ignored)."""

    @property
    @abc.abstractmethod
    def client(self) -> Any:
        """The backend library's own client (for benchmarks and diagnostics)."""

    @abc.abstractmethod
    def _close(self) -> None: ...

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the connection (and registrations). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
