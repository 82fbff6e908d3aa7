"""`--graph-capture-sizes`: vLLM's ladder up to --max-num-seqs, thinned on Ascend to the graphs
the device's streams hold (vllm-ascend's 1800 / (layers + 1), less with a communication group)."""

from __future__ import annotations

import pytest

from npuserve.executor.config import ConfigError, ExecutorConfig
from npuserve.executor.graph_sizes import capture_sizes, default_capture_sizes, max_npu_graphs, thin


def test_the_default_ladder_ends_at_max_num_seqs() -> None:
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    ladder = default_capture_sizes(300)
    assert ladder[:6] == [1, 2, 4, 8, 16, 24] and 256 in ladder and ladder[-3:] == [272, 288, 300]


def test_the_stream_limit_of_an_ascend_device() -> None:
    assert max_npu_graphs(num_layers=35, tp_size=1) == 50  # 1800 // 36
    assert max_npu_graphs(num_layers=48, tp_size=4) == 11  # (1800 - 40) // 49 // 3
    assert max_npu_graphs(num_layers=3000, tp_size=1) == 1


def test_thinning_keeps_the_ends_evenly() -> None:
    sizes = list(range(1, 11))
    assert thin(sizes, 4) == [1, 4, 7, 10]
    assert thin(sizes, 10) == sizes and thin(sizes, 1) == [10]


def test_sizes_asked_for_are_kept_up_to_max_num_seqs_and_the_device_limit() -> None:
    assert capture_sizes((8, 1, 4, 64), 16, num_layers=2, tp_size=1, on_npu=True) == [1, 4, 8]
    assert capture_sizes(None, 512, num_layers=80, tp_size=1, on_npu=False) == default_capture_sizes(512)
    thinned = capture_sizes(None, 512, num_layers=80, tp_size=1, on_npu=True)
    assert len(thinned) == 1800 // 81 and thinned[0] == 1 and thinned[-1] == 512


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="--graph-capture-sizes must be positive"):
        ExecutorConfig(model="/models/m", graph_capture_sizes=(4, 0))
