"""Container health probes: `python3 -m npuserve.deploy.probe KIND TARGET [--live]`.

Kubernetes exec probes and Compose health checks run this inside the container. It asks the
process npuserve's own Health (the executor's and the scheduler's gRPC `Health`, the gateway's
HTTP `/health`) and exits 0 when the answer is what the probe wants, else 1 with one line on
stderr. Without ``--live`` the process must be serving (readiness); with it, any answer will do
(liveness: the process is up and answering, even while it waits for executors or drains).

It imports neither torch nor the executor, so a probe costs a Python start and one call.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from typing import Any

import grpc

PROBE_TIMEOUT_S = 3.0


def _grpc_health(kind: str, address: str, timeout_s: float) -> tuple[bool, str]:
    """(serving, what is wrong) from the Health RPC of an executor or the scheduler."""
    from npuserve.proto import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

    stub, request = (
        (executor_pb2_grpc.ExecutorStub, executor_pb2.HealthRequest)
        if kind == "executor"
        else (scheduler_pb2_grpc.SchedulerStub, scheduler_pb2.HealthRequest)
    )
    with grpc.insecure_channel(address) as channel:
        reply: Any = stub(channel).Health(request(), timeout=timeout_s)
    return reply.serving, getattr(reply, "message", "") or "not serving"


def _http_health(url: str, timeout_s: float) -> tuple[bool, str]:
    """(serving, what is wrong) from the gateway's /health; a 503 still proves it is up."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200, f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"


def probe(kind: str, target: str, live: bool, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """(passed, message) of one probe."""
    try:
        if kind == "gateway":
            serving, problem = _http_health(target, timeout_s)
        else:
            serving, problem = _grpc_health(kind, target, timeout_s)
    except grpc.RpcError as exc:
        return False, f"{kind} at {target} did not answer Health: {exc.code().name}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{kind} at {target} did not answer /health: {exc}"
    if live or serving:
        return True, f"{kind} at {target} is {'serving' if serving else 'up'}"
    return False, f"{kind} at {target} is up but not serving: {problem}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m npuserve.deploy.probe", description=__doc__)
    parser.add_argument("kind", choices=["executor", "scheduler", "gateway"])
    parser.add_argument("target", help="HOST:PORT of the gRPC port, or the gateway's /health URL")
    parser.add_argument("--live", action="store_true", help="pass on any answer, serving or not")
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S, help="seconds to wait")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    passed, message = probe(args.kind, args.target, args.live, args.timeout)
    print(message, file=sys.stdout if passed else sys.stderr)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
