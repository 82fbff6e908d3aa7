"""The doctor against fixture trees of real-format version files and a fake `npu-smi`."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from npuserve.deploy.doctor.command import add_doctor_flags, diagnose
from npuserve.deploy.doctor.facts import collect_facts
from npuserve.deploy.doctor.report import Check, verdict

TREES = Path(__file__).parent / "fixtures" / "ascend"
GOOD_SET = {"torch": "2.8.0+cpu", "torch_npu": "2.8.0.post2", "transformers": None, "npuserve": "0.1.0"}
SOURCED = {
    "ASCEND_HOME_PATH": "/usr/local/Ascend/cann-8.5.0",
    "ATB_HOME_PATH": "/usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_1",
}


def doctor(
    tree: Path,
    dev: Path,
    argv: list[str],
    packages: dict[str, str | None] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Check]:
    parser = argparse.ArgumentParser()
    add_doctor_flags(parser)
    args = parser.parse_args(argv)
    facts = collect_facts(tree, dev, SOURCED if env is None else env, packages or GOOD_SET)
    _, checks = diagnose(args, facts)
    by_name = {c.name: c for c in checks}
    by_name["verdict"] = Check("verdict", "ok" if verdict(checks) == "ok" else "fail", "")
    return by_name


@pytest.mark.parametrize("generation", ["23.0.7-910B3", "24.1.rc3.3-A3", "25.2.0-910B3"])
def test_a_good_host_of_each_driver_generation_can_serve(
    generation: str, fake_npu_smi, dev_root: Path, head_dim_64_model: Path
) -> None:
    fake_npu_smi(generation)
    # NPU 4 of every table is free enough (on 23.0.7 NPUs 0-3 are held by other processes).
    env = {**SOURCED, "ASCEND_RT_VISIBLE_DEVICES": "4"}
    checks = doctor(
        TREES / "cann8.5", dev_root, ["--device", "npu", "--model", str(head_dim_64_model)], env=env
    )
    failed = {n: c for n, c in checks.items() if c.status == "fail"}
    assert not failed and checks["verdict"].status == "ok", failed
    assert checks["version set"].detail.startswith("CANN 8.5.0 + torch 2.8.0 + torch_npu 2.8.0.post2")
    assert checks["driver+cann"].status == "ok"
    assert checks["npus"].detail.startswith("1 visible (0: ")
    assert "tokens" in checks["kv cache"].detail
    # head_dim 64 with GQA serves, with a warning that names where it is (and is not) documented.
    head_dim = checks["head_dim"]
    assert head_dim.status == "warn" and head_dim.detail.startswith("head_dim 64 (2 query / 1 KV heads)")
    assert "npu_fused_infer_attention_score doc allows head_dim 128" in head_dim.detail
    assert "Qwen2.5-0.5B-Instruct" in head_dim.detail and "001-quickstart-test.sh" in head_dim.detail


def test_memory_held_by_other_processes_leaves_no_kv_cache(
    fake_npu_smi, dev_root: Path, head_dim_64_model: Path
) -> None:
    fake_npu_smi("23.0.7-910B3")  # NPU 0: 59985 of 65536 MiB in use
    checks = doctor(TREES / "cann8.5", dev_root, ["--device", "npu", "--model", str(head_dim_64_model)])
    assert checks["kv cache"].status == "fail" and "--gpu-memory-utilization" in checks["kv cache"].fix
    assert "8 visible" in checks["npus"].detail


def test_310p_is_refused(fake_npu_smi, dev_root: Path) -> None:
    fake_npu_smi("23.0.rc3-310P3")
    checks = doctor(TREES / "cann8.5", dev_root, ["--device", "npu"])
    assert checks["npus"].status == "fail" and "310P3" in checks["npus"].detail
    assert "A2/A3" in checks["npus"].detail


def test_visible_devices_naming_no_npu(fake_npu_smi, dev_root: Path) -> None:
    fake_npu_smi("25.2.0-910B3")
    checks = doctor(
        TREES / "cann8.5", dev_root, ["--device", "npu"], env={**SOURCED, "ASCEND_RT_VISIBLE_DEVICES": "9"}
    )
    npus = checks["npus"]
    assert npus.status == "fail" and "ASCEND_RT_VISIBLE_DEVICES='9'" not in npus.detail
    assert "ASCEND_RT_VISIBLE_DEVICES=9" in npus.detail and "ASCEND_RT_VISIBLE_DEVICES" in npus.fix
    assert "/dev/davinci" in npus.fix and "npu-smi info" in npus.fix


def test_no_device_nodes_in_a_container(fake_npu_smi, tmp_path: Path) -> None:
    fake_npu_smi("25.2.0-910B3")
    checks = doctor(TREES / "cann8.5", tmp_path, ["--device", "npu"])
    assert checks["npus"].status == "fail" and "0 /dev/davinci* device(s)" in checks["npus"].detail


def test_cann_8_1_layout_without_nnal_and_a_torch_npu_of_another_cann(fake_npu_smi, dev_root: Path) -> None:
    fake_npu_smi("24.1.rc3.3-A3")
    checks = doctor(TREES / "cann8.1", dev_root, ["--device", "npu"])
    assert checks["cann"].detail.startswith("CANN 8.1.RC1 (")
    assert checks["driver+cann"].status == "ok"  # driver 24.1.rc3 is V100R001C19, in CANN's list
    assert checks["nnal"].status == "fail" and "nnal/atb/set_env.sh" in checks["nnal"].fix
    version_set = checks["version set"]
    assert version_set.status == "fail" and "built for CANN 8.5.0" in version_set.detail
    assert "CANN 8.1.RC1 + torch 2.5.1 + torch_npu 2.5.1" in version_set.fix


# vllm-ascend v0.12.0rc1's set, in the ascend-toolkit/latest layout its image has.
VLLM_ASCEND_0_12_SET = {**GOOD_SET, "torch_npu": "2.8.0"}
TOOLKIT_SOURCED = {
    "ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/latest",
    "ATB_HOME_PATH": "/usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_1",
}


def cann_8_3_tree(tmp_path: Path, cann: str) -> Path:
    """The cann8.3 fixture with its toolkit and NNAL files naming ``cann`` instead of 8.3.RC2."""
    tree = shutil.copytree(TREES / "cann8.3", tmp_path / f"ascend-{cann}")
    for info in [
        *tree.glob("ascend-toolkit/latest/*/ascend_toolkit_install.info"),
        *tree.glob("nnal/**/version.info"),
    ]:
        info.write_text(info.read_text().replace("8.3.RC2", cann))
    return tree


def test_the_cann_8_3_rc2_install_of_vllm_ascend_images_can_serve(fake_npu_smi, dev_root: Path) -> None:
    fake_npu_smi("24.1.rc3.3-A3")
    checks = doctor(TREES / "cann8.3", dev_root, ["--device", "npu"], VLLM_ASCEND_0_12_SET, TOOLKIT_SOURCED)
    failed = {n: c for n, c in checks.items() if c.status == "fail"}
    assert not failed and checks["verdict"].status == "ok", failed
    assert checks["cann"].detail.startswith("CANN 8.3.RC2 (")
    assert checks["nnal"].status == "ok" and checks["driver+cann"].status == "ok"
    version_set = checks["version set"]
    assert version_set.status == "ok", version_set
    assert version_set.detail.startswith(
        "CANN 8.3.RC2 + torch 2.8.0 + torch_npu 2.8.0 (vllm-ascend v0.12.0rc1"
    )


def test_a_cann_of_another_rc_number_warns_and_serves(fake_npu_smi, dev_root: Path, tmp_path: Path) -> None:
    fake_npu_smi("24.1.rc3.3-A3")
    tree = cann_8_3_tree(tmp_path, "8.3.RC3")
    checks = doctor(tree, dev_root, ["--device", "npu"], VLLM_ASCEND_0_12_SET, TOOLKIT_SOURCED)
    version_set = checks["version set"]
    assert version_set.status == "warn" and checks["verdict"].status == "ok", version_set
    assert (
        "CANN 8.3.RC3 is not the CANN torch_npu 2.8.0 is built for (8.3.RC2 or 8.3.RC1" in version_set.detail
    )
    assert "RC number only" in version_set.detail
    assert "CANN 8.3.RC2 + torch 2.8.0 + torch_npu 2.8.0" in version_set.fix


@pytest.mark.parametrize("cann", ["8.2.RC1", "8.5.0"])
def test_a_cann_of_another_release_is_still_refused(
    cann: str, fake_npu_smi, dev_root: Path, tmp_path: Path
) -> None:
    fake_npu_smi("24.1.rc3.3-A3")
    tree = cann_8_3_tree(tmp_path, cann)
    checks = doctor(tree, dev_root, ["--device", "npu"], VLLM_ASCEND_0_12_SET, TOOLKIT_SOURCED)
    version_set = checks["version set"]
    assert version_set.status == "fail" and checks["verdict"].status == "fail", version_set
    assert f"CANN {cann} (torch_npu 2.8.0 is built for CANN 8.3.RC2 or 8.3.RC1)" in version_set.detail


def test_torch_and_torch_npu_of_different_releases(fake_npu_smi, dev_root: Path) -> None:
    fake_npu_smi("25.2.0-910B3")
    packages = {**GOOD_SET, "torch": "2.9.0+cpu"}
    checks = doctor(TREES / "cann8.5", dev_root, ["--device", "npu"], packages=packages)
    assert checks["torch_npu"].status == "fail" and "torch==2.8.*" in checks["torch_npu"].fix
    assert checks["version set"].status == "fail"


def test_cann_installed_but_not_sourced(fake_npu_smi, dev_root: Path) -> None:
    fake_npu_smi("25.2.0-910B3")
    checks = doctor(TREES / "cann8.5", dev_root, ["--device", "npu"], env={})
    assert checks["cann"].status == "fail" and checks["cann"].fix.endswith(
        "cann-8.5.0/set_env.sh in the shell that starts npuserve"
    )
    assert checks["nnal"].status == "fail" and "not sourced" in checks["nnal"].detail


def test_driver_and_cann_that_do_not_list_each_other(fake_npu_smi, dev_root: Path, tmp_path: Path) -> None:
    fake_npu_smi("25.2.0-910B3")
    tree = shutil.copytree(TREES / "cann8.5", tmp_path / "ascend")
    driver = tree / "driver" / "version.info"
    # An older driver family than any CANN 8.5.0 lists, and CANN 8.5.0 not in its own list.
    driver.write_text(
        driver.read_text()
        .replace("Innerversion=V100R001C15SPC006B220", "Innerversion=V100R001C10SPC001B100")
        .replace(
            "compatible_version=[V100R001C30],[V100R001C13],[V100R001C15],[V100R001C17]",
            "compatible_version=[V100R001C10]",
        )
    )
    checks = doctor(tree, dev_root, ["--device", "npu"])
    assert checks["driver+cann"].status == "fail" and "V100R001C10" in checks["driver+cann"].detail


def test_auto_without_torch_npu_serves_on_the_cpu_and_only_warns(tmp_path: Path, stories_dir: Path) -> None:
    packages = {**GOOD_SET, "torch_npu": None}
    checks = doctor(
        tmp_path, tmp_path, ["--device", "auto", "--model", str(stories_dir)], packages=packages, env={}
    )
    assert checks["device"].detail.startswith("--device auto: the CPU")
    assert checks["torch_npu"].status == "warn" and checks["driver"].status == "warn"
    assert checks["head_dim"].status == "ok"  # head_dim 8 runs on the CPU
    assert checks["verdict"].status == "ok"


def test_a_missing_model_directory_is_a_failed_check(tmp_path: Path) -> None:
    checks = doctor(tmp_path, tmp_path, ["--device", "cpu", "--model", str(tmp_path / "nowhere")], env={})
    assert checks["model"].status == "fail" and "--model" in checks["model"].fix
