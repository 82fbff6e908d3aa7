"""What every client of an executor shares (this module never imports torch): the error its
calls fail with, and how the scheduler's processes reach executors (`ClientSpec`).

The clients: `AioExecutorClient` (`aio_executor_client`, over gRPC) and `InProcessClient`
(`in_process_client`, a runner in this process).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import grpc.aio


class ExecutorError(RuntimeError):
    """A failed call to an executor. `code` is the gRPC status name, e.g. "INVALID_ARGUMENT"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> ExecutorError:
        has_status = isinstance(exc, (grpc.Call, grpc.aio.AioRpcError))
        code = exc.code() if has_status else None
        details = exc.details() if has_status else None
        return cls(code.name if code is not None else "UNKNOWN", details or str(exc))


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """How to reach executors (picklable: scheduler worker processes build their own clients).
    With a ``token`` every call presents the cluster token (``authorization: Bearer TOKEN``);
    with ``tls_ca`` (PEM root certificates) the channel is TLS, verified against those roots."""

    timeout_s: float | None = 60.0
    token: str | None = None
    tls_ca: bytes | None = None
