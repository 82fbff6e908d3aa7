"""The request field a failed scheduler call is about, carried as gRPC rich status details.

A call refused for one field ends with its usual status code and message, plus a
`google.rpc.Status` in the `grpc-status-details-bin` trailer whose details hold one
`google.rpc.BadRequest` with one field violation: `field` is the scheduler API's name for it
(see scheduler.proto) and `description` the message. Clients in any language read it with their
gRPC status library; in Python, `error_field(rpc_error)`.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = ["error_field", "field_status"]


def field_status(code: grpc.StatusCode, message: str, field: str) -> grpc.Status:
    """The status that fails a call with `code` and `message` and names `field`."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return rpc_status.to_status(status)


def error_field(error: grpc.Call) -> str | None:
    """The field a failed call names (a `grpc.RpcError` from a stub, sync or asyncio), if any."""
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # a details trailer that contradicts the call's status: not ours
        return None
    if status is None:
        return None
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request) and bad_request.field_violations:
            return bad_request.field_violations[0].field
    return None
