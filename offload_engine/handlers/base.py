"""The handler contract: what one (source, destination) medium pair implements.

A handler sees a job three times:

1. :meth:`TransferHandler.prepare` runs **at submit, in the submitting thread**.
   It validates the spec against the handler's pools (typed errors, nothing
   queued on failure) and does the submit-time work that must happen in the
   caller's context. A device handler records an event on the caller's current
   (compute) stream here, so a store never reads blocks the model is still
   writing. It returns an opaque *prepared* object.
2. :meth:`TransferHandler.launch` runs **on the engine's event loop**. It must
   not block: it starts the work (enqueues copies on a stream, hands the job to
   a worker thread, arms a fake timer) and returns.
3. The work reports back through the :class:`LaunchedJob` it was given, by
   calling ``job.succeed(nbytes)`` or ``job.fail(exc)`` exactly once, **from any
   thread**. Nothing polls: a device handler's watcher thread sleeps in an event
   synchronize, a thread-pool worker calls back when its copy returns, a fake
   calls back from a loop timer.

``ordered = True`` asks the engine to deliver the handler's results in launch
order (the engine holds an early finisher until its predecessors finish).
``max_inflight`` caps how many launched-but-unfinished jobs the handler gets.

Handlers own their resources. The engine calls :meth:`start` once when it
starts (or when the handler is registered on a running engine) and
:meth:`aclose` once when it closes, after the last job has a result.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from offload_engine.vocabulary import Medium, TransferSpec

P = TypeVar("P")
P_co = TypeVar("P_co", covariant=True)


class LoopCaller(Protocol):
    """Thread-safe, non-blocking "run this soon on the engine's loop"."""

    def __call__(self, fn: Callable[..., object], *args: Any) -> None: ...


class LaunchedJob(Protocol[P_co]):
    """What a handler gets for each launched job."""

    @property
    def job_id(self) -> int: ...

    @property
    def spec(self) -> TransferSpec: ...

    @property
    def prepared(self) -> P_co: ...

    @property
    def resolved(self) -> bool:
        """True once the job has an outcome (finished, timed out or abandoned).

        A worker may skip a job that is already resolved.
        """
        ...

    def succeed(self, nbytes: int, seconds: float | None = None) -> None:
        """Report success; ``seconds`` overrides the engine's launch-to-now timing."""
        ...

    def fail(self, error: BaseException) -> None:
        """Report failure; the engine wraps ``error`` in a ``TransferError``."""
        ...


class HandlerContext(Protocol):
    """What the engine gives a handler at :meth:`TransferHandler.start`."""

    @property
    def call_soon(self) -> LoopCaller:
        """Schedule a callable on the engine's loop, from any thread."""
        ...

    def start_task(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Run ``await fn(*args)`` as an engine task; it is cancelled at close,
        before :meth:`TransferHandler.aclose`. Loop thread only."""
        ...


class TransferHandler(abc.ABC, Generic[P]):
    """Moves blocks for one (source, destination) medium pair.

    Subclasses set :attr:`src` and :attr:`dst` (class or instance attributes)
    and implement :meth:`prepare` and :meth:`launch`.
    """

    src: Medium
    dst: Medium
    ordered: bool = True
    max_inflight: int = 64
    #: ``launch`` may run on the thread that submits (any thread), never two at
    #: once: when the handler's queue is empty and it has room, the engine launches
    #: a new job there instead of waking its loop
    launch_in_submitter: bool = False

    @property
    def pair(self) -> tuple[Medium, Medium]:
        return (self.src, self.dst)

    @property
    def name(self) -> str:
        return f"{type(self).__name__}[{self.src.value}->{self.dst.value}]"

    @abc.abstractmethod
    def prepare(self, spec: TransferSpec) -> P:
        """Validate ``spec`` and do submit-time work. Raise a typed error to refuse it."""

    @abc.abstractmethod
    def launch(self, job: LaunchedJob[P]) -> None:
        """Start ``job`` without blocking; report through ``job.succeed``/``job.fail``."""

    def start(self, context: HandlerContext) -> None:
        """Acquire runtime resources (threads, streams). Called once, on the loop."""

    async def aclose(self) -> None:
        """Release every resource. Called once, after the handler's last result."""

    def __repr__(self) -> str:
        return f"<{self.name} ordered={self.ordered} max_inflight={self.max_inflight}>"
