"""How a device job reaches the streams and how its outcome is reported.

``launch`` only queues a job: a **launcher thread** enqueues its device work and
a **watcher thread** sleeps on the job's events, in launch order, and reports
it. A small job goes on the streams on the thread that hands it over (the
engine's loop, or with ``submitter_launch`` the submitting thread) when the
launcher has nothing pending, so jobs still launch in order: a thread wake-up
and the GIL hand-offs it brings cost more than such a launch. So does a job
with a fence, whatever its size, and the engine hands it to the submitting
thread: a stream waits on it soon (a layer-wise load's part), and the hand-offs
would delay its first copy by about a millisecond. With
``polled_completion`` a launched job waits in a queue that the caller's own poll
(the engine's ``get_finished``) checks with event queries, and the watcher
reports only while someone waits.

A job's calls go to the launch context's ``ops``: the runtime, or with the native
launch a program that records them and issues them in one native call.
:class:`Launcher` owns the queues, locks and threads; it is given what to call
(``enqueue`` a job's work, ``recycle`` its resources once it is reported) and
knows nothing else of the handler.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from offload_engine._loop import ThreadSignal, block_application_signals, join_threads
from offload_engine.device.config import CopyStrategy
from offload_engine.device.dma import enqueue_dma
from offload_engine.device.kernel import enqueue_kernel
from offload_engine.device.multipath import Multipath, enqueue_split
from offload_engine.device.plan import DevicePlan
from offload_engine.device.staged import enqueue_staged
from offload_engine.device.staged_native import enqueue_staged_native
from offload_engine.engine.handler import LaunchedJob
from offload_engine.errors import ConfigError

if TYPE_CHECKING:
    from offload_engine.device.context import JobOrder, LaunchContext
    from offload_engine.device.runtimes.base import DeviceRuntime

#: put on the launcher's queue at close; the launcher passes it on to the watcher
STOP = object()

Job = LaunchedJob[DevicePlan]


class Launcher:
    """One handler's launches and completions (see the module's docstring).

    ``enqueue(plan)`` puts a job's work on the streams (jobs take effect in the order
    it is called); ``recycle(plan)`` hands a reported job's events and id buffer back.
    ``inline_units``: a job of at most this many units launches on the thread that
    hands it over while the launcher has nothing pending (0: never).
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        *,
        enqueue: Callable[[DevicePlan], None],
        recycle: Callable[[DevicePlan], None],
        inline_units: int,
        polled_completion: bool,
        name: str,
    ) -> None:
        self.runtime = runtime
        self._enqueue = enqueue
        self._recycle = recycle
        self._inline_units = inline_units
        self.polled_completion = polled_completion
        self.name = name
        # polled completion: launched jobs nobody reported yet, in launch order,
        # and how many callers wait (while any do, jobs go to the watcher instead)
        self._polled: collections.deque[Job] = collections.deque()
        self._watchers = 0
        self._poll_lock = threading.Lock()
        self._launch_q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.watch_q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._pending = 0  # jobs handed to the launcher thread and not yet enqueued
        self._pending_lock = threading.Lock()
        self._done: ThreadSignal | None = None
        #: the launcher and watcher threads, from start until stop joined them
        self.threads: list[threading.Thread] = []

    def start(self, launch_stream: Any, call_soon: Callable[..., object]) -> None:
        """Start the threads. The launcher: enqueues each job's device work with
        ``launch_stream`` its current stream (driver calls release the GIL, so two
        handlers' launchers run in parallel, off the event loop); the watcher: sleeps
        on each job's events in order and reports the outcome."""
        self._done = ThreadSignal(call_soon)
        self.threads = [
            threading.Thread(
                target=self._launch_loop,
                args=(launch_stream,),
                name=f"{self.name}-launch",
                daemon=True,
            ),
            threading.Thread(target=self._watch_loop, name=f"{self.name}-watch", daemon=True),
        ]
        for t in self.threads:
            t.start()

    async def stop(self, timeout: float, stuck: str) -> None:
        """Let the launched jobs be reported, then end the threads (see
        :func:`~offload_engine._loop.join_threads` for ``timeout`` and ``stuck``)."""
        self.watch(1)  # jobs never polled (abandoned at close) are awaited by the watcher
        self._launch_q.put(STOP)  # the launcher passes it on to the watcher
        await join_threads(self.threads, self._done, timeout, stuck)

    def owns_thread(self, thread: threading.Thread) -> bool:
        return thread in self.threads

    def launch(self, job: Job) -> None:
        # Launch calls never overlap and only they add to ``_pending``, so a zero read
        # here stays zero.
        plan = job.prepared
        if self._pending == 0 and (
            0 < plan.units <= self._inline_units or (plan.fence is not None and self._inline_units)
        ):
            self._launch_one(job)
            return
        with self._pending_lock:
            self._pending += 1
        self._launch_q.put(job)

    def _launch_one(self, job: Job) -> None:
        try:
            self._enqueue(job.prepared)
        except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
            job.fail(exc)
            self._recycle(job.prepared)
            return
        if self.polled_completion:
            with self._poll_lock:
                if not self._watchers:
                    self._polled.append(job)
                    return
        self.watch_q.put(job)

    def poll(self) -> None:
        """Report the leading run of finished jobs (event queries, no waiting)."""
        if not self._polled:
            return
        done: list[tuple[Job, BaseException | None]] = []
        with self._poll_lock:
            polled = self._polled
            while polled:
                job = polled[0]
                settled, error = self._settled(job.prepared.checks)
                if not settled:
                    break
                polled.popleft()
                done.append((job, error))
        # reported outside the lock (a report takes the engine's lock); the engine
        # delivers an ordered handler's results in launch order whoever reports
        for job, error in done:
            if error is None:
                plan = job.prepared
                job.succeed(plan.nbytes, strategy=plan.strategy.value)
            else:
                job.fail(error)
            self._recycle(job.prepared)

    def _settled(self, checks: list[Any]) -> tuple[bool, BaseException | None]:
        """Whether every check event is reached, failed ones included, and the first
        failure. A failed job is reported only once the rest of its work has ended
        too: its id buffer and events go back to the pools then, and a caller that
        reuses its destinations finds no copy of it still writing there."""
        query = self.runtime.query
        error: BaseException | None = None
        for event in checks:
            try:
                if not query(event):
                    return False, None
            except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                error = error or exc
        return True, error

    def watch(self, delta: int) -> None:
        """While someone waits, the watcher thread reports each job as it finishes."""
        with self._poll_lock:
            self._watchers += delta
            if self._watchers > 0:
                while self._polled:
                    self.watch_q.put(self._polled.popleft())

    def _launch_loop(self, launch_stream: Any) -> None:
        block_application_signals()
        # the SM stream is this thread's current stream throughout, so a kernel
        # launch (which goes on the current stream) needs no stream switch per job
        with self.runtime.launcher_context(launch_stream):
            while True:
                item: Any = self._launch_q.get()
                if item is STOP:
                    self.watch_q.put(STOP)
                    return
                self._launch_one(item)
                with self._pending_lock:
                    self._pending -= 1

    def _watch_loop(self) -> None:
        block_application_signals()
        try:
            while True:
                item: Any = self.watch_q.get()
                if item is STOP:
                    return
                job: Job = item
                plan = job.prepared
                # every check is waited for, past a failed one (see _settled)
                error: BaseException | None = None
                for event in plan.checks:
                    try:
                        self.runtime.synchronize(event)
                    except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                        error = error or exc
                if error is None:
                    job.succeed(plan.nbytes, strategy=plan.strategy.value)
                else:
                    job.fail(error)
                self._recycle(plan)
        finally:
            if self._done is not None:
                self._done.set()


def enqueue(
    ctx: LaunchContext, order: JobOrder, plan: DevicePlan, multipath: Multipath | None = None
) -> None:
    """Put one job's work on the next stream set. With the native launch, the calls
    are recorded and then issued by one native call. With ``multipath`` (borrowed
    peers' links), a large staged job is split over the own link and theirs."""
    native = ctx.native
    if native is not None:
        native.begin()
    sm, dmas = order.next_set(ctx.pool)
    if plan.strategy is CopyStrategy.DMA:
        enqueue_dma(ctx, order, plan, dmas[0])
    elif plan.strategy is CopyStrategy.KERNEL:
        enqueue_kernel(ctx, order, plan, sm)
    elif ctx.staging is None:  # pragma: no cover - guarded at construction
        raise ConfigError("no staging memory")
    elif native is not None:
        enqueue_staged_native(ctx, order, plan, sm, dmas, ctx.staging, native)
    else:
        parts = None if multipath is None else multipath.split(plan)
        if parts is None:
            enqueue_staged(ctx, order, plan, sm, dmas)
        else:
            enqueue_split(ctx, order, plan, (sm, dmas), parts)
    if native is not None:
        native.run()
    fence = plan.fence
    if fence is not None:
        # the events after which this job's writes are done. They are pooled: once the
        # job is done (the fence then waits no more) one may be recorded again for a
        # later job, and a stream wait that slips in just then waits for that job too,
        # which delays but never reorders
        events = [event for event, _ in order.last_effect]
        fence.launched(functools.partial(_current_stream_waits, ctx.runtime, events))


def _current_stream_waits(rt: Any, events: list[Any]) -> None:
    """Make the calling thread's current stream wait on ``events`` (a fence's wait)."""
    stream = rt.current_stream()
    for event in events:
        rt.wait_event(stream, event)
