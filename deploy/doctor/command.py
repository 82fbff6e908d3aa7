"""The `npuserve doctor` command: flags, device resolution, and the verdict's exit status."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from npuserve.deploy.doctor.facts import AUTOLOAD_ENV, HostFacts, facts_from_environment
from npuserve.deploy.doctor.host_checks import AscendChecks, autoload_check, python_check, torch_check
from npuserve.deploy.doctor.report import Check, fail, ok, to_json, to_text, verdict
from npuserve.deploy.flags import add_logging_flags


def add_doctor_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=["auto", "npu", "cpu", "cuda"])
    parser.add_argument("--model", help="also check this model directory against the device")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="of the NPU's memory")
    parser.add_argument("--kv-cache-memory", type=float, help="KV cache size in GiB")
    add_logging_flags(parser)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(choice: str, facts: HostFacts, ascend: AscendChecks) -> tuple[str, Check]:
    """What ``--device auto`` would run on, the way the executor decides (NPU, CUDA, CPU)."""
    if choice != "auto":
        return choice, ok("device", f"--device {choice}")
    if facts.packages.get("torch_npu") is not None and ascend.visible_chips() and facts.davinci:
        return "npu", ok("device", "--device auto: the NPU")
    if _cuda_available():
        return "cuda", ok("device", "--device auto: CUDA (no usable NPU)")
    return "cpu", ok("device", "--device auto: the CPU (no usable NPU or CUDA device)")


def _host_memory() -> tuple[int | None, int | None]:
    fields: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    return fields.get("MemTotal"), fields.get("MemAvailable")


def _device_memory(device: str, ascend: AscendChecks):
    from npuserve.deploy.doctor.model_checks import MIB, DeviceMemory

    if device == "npu":
        chips = ascend.visible_chips()
        if not chips:
            return DeviceMemory(None, None, "NPU memory")
        chip = chips[0]
        return DeviceMemory(
            chip.memory_total_mb * MIB,
            chip.memory_free_mb * MIB,
            f"NPU 0 ({chip.name}) memory",
            chip.name.startswith("310"),
        )
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(0)
        return DeviceMemory(int(total), int(free), "CUDA device 0 memory")
    host_total, host_free = _host_memory()
    return DeviceMemory(host_total, host_free, "host memory")


def diagnose(args: argparse.Namespace, facts: HostFacts) -> tuple[str, list[Check]]:
    """(the device checked, every check) for the flags of `add_doctor_flags`."""
    ascend = AscendChecks(facts, strict=args.device == "npu")
    checks = [python_check(), torch_check(facts), autoload_check(facts)]
    device, device_check = resolve_device(args.device, facts, ascend)
    checks.append(device_check)
    if args.device in ("npu", "auto"):
        checks += ascend.all()
    if device == "cuda" and _cuda_available():
        checks.append(ok("cuda", "a CUDA device is visible"))
    elif device == "cuda":
        fix = "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and that torch is a CUDA build"
        checks.append(fail("cuda", "torch sees no CUDA device", fix))
    if args.model:
        from npuserve.deploy.doctor.model_checks import model_checks

        checks += model_checks(args, device, _device_memory(device, ascend))
    return device, checks


def run_doctor(args: argparse.Namespace) -> int:
    """Prints the checks; 0 only when the device asked for can serve."""
    facts = facts_from_environment()
    # NOTE: read before this: the report shows the user's setting. Our own `import torch` must
    # not import torch_npu through the backend autoload (a mismatched one dies there).
    os.environ[AUTOLOAD_ENV] = "0"
    device, checks = diagnose(args, facts)
    print(to_json(checks) if args.json else to_text(checks, device))
    return 0 if verdict(checks) == "ok" else 1
