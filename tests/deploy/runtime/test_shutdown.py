"""`Shutdown`, in processes of their own: a signal that the kernel hands to a thread other than
the main one still drains a main thread waiting in `wait_for_drain` (a tensor-parallel executor's
monitor thread signals its own process so; a main thread blocked in a plain `Event.wait()` never
ran the handler, and the executor went on answering its handshake until it was killed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A process whose main thread waits for the drain while another thread, after a moment, sends
# SIGTERM to itself (thread-directed: the main thread does not receive it).
SIGNALLED_FROM_A_THREAD = """
import signal, sys, threading, time
from npuserve.deploy.runtime.shutdown import Shutdown

shutdown = Shutdown()
shutdown.install()

def signal_from_this_thread():
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=signal_from_this_thread, daemon=True).start()
shutdown.wait_for_drain()
print("drained", shutdown.signals, flush=True)
"""
HANG_GUARD_S = 30  # NOTE: not a timing bound: a main thread that never wakes fails here


def test_a_signal_another_thread_received_drains_the_main_thread() -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", SIGNALLED_FROM_A_THREAD],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the main thread never handled the signal another thread received")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "drained 1"
