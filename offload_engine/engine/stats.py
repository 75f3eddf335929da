"""Statistics snapshots, as frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from offload_engine.vocabulary import Medium


@dataclass(frozen=True)
class HandlerStats:
    """Counters of one handler since the engine started.

    ``submitted`` = ``succeeded + failed + queued + in_flight``, where
    ``failed`` includes ``cancelled`` and ``timed_out``. ``abandoned`` counts
    in-flight jobs that got a failed result (timeout, close) while the handler
    was still working on them.

    A handler may serve both directions of its medium pair (the host handler
    serves CPU->CPU stores and loads), so successful jobs are also counted by
    direction: ``stores_succeeded``/``bytes_stored`` for KV cache -> tier,
    ``loads_succeeded``/``bytes_loaded`` for tier -> KV cache. Tier-to-tier
    copies count in neither.

    ``by_strategy``: successful jobs per strategy their handler named (a device
    handler names its copy strategy, ``"dma"`` or ``"staged"`` among them, as
    :attr:`TransferResult.strategy <offload_engine.TransferResult>` does), as
    ``(name, jobs)`` pairs sorted by name; :meth:`jobs_by` reads one.
    """

    src: Medium
    dst: Medium
    handler: str
    submitted: int
    succeeded: int
    failed: int
    cancelled: int
    timed_out: int
    abandoned: int
    bytes_moved: int
    queued: int
    in_flight: int
    capacity: int
    stores_succeeded: int = 0
    loads_succeeded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    by_strategy: tuple[tuple[str, int], ...] = ()

    @property
    def pair(self) -> tuple[Medium, Medium]:
        return (self.src, self.dst)

    def jobs_by(self, strategy: str) -> int:
        """Successful jobs that took ``strategy`` (0 if none did)."""
        return dict(self.by_strategy).get(strategy, 0)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the whole engine."""

    state: str
    handlers: tuple[HandlerStats, ...]
    results_ready: int

    def for_pair(self, src: Medium, dst: Medium) -> HandlerStats:
        for h in self.handlers:
            if h.src is src and h.dst is dst:
                return h
        raise KeyError((src, dst))

    @property
    def submitted(self) -> int:
        return sum(h.submitted for h in self.handlers)

    @property
    def succeeded(self) -> int:
        return sum(h.succeeded for h in self.handlers)

    @property
    def failed(self) -> int:
        return sum(h.failed for h in self.handlers)

    @property
    def bytes_moved(self) -> int:
        return sum(h.bytes_moved for h in self.handlers)

    @property
    def stores_succeeded(self) -> int:
        return sum(h.stores_succeeded for h in self.handlers)

    @property
    def loads_succeeded(self) -> int:
        return sum(h.loads_succeeded for h in self.handlers)

    @property
    def bytes_stored(self) -> int:
        return sum(h.bytes_stored for h in self.handlers)

    @property
    def bytes_loaded(self) -> int:
        return sum(h.bytes_loaded for h in self.handlers)
