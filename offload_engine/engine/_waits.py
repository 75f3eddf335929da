"""The handler contract's wait hooks, called on a set of handlers at once.

Every wait of the engine (for results, for room in a route, for close) and
every collection of results goes through a :class:`Waits`: the engine's one
seam for the handlers' fast paths. It holds only the handlers whose hooks do
something (:func:`~offload_engine.engine.handler.hooks_waits`), so an engine
without such handlers loops over an empty tuple.

A :class:`Waits` is immutable: the manager replaces its own when a handler
registers, so a thread that read the old one finishes its wait with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from offload_engine.engine.handler import TransferHandler, hooks_waits


class Waits:
    __slots__ = ("handlers",)

    def __init__(self, handlers: Iterable[TransferHandler[Any]] = ()) -> None:
        self.handlers: tuple[TransferHandler[Any], ...] = tuple(
            h for h in handlers if hooks_waits(h)
        )

    def poll(self) -> None:
        """A caller collects results: let each handler report what has finished."""
        for handler in self.handlers:
            handler.poll()

    def begin(self) -> None:
        """A wait starts. Never under the engine's lock."""
        for handler in self.handlers:
            handler.begin_wait()

    def end(self) -> None:
        """The wait that :meth:`begin` announced is over. Never under the engine's lock."""
        for handler in self.handlers:
            handler.end_wait()


#: the hooks of a wait that concerns no handler's jobs
NO_WAITS = Waits()
