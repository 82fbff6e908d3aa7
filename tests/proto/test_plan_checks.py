"""The pulls a step plan may carry (`check_kv_pulls`): refused before any block moves."""

from __future__ import annotations

import pytest

from npuserve.proto.plan_checks import PlanError, check_kv_pulls
from npuserve.proto.step_plan import KvPull

NUM_BLOCKS = 10  # ids 1..9; 0 is the null block
SOURCE = "10.0.0.7:50061"


def test_pulls_into_distinct_blocks_in_range_pass() -> None:
    check_kv_pulls([KvPull(SOURCE, "", [9, 9, 4], [1, 2, 9]), KvPull("other:1", "x", [1], [3])], NUM_BLOCKS)
    check_kv_pulls([], NUM_BLOCKS)


@pytest.mark.parametrize(
    ("pulls", "message"),
    [
        ([KvPull(SOURCE, "", [1, 2], [3])], "2 source blocks for 1 blocks here"),
        ([KvPull(SOURCE, "", [], [])], "0 source blocks for 0"),
        ([KvPull("", "", [1], [3])], "a pull names a source"),
        ([KvPull(SOURCE, "", [1], [0])], r"outside 1\.\.9"),
        ([KvPull(SOURCE, "", [1], [10])], r"outside 1\.\.9"),
        ([KvPull(SOURCE, "", [1, 2], [5, 5])], "written twice"),
        ([KvPull(SOURCE, "", [1], [5]), KvPull("other:1", "", [2], [5])], "written twice"),
    ],
)
def test_bad_pulls_are_refused(pulls: list[KvPull], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        check_kv_pulls(pulls, NUM_BLOCKS)
