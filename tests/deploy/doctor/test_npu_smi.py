"""`npu-smi info` tables of three driver generations and a 310P card, as users posted them."""

from __future__ import annotations

from pathlib import Path

import pytest

from npuserve.deploy.doctor.npu_smi import parse_npu_smi_info

NPU_SMI_OUTPUTS = Path(__file__).parent / "fixtures" / "npu_smi"


def parse(name: str):
    return parse_npu_smi_info((NPU_SMI_OUTPUTS / f"{name}.txt").read_text())


def test_23_0_910b_one_chip_per_npu_with_hbm() -> None:
    info = parse("23.0.7-910B3")
    assert info.version == "23.0.7"
    assert [(c.npu_id, c.chip_id) for c in info.chips] == [(i, 0) for i in range(8)]
    first, fifth = info.chips[0], info.chips[4]
    assert (first.name, first.health, first.bus_id) == ("910B3", "OK", "0000:C1:00.0")
    assert (first.memory_used_mb, first.memory_total_mb) == (59985, 65536)  # "59985/ 65536"
    assert fifth.memory_free_mb == 65536 - 3353


def test_24_1_a3_two_chips_per_npu() -> None:
    info = parse("24.1.rc3.3-A3")
    assert info.version == "24.1.rc3.3"
    assert [(c.npu_id, c.chip_id) for c in info.chips] == [(n, c) for n in range(4) for c in range(2)]
    assert {c.name for c in info.chips} == {"Ascend910"}
    assert info.chips[1].memory_used_mb == 3204 and info.chips[1].bus_id == "0000:9F:00.0"


def test_25_2_process_table_is_not_a_device() -> None:
    info = parse("25.2.0-910B3")
    assert info.version == "25.2.0" and len(info.chips) == 8
    assert (info.chips[4].memory_used_mb, info.chips[4].memory_total_mb) == (21784, 65536)


def test_310p_has_no_hbm_column() -> None:
    info = parse("23.0.rc3-310P3")
    assert [(c.npu_id, c.name) for c in info.chips] == [(0, "310P3"), (64, "310P3")]
    assert (info.chips[0].memory_used_mb, info.chips[0].memory_total_mb) == (3841, 21527)


@pytest.mark.parametrize("text", ["", "npu-smi: command failed\n", "| garbage | row |\n"])
def test_no_table_means_no_chips(text: str) -> None:
    assert parse_npu_smi_info(text).chips == []
