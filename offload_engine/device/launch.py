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

A job's calls go to ``h._ops``: the runtime, or with the native launch a
program that records them and issues them in one native call.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from offload_engine._loop import block_application_signals
from offload_engine.device.config import CopyStrategy
from offload_engine.device.dma import enqueue_dma
from offload_engine.device.kernel import enqueue_kernel
from offload_engine.device.plan import DevicePlan
from offload_engine.device.staged import enqueue_staged
from offload_engine.device.staged_native import enqueue_staged_native
from offload_engine.engine.handler import LaunchedJob
from offload_engine.errors import ConfigError

if TYPE_CHECKING:
    from offload_engine.device.handler import DeviceCopyHandler

#: put on the launcher's queue at close; the launcher passes it on to the watcher
STOP = object()


def launch(h: DeviceCopyHandler, job: LaunchedJob[DevicePlan]) -> None:
    # Launch calls never overlap and only they add to ``_pending``, so a zero read
    # here stays zero.
    plan = job.prepared
    if h._pending == 0 and (
        0 < plan.units <= h._inline_units or (plan.fence is not None and h._inline_units)
    ):
        launch_one(h, job)
        return
    with h._pending_lock:
        h._pending += 1
    h._launch_q.put(job)


def launch_one(h: DeviceCopyHandler, job: LaunchedJob[DevicePlan]) -> None:
    try:
        h._enqueue(job.prepared)
    except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
        job.fail(exc)
        h._recycle(job.prepared)
        return
    if h.polled_completion:
        with h._poll_lock:
            if not h._watchers:
                h._polled.append(job)
                return
    h._watch_q.put(job)


def enqueue(h: DeviceCopyHandler, plan: DevicePlan) -> None:
    """Put one job's work on the next stream set. With the native launch, the calls
    are recorded and then issued by one native call."""
    native = h._native
    if native is not None:
        native.begin()
    sm, dmas = h._pool[h._seq % len(h._pool)]
    h._seq += 1
    if plan.strategy is CopyStrategy.DMA:
        enqueue_dma(h, plan, dmas[0])
    elif plan.strategy is CopyStrategy.KERNEL:
        enqueue_kernel(h, plan, sm)
    elif h._staging is None:  # pragma: no cover - guarded at construction
        raise ConfigError("no staging memory")
    elif native is not None:
        enqueue_staged_native(h, plan, sm, dmas, h._staging, native)
    else:
        enqueue_staged(h, plan, sm, dmas)
    if native is not None:
        native.run()
    fence = plan.fence
    if fence is not None:
        # the events after which this job's writes are done. They are pooled: once the
        # job is done (the fence then waits no more) one may be recorded again for a
        # later job, and a stream wait that slips in just then waits for that job too,
        # which delays but never reorders
        events = [event for event, _ in h._last_effect]
        fence.launched(functools.partial(_current_stream_waits, h.runtime, events))


def _current_stream_waits(rt: Any, events: list[Any]) -> None:
    """Make the calling thread's current stream wait on ``events`` (a fence's wait)."""
    stream = rt.current_stream()
    for event in events:
        rt.wait_event(stream, event)


def poll(h: DeviceCopyHandler) -> None:
    """Report the leading run of finished jobs (event queries, no waiting)."""
    if not h._polled:
        return
    done: list[tuple[LaunchedJob[DevicePlan], BaseException | None]] = []
    query = h.runtime.query
    with h._poll_lock:
        polled = h._polled
        while polled:
            job = polled[0]
            error: BaseException | None = None
            try:
                if not all(query(event) for event in job.prepared.checks):
                    break
            except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                error = exc
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
        h._recycle(job.prepared)


def watch(h: DeviceCopyHandler, delta: int) -> None:
    """While someone waits, the watcher thread reports each job as it finishes."""
    with h._poll_lock:
        h._watchers += delta
        if h._watchers > 0:
            while h._polled:
                h._watch_q.put(h._polled.popleft())


def launch_loop(h: DeviceCopyHandler) -> None:
    block_application_signals()
    # the SM stream is this thread's current stream throughout, so a kernel
    # launch (which goes on the current stream) needs no stream switch per job
    with h.runtime.launcher_context(h._pool[0][0]):
        while True:
            item: Any = h._launch_q.get()
            if item is STOP:
                h._watch_q.put(STOP)
                return
            launch_one(h, item)
            with h._pending_lock:
                h._pending -= 1


def watch_loop(h: DeviceCopyHandler) -> None:
    block_application_signals()
    try:
        while True:
            item: Any = h._watch_q.get()
            if item is STOP:
                return
            job: LaunchedJob[DevicePlan] = item
            plan = job.prepared
            try:
                for event in plan.checks:
                    h.runtime.synchronize(event)
            except Exception as exc:  # noqa: BLE001 - becomes the job's failed result
                job.fail(exc)
            else:
                job.succeed(plan.nbytes, strategy=plan.strategy.value)
            h._recycle(plan)
    finally:
        h._threads_done.set()
