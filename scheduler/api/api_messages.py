"""The messages between the scheduler's core and its API server processes (`api_process`), each
way over one pipe (`pipe_link`), many to a batch.

An API process hands the core each request it has checked and tokenized, and what its clients
do to their streams (a stop string found, a stream closed); it passes on every call the core
answers. The core sends back the updates of the process's streams: its own, gathered over a
turn of its event loop, and the packs of tokens its scheduler workers made for that process,
unopened (`step_frames`). The API process acknowledges the updates it has applied (the flow
control of `api_relay.Relay`).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from npuserve.proto.step_plan import TokenLogprobs
from npuserve.scheduler.api.api_status import RelayedError
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.engine.continuation import Continuation
from npuserve.scheduler.engine.outputs import SequenceUpdate

# One update of a stream: its handle in the API process, then the fields of `SequenceUpdate`.
# NOTE: a plain tuple: one crosses per token (or per `--stream-interval` group), and a class
# pickles through a Python call per item (a NamedTuple: 1.24 against 0.21 us per item).
PackedUpdate = tuple[
    int, int, list[int], list[TokenLogprobs | None], str | None, int | str | None, str | None, int, int
]


@dataclass(frozen=True, slots=True)
class RelayedStatus:
    """A forwarded call's gRPC status, as the core's servicer ended it."""

    code: str
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()


# -- API process -> core -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiReady:
    """The process serves on ``port`` (the first one picks it; the others share it)."""

    port: int


@dataclass(frozen=True, slots=True)
class SubmitStream:
    """A checked, tokenized request whose stream the process serves under ``handle``."""

    handle: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    continuation: Continuation | None  # the output a resumed generation's choices already have


@dataclass(frozen=True, slots=True)
class UpdatesApplied:
    """The process applied ``count`` updates (`StreamUpdates`' items, a pack's, an end, a refusal)."""

    count: int


@dataclass(frozen=True, slots=True)
class StopStringFound:
    """A stop string ended a sequence in its text: the core stops computing it."""

    handle: int
    choice: int
    stop: str


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """The client's stream is over; ``aborted``: before its request finished (the core drops it)."""

    handle: int
    aborted: bool


@dataclass(frozen=True, slots=True)
class ForwardCall:
    """A call the core answers (`CallAnswer` with the same ``call_id``)."""

    call_id: int
    method: str
    request: Message


@dataclass(frozen=True, slots=True)
class DeliveredTokens:
    """The answer to `QueryDelivered`: each sequence's output token ids, None for one the
    process no longer streams."""

    query_id: int
    outputs: list[list[int] | None]


ApiToCore = (
    ApiReady | SubmitStream | UpdatesApplied | StopStringFound | StreamClosed | ForwardCall | DeliveredTokens
)

# -- core -> API process -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamUpdates:
    """Updates of the process's streams that the core made in one turn of its event loop."""

    items: list[PackedUpdate]


@dataclass(frozen=True, slots=True)
class RelayedUpdates:
    """A scheduler worker's pack of updates for the process's streams, passed on unopened."""

    payload: bytes  # a pickled list[PackedUpdate]


@dataclass(frozen=True, slots=True)
class EndStream:
    """A sequence of the stream ended outside a step (aborted, or its executor failed)."""

    handle: int
    update: SequenceUpdate


@dataclass(frozen=True, slots=True)
class RefuseStream:
    """The request ends before anything was sent: its stream raises ``error``."""

    handle: int
    error: RelayedError


@dataclass(frozen=True, slots=True)
class QueryDelivered:
    """Asks what the streams hold (a scheduler worker that ran them died: they resume from it)."""

    query_id: int
    sequences: list[tuple[int, int]]  # (handle, choice)


@dataclass(frozen=True, slots=True)
class CallAnswer:
    call_id: int
    answer: Message | RelayedStatus


@dataclass(frozen=True, slots=True)
class DrainApi:
    """The scheduler drains: the process takes no new requests."""


@dataclass(frozen=True, slots=True)
class ExitApi:
    """The scheduler is stopping: the process stops serving and exits."""


CoreToApi = (
    StreamUpdates
    | RelayedUpdates
    | EndStream
    | RefuseStream
    | QueryDelivered
    | CallAnswer
    | DrainApi
    | ExitApi
)
