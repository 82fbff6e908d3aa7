"""The machine a bench ran on: its CPU, load and the reference loop's speed."""

from __future__ import annotations

from pathlib import Path

from npuserve.deploy.bench import machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7551 32-Core Processor
cpu MHz\t\t: 1996.249

processor\t: 1
model name\t: AMD EPYC 7551 32-Core Processor
cpu MHz\t\t: 1996.249
"""


def test_describe_reads_the_cpu_and_times_the_reference_loop(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    host = machine.describe(cpuinfo)
    assert host.cpu_model == "AMD EPYC 7551 32-Core Processor"
    assert host.cpu_mhz == 1996.249
    assert host.cpus >= 1 and host.python_ns_per_op > 0
    row = host.row()
    assert row["cpu_model"] == host.cpu_model and row["python_ns_per_op"] == host.python_ns_per_op
    assert "AMD EPYC 7551" in host.summary() and "ns per reference op" in host.summary()


def test_describe_without_cpuinfo_still_names_the_machine(tmp_path: Path) -> None:
    host = machine.describe(tmp_path / "absent")
    assert host.cpu_model and host.cpu_mhz is None
    assert "MHz" not in host.summary()


def test_more_reference_work_takes_longer_per_run_not_per_op() -> None:
    # The figure is per iteration: ten times the iterations is not ten times the figure (a
    # baseline from the same test, no absolute times).
    short = machine.python_ns_per_op(ops=2_000, runs=5)
    long = machine.python_ns_per_op(ops=20_000, runs=5)
    assert long < 5 * short
