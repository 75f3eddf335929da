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
   thread**. No thread polls on a timer: a device handler's watcher thread sleeps in an event
   synchronize, a thread-pool worker calls back when its copy returns, a fake
   calls back from a loop timer.

Two fast paths let a handler skip the loop. Each is a switch the engine reads
once, at registration, and the engine's submit and wait paths make the same
calls whether a handler takes them or not:

* **Launch in the submitter** (``launch_in_submitter = True``): ``launch`` is
  safe on any thread, never two at once. When the handler's queue is empty and
  it has room, the engine launches a new job on the submitting thread instead of
  waking its loop (the submit's one "queue it, or launch it here" step), if
  :meth:`TransferHandler.launch_here` says so for that job (default: every job).
* **Polled completion** (``polled_completion = True``): the handler may leave a
  finished job unreported until :meth:`TransferHandler.poll`, and reports
  unprompted only while :meth:`TransferHandler.watch` counts someone waiting.

The seam for waits is :meth:`TransferHandler.poll` (a caller collects results,
or a deadline comes due) and the pair :meth:`TransferHandler.begin_wait` /
:meth:`TransferHandler.end_wait` (someone starts or stops waiting on the
handler's jobs: for a result, for room, or for close). The engine calls them
around every wait, on each handler for which :func:`hooks_waits` is true; their
defaults serve ``polled_completion`` through ``poll`` and ``watch``, and a
handler may override the pair instead.

``ordered = True`` asks the engine to deliver the handler's results in launch
order (the engine holds an early finisher until its predecessors finish).
``max_inflight`` caps how many launched-but-unfinished jobs the handler gets.

Handlers own their resources. The engine calls :meth:`start` once when it
starts (or when the handler is registered on a running engine) and
:meth:`aclose` once when it closes, after the last job has a result.

A handler belongs to one engine at a time, and is used once: registering it
with a second engine while the first holds it, or registering it after an
engine closed it, raises :class:`~offload_engine.HandlerRegistrationError`
(build a new handler instead). An engine that never started lets its
handlers go when it is closed or garbage-collected.
"""

from __future__ import annotations

import abc
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from offload_engine._checks import check_int
from offload_engine.errors import HandlerRegistrationError
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

    def succeed(
        self, nbytes: int, seconds: float | None = None, strategy: str | None = None
    ) -> None:
        """Report success; ``seconds`` overrides the engine's launch-to-now timing;
        ``strategy`` names how the bytes moved (the result's
        :attr:`~offload_engine.TransferResult.strategy`, counted in
        :attr:`~offload_engine.HandlerStats.by_strategy`)."""
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
    #: a new job there instead of waking its loop. Read once, at registration.
    launch_in_submitter: bool = False
    #: the handler may leave a finished job unreported until :meth:`poll`; the
    #: default :meth:`begin_wait` and :meth:`end_wait` then have it :meth:`watch`
    #: every wait, so nobody waits on a job that only a poll would report. Read
    #: once, at registration.
    polled_completion: bool = False

    @property
    def pair(self) -> tuple[Medium, Medium]:
        return (self.src, self.dst)

    @property
    def name(self) -> str:
        return f"{type(self).__name__}[{self.src.value}->{self.dst.value}]"

    @abc.abstractmethod
    def prepare(self, spec: TransferSpec) -> P:
        """Validate ``spec`` and do submit-time work. Raise a typed error to refuse it."""

    def launch_here(self, prepared: P) -> bool:
        """With ``launch_in_submitter``: whether the thread that submits this job
        launches it when the handler's queue is empty and it has room (else the
        engine's loop does). Called under the engine's lock, so it only looks at
        ``prepared``. Default: every job."""
        return True

    @abc.abstractmethod
    def launch(self, job: LaunchedJob[P]) -> None:
        """Start ``job`` without blocking; report through ``job.succeed``/``job.fail``."""

    def poll(self) -> None:
        """Report the launched jobs that have finished, without blocking. Any
        thread. The engine calls it in ``get_finished`` (the caller's thread) and
        when a deadline comes due, before it times a job out."""

    def watch(self, delta: int) -> None:
        """Someone started (+1) or stopped (-1) waiting for this handler's jobs:
        while the count is positive, report each job as it finishes without
        waiting for a :meth:`poll`. Any thread, never under the engine's lock
        (``polled_completion`` handlers, through the default wait hooks)."""

    def begin_wait(self) -> None:
        """Someone starts waiting on this handler's jobs (for a result, for room
        in its queue or in flight, or for close); :meth:`end_wait` follows. Any
        thread, never under the engine's lock. A handler that holds finished jobs
        back reports them now, and as they finish until the wait ends. The
        default does that for ``polled_completion``: :meth:`poll`, then
        ``watch(1)``."""
        if self.polled_completion:
            self.poll()
            self.watch(1)

    def end_wait(self) -> None:
        """The wait :meth:`begin_wait` announced is over (it got what it waited
        for, timed out or was cancelled). The default: ``watch(-1)`` for
        ``polled_completion``."""
        if self.polled_completion:
            self.watch(-1)

    def start(self, context: HandlerContext) -> None:
        """Acquire runtime resources (threads, streams). Called once, on the loop."""

    async def aclose(self) -> None:
        """Release every resource. Called once, after the handler's last result."""

    def owns_thread(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is one of this handler's own threads (a worker, a
        launcher, a watcher). The engine refuses to close from such a thread:
        close waits for the very job that thread is running."""
        return False

    def __repr__(self) -> str:
        return f"<{self.name} ordered={self.ordered} max_inflight={self.max_inflight}>"


def hooks_waits(handler: TransferHandler[Any]) -> bool:
    """Whether the engine calls ``handler``'s wait hooks (:meth:`~TransferHandler.poll`,
    :meth:`~TransferHandler.begin_wait`, :meth:`~TransferHandler.end_wait`): when it
    has ``polled_completion`` or overrides the wait pair. Asked once, at registration;
    the other handlers' waits make no calls at all."""
    cls = type(handler)
    return (
        bool(handler.polled_completion)
        or cls.begin_wait is not TransferHandler.begin_wait
        or cls.end_wait is not TransferHandler.end_wait
    )


def registrable_pair(handler: object) -> tuple[Medium, Medium]:
    """``handler``'s (src, dst) media, or HandlerRegistrationError if it is no
    handler an engine can register."""
    if not isinstance(handler, TransferHandler):
        raise HandlerRegistrationError(
            f"handlers implement TransferHandler, got {type(handler).__name__}"
        )
    try:
        pair = (handler.src, handler.dst)
    except AttributeError as exc:
        raise HandlerRegistrationError(f"{type(handler).__name__} lacks src/dst media") from exc
    if not all(isinstance(m, Medium) for m in pair):
        # not {handler!r}: a handler's repr formats its media, which are the problem
        raise HandlerRegistrationError(
            f"{type(handler).__name__}: src and dst must be Medium members, "
            f"got {pair[0]!r} -> {pair[1]!r}"
        )
    check_int(handler.max_inflight, f"{handler!r}: max_inflight", error=HandlerRegistrationError)
    return pair


# --------------------------------------------------------------------------- ownership

# Which engine holds each handler, and which handlers an engine has closed. Kept
# here rather than on the handler, so a subclass that skips
# ``TransferHandler.__init__`` or defines ``__slots__`` is covered too. Keyed by
# ``id`` (a handler's own ``__eq__``/``__hash__`` never runs); an entry goes when
# its handler is garbage-collected. The lock makes a claim from two threads at
# once pick one winner.
_ownership_lock = threading.RLock()  # reentrant: a GC pass inside may run _forget
# id(handler) -> (the handler, weakly; its holder, weakly, or None once retired)
_registry: dict[int, tuple[weakref.ref[Any], weakref.ref[object] | None]] = {}


def _forget(key: int) -> Callable[[object], None]:
    def callback(_ref: object) -> None:
        with _ownership_lock:
            _registry.pop(key, None)

    return callback


def claim_handler(handler: TransferHandler[Any], engine: object) -> None:
    """Make ``engine`` the holder of ``handler``, or raise HandlerRegistrationError."""
    key = id(handler)
    with _ownership_lock:
        entry = _registry.get(key)
        if entry is not None and entry[0]() is handler:
            holder_ref = entry[1]
            if holder_ref is None:
                raise HandlerRegistrationError(
                    f"{handler.name} was closed by the engine that held it; a handler is "
                    "used once: build a new one"
                )
            holder = holder_ref()
            if holder is not None and holder is not engine:
                raise HandlerRegistrationError(
                    f"{handler.name} already belongs to another engine "
                    f"({type(holder).__name__} at {id(holder):#x}); a handler serves one "
                    "engine at a time"
                )
        _registry[key] = (weakref.ref(handler, _forget(key)), weakref.ref(engine))


def release_handler(handler: TransferHandler[Any], engine: object) -> None:
    """``engine`` lets ``handler`` go unused (never started, or its registration failed)."""
    key = id(handler)
    with _ownership_lock:
        entry = _registry.get(key)
        holder = entry[1] if entry is not None and entry[0]() is handler else None
        if holder is not None and holder() is engine:
            del _registry[key]


def retire_handler(handler: TransferHandler[Any]) -> None:
    """An engine closed ``handler``: no engine may register it again."""
    key = id(handler)
    with _ownership_lock:
        _registry[key] = (weakref.ref(handler, _forget(key)), None)
