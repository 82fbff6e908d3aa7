"""Process names: a child names itself, and another process reads the name by pid."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

from npuserve.deploy.runtime.process_name import MAX_COMM_BYTES, ROLES, process_name, set_process_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process names")

# A spawned child that dies before it reports (it cannot import this module, say) fails the test
# instead of leaving it waiting forever.
CHILD_REPORT_TIMEOUT_S = 60


def _name_and_report(name: str, conn: multiprocessing.connection.Connection) -> None:
    set_process_name(name)
    conn.send(process_name(os.getpid()))
    conn.recv()  # stays alive until the parent has looked


@pytest.mark.parametrize("name", [*ROLES, "npuserve-a-name-too-long-for-the-kernel"])
def test_a_process_names_itself_and_others_read_it(name: str) -> None:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_name_and_report, args=(name, child))
    process.start()
    try:
        expected = name[:MAX_COMM_BYTES]
        assert parent.poll(CHILD_REPORT_TIMEOUT_S), (
            f"the child reported nothing (exit code {process.exitcode})"
        )
        assert parent.recv() == expected
        assert process_name(process.pid) == expected
    finally:
        parent.send("done")
        process.join(10)
    assert all(len(role) <= MAX_COMM_BYTES for role in ROLES)


def test_a_gone_process_has_no_name() -> None:
    process = multiprocessing.get_context("spawn").Process(target=os.getpid)
    process.start()
    process.join(10)
    assert process_name(process.pid) is None
