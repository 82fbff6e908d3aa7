"""The one process launcher: readiness through the ready file, a clear error naming who is not
ready and how a child ended, SIGTERM then SIGKILL, and no child outliving a killed launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from npuserve.deploy.grpc_env import (
    GRPC_EXPERIMENTS_ENV,
    GRPC_FORK_SUPPORT_ENV,
    GRPC_IO_EXPERIMENTS,
    set_grpc_environment,
)
from npuserve.deploy.launcher import Launcher, LaunchError

PYTHON = [sys.executable]
# Run as `python -c CODE --ready-file PATH`: sys.argv[2] is the ready file.
READY = (
    "import os, sys, time; from pathlib import Path; from npuserve.proto.ready_file import write_ready_file; "
)
SERVES = READY + "write_ready_file(Path(sys.argv[2]), {'pid': os.getpid()}); time.sleep(60)"
IGNORES_SIGTERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SERVES


def test_ready_children_return_what_they_wrote(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    children = [launcher.start(f"c{i}", ["-c", SERVES], command=PYTHON) for i in range(2)]
    try:
        ready = launcher.wait_ready(children, timeout_s=30)
        assert [r["pid"] for r in ready] == [c.pid for c in children]
    finally:
        codes = launcher.stop(grace_s=5)
    assert codes == {"c0": -signal.SIGTERM, "c1": -signal.SIGTERM}
    assert not any(tmp_path.glob("*.ready.json"))


def test_children_run_grpc_as_npuserve_sets_it_unless_the_operator_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launching process and its children run gRPC without fork handlers (which can abort a
    child between fork and exec) and on the I/O stack `grpc_env` picks; an operator's own
    settings are left as they are."""
    names = (GRPC_FORK_SUPPORT_ENV, GRPC_EXPERIMENTS_ENV)
    reports = (
        READY
        + f"write_ready_file(Path(sys.argv[2]), {{'env': [os.environ.get(n) for n in {names!r}]}}); time.sleep(60)"
    )
    # The operator's own: fork handlers on, gRPC's default experiments (an empty list).
    for presets, expected in (((None, None), ["0", GRPC_IO_EXPERIMENTS]), (("1", ""), ["1", ""])):
        for name, preset in zip(names, presets, strict=True):
            if preset is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, preset)
        set_grpc_environment()
        assert [os.environ[name] for name in names] == expected
        launcher = Launcher(tmp_path)
        child = launcher.start("c", ["-c", reports], command=PYTHON)
        try:
            (ready,) = launcher.wait_ready([child], timeout_s=30)
        finally:
            launcher.stop(grace_s=5)
        assert ready["env"] == expected


@pytest.mark.skipif(sys.platform != "linux", reason="a child's niceness is set where it forks (Linux)")
def test_a_child_started_at_a_lower_priority_runs_so_with_its_threads_and_its_restarts(
    tmp_path: Path,
) -> None:
    """``nice`` lowers the child's priority before it runs anything, so the
    threads it starts have it too; a restart keeps it; the other children keep the
    launcher's own. A child in its own process group stays in the launcher's session."""
    reports = (
        READY
        + "import signal, threading; seen = []; thread = threading.Thread(target=lambda: seen.append(os.nice(0))); "
        + "thread.start(); thread.join(); "
        + "write_ready_file(Path(sys.argv[2]), {'nice': os.nice(0), 'thread_nice': seen[0], "
        + "'group': os.getpgid(0) == os.getpid(), 'sid': os.getsid(0), "
        + "'writes_from_background': signal.getsignal(signal.SIGTTOU) == signal.SIG_IGN}); time.sleep(60)"
    )
    own = os.nice(0)
    launcher = Launcher(tmp_path)
    nicer = launcher.start("nicer", ["-c", reports], command=PYTHON, nice=5, own_process_group=True)
    plain = launcher.start("plain", ["-c", reports], command=PYTHON)
    try:
        ready = launcher.wait_ready([nicer, plain], timeout_s=30)
        os.kill(nicer.pid, signal.SIGKILL)
        nicer.process.wait(timeout=10)
        (restarted,) = launcher.wait_ready([launcher.restart(nicer)], timeout_s=30)
    finally:
        launcher.stop(grace_s=5)
    expected = min(own + 5, 19)
    sid = os.getsid(0)
    in_group = {"group": True, "sid": sid, "writes_from_background": True}
    assert ready[0] == {"nice": expected, "thread_nice": expected, **in_group}
    assert ready[1] == {
        "nice": own,
        "thread_nice": own,
        "group": False,
        "sid": sid,
        "writes_from_background": signal.getsignal(signal.SIGTTOU) == signal.SIG_IGN,  # as here
    }
    assert restarted == ready[0]


def test_not_ready_names_the_child_and_an_exit_shows_its_log(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    slow = launcher.start("slow", ["-c", "import time; time.sleep(60)"], command=PYTHON)
    try:
        with pytest.raises(LaunchError, match=r"not ready after 0 s: slow"):
            launcher.wait_ready([slow], timeout_s=0.3)
        failing = "import sys; print('cannot bind the port', file=sys.stderr); sys.exit(3)"
        launcher.start("broken", ["-c", failing], command=PYTHON, log_path=tmp_path / "broken.log")
        with pytest.raises(LaunchError) as failure:
            launcher.wait_ready([slow], timeout_s=30)
        assert "broken (pid" in str(failure.value) and "exited with code 3" in str(failure.value)
        assert "cannot bind the port" in str(failure.value)
    finally:
        launcher.stop(grace_s=5)


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    stubborn = launcher.start("stubborn", ["-c", IGNORES_SIGTERM], command=PYTHON)
    launcher.wait_ready([stubborn], timeout_s=30)
    assert launcher.stop(grace_s=0.5) == {"stubborn": -signal.SIGKILL}


# A child that drains at its first SIGTERM (for ever, here) and stops at its second, as npuserve's do.
DRAINS = (
    "import signal; signal.signal(signal.SIGTERM, lambda *_: signal.signal(signal.SIGTERM, signal.SIG_DFL)); "
    + SERVES
)
# A child that takes a second to exit once told to.
SLOW_TO_EXIT = (
    "import os, signal, time; signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), os._exit(0))); "
    + SERVES
)


def test_stop_signals_each_child_once_and_kills_those_still_draining(tmp_path: Path) -> None:
    """Stopped last-started first, the slow child holds the stop for a second, long after the
    draining one took its SIGTERM: a second SIGTERM then would end its drain, as an operator's
    second signal does; the stop sends none, and kills it at the end of the grace period."""
    launcher = Launcher(tmp_path)
    children = [
        launcher.start("draining", ["-c", DRAINS], command=PYTHON),
        launcher.start("slow", ["-c", SLOW_TO_EXIT], command=PYTHON),
    ]
    launcher.wait_ready(children, timeout_s=30)
    assert launcher.stop(grace_s=2) == {"draining": -signal.SIGKILL, "slow": 0}


def test_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from npuserve.deploy.launcher import Launcher; "
        f"launcher = Launcher(Path({str(tmp_path)!r})); "
        f"child = launcher.start('child', ['-c', {SERVES!r}], command=[sys.executable]); "
        "launcher.wait_ready([child], 30); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    ready_file = tmp_path / "child.ready.json"
    try:
        deadline = time.monotonic() + 30
        while not ready_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child_pid = int(json.loads(ready_file.read_text())["pid"])
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and os.path.exists(f"/proc/{pid}")
