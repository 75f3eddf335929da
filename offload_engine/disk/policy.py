"""Which stored objects the disk tier drops first when its byte cap is reached."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    """Chooses which stored objects to drop when the byte cap is reached.

    The store calls it under its lock: keep each call O(1) and free of I/O. The
    store frees whole segments: it empties the segment of the first victim whose
    segment is idle, and with it every object that segment holds.
    """

    def inserted(self, key: bytes) -> None: ...

    def touched(self, key: bytes) -> None: ...

    def removed(self, key: bytes) -> None: ...

    def victims(self) -> Iterator[bytes]:
        """Keys in the order they should go (the store skips busy ones)."""
        ...


class LRUPolicy:
    """Least recently stored or loaded goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def inserted(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touched(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[bytes]:
        return iter(list(self._order))
