"""What a generation has received from the scheduler, and the request that resumes it from there.

When its scheduler dies mid-stream, a generation is sent again as a continuation: the same
request with each choice's output token ids so far (`GenerateRequest.continuations`), which the
restarted scheduler goes on from as if the call had not been cut (see scheduler.proto). The
gateway passes on every response it reads, so what it has read is what its client gets: the
continuation's first text is the next text, with nothing repeated or skipped.
"""

from __future__ import annotations

from npuserve.proto import scheduler_pb2 as pb

RESUMED_ID_SUFFIX = "-resumed"  # the resumed request's id, apart from the one the scheduler may still hold


class DeliveredOutput:
    """Each choice's output token ids so far, and whether it has finished."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        n = request.sampling.n if request.sampling.HasField("n") else 1
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    def add(self, response: pb.GenerateResponse) -> None:
        for completion in response.completions:
            index = completion.index
            if 0 <= index < len(self.token_ids):
                self.token_ids[index] += completion.token_ids
                if completion.finish_reason:
                    self.finished[index] = True

    def resuming(self, request: pb.GenerateRequest) -> pb.GenerateRequest | None:
        """``request`` (a new generation's) sent again to go on from here; None when it
        cannot: a choice has finished (with n > 1 the others would have to go on without it,
        which the scheduler does not do)."""
        if any(self.finished):
            return None
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        if request.request_id:
            resumed.request_id = request.request_id + RESUMED_ID_SUFFIX
        resumed.sampling.return_prompt = False  # the client got the prompt with the first response
        for ids in self.token_ids:
            resumed.continuations.add(token_ids=ids)
        return resumed
