"""The worker's reports to the front (`step_frames`): what crosses the process boundary."""

from __future__ import annotations

import pickle

from npuserve.scheduler.lanes.step_frames import LaneLoad, LaneReport, carries_reports
from npuserve.scheduler.lanes.worker_messages import CallRaised, CallReturned, WorkerStarted


def test_a_report_crosses_the_pipe_unchanged() -> None:
    report = LaneReport(
        "lane-1",
        updates=[("a", [7], [None], "length", None, 128)],
        ended=[("b", "abort")],
        evacuated=["c"],
        error="gone",
        stats=(1, 2, 3),
        step_seconds=0.25,
        load=LaneLoad(1, 2, 3, 0.5, 64, 32, True, 8),
        kv_events=[(True, b"h")],
        executor_draining=True,
    )
    assert pickle.loads(pickle.dumps([report], pickle.HIGHEST_PROTOCOL)) == [report]
    assert pickle.loads(pickle.dumps(LaneReport("lane-2"))) == LaneReport("lane-2")


def test_only_messages_with_reports_wait_for_an_acknowledgement() -> None:
    """The worker counts, and the front acknowledges, the same messages."""
    assert carries_reports([CallReturned(1, None), LaneReport("lane-1")])
    assert not carries_reports([WorkerStarted()])
    assert not carries_reports([CallReturned(1, None), CallRaised(2, "error", assertion=False)])
