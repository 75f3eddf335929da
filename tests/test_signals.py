"""The application's signals stay the application's.

A server's shutdown is a SIGTERM handled in Python (vLLM's engine core: set a flag,
wake the busy loop). Python runs a handler only in the main thread, once that thread
runs Python again; a main thread asleep on a lock gets there because the signal's
arrival interrupts its wait. Two things the engine controls could take that away: a
signal action that native code put back with C ``signal()`` (``SA_RESTART``: the
wait resumes, the handler waits forever), which ``keep_signal_actions`` undoes, and
an engine thread taking the signal, which its threads block.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from offload_engine import SyncOffloadingEngine, TransferSpec, cpu_blocks, gpu_blocks
from offload_engine._loop import APPLICATION_SIGNALS, block_application_signals
from offload_engine.testing import FakeHandler
from offload_engine.vocabulary import Medium

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="signal actions and /proc")

ROOT = Path(__file__).resolve().parents[1]

#: a main thread asleep on a queue until its SIGTERM handler runs; native code first
#: saves and puts back SIGTERM's handler with C signal(), inside keep_signal_actions or not
WAIT_FOR_SIGTERM = """
import ctypes, os, queue, signal, sys, threading
from offload_engine._loop import keep_signal_actions

handled = queue.Queue()
signal.signal(signal.SIGTERM, lambda *_: handled.put("handled"))
libc = ctypes.CDLL(None)
libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)

def native_code():
    previous = libc.signal(signal.SIGTERM, None)
    libc.signal(signal.SIGTERM, previous)

if sys.argv[1] == "kept":
    with keep_signal_actions():
        native_code()
else:
    native_code()
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
print(handled.get())
"""


def wait_for_sigterm(how: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WAIT_FOR_SIGTERM, how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def test_a_handler_put_back_with_c_signal_leaves_a_waiting_main_thread_deaf() -> None:
    """The defect itself, so that the next test is known to test something."""
    with pytest.raises(subprocess.TimeoutExpired):
        wait_for_sigterm("bare", timeout=3)


def test_keep_signal_actions_puts_back_what_native_code_changed() -> None:
    assert wait_for_sigterm("kept", timeout=60).stdout.strip() == "handled"


def blocked_signals(thread: threading.Thread) -> set[int]:
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    [line] = [line for line in status.splitlines() if line.startswith("SigBlk:")]
    mask = int(line.split()[1], 16)
    return {s for s in range(1, 65) if mask & (1 << (s - 1))}


def test_the_engines_threads_leave_the_application_signals_to_the_main_thread() -> None:
    before = set(threading.enumerate())
    handler = FakeHandler(Medium.GPU, Medium.CPU, latency=0.01)
    with SyncOffloadingEngine([handler]) as engine:
        [result] = engine.wait([engine.submit(TransferSpec(gpu_blocks([1]), cpu_blocks([2])))])
        assert result.success
        started = [t for t in threading.enumerate() if t not in before]
        assert started
        wanted = {int(s) for s in APPLICATION_SIGNALS}
        for thread in started:
            assert wanted <= blocked_signals(thread), thread.name
    assert wanted.isdisjoint(blocked_signals(threading.main_thread()))


def test_block_application_signals_blocks_only_the_calling_thread() -> None:
    seen: list[set[int]] = []

    def run() -> None:
        block_application_signals()
        seen.append(blocked_signals(threading.current_thread()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert {int(s) for s in APPLICATION_SIGNALS} <= seen[0]
    assert not {int(s) for s in APPLICATION_SIGNALS} & blocked_signals(threading.main_thread())
