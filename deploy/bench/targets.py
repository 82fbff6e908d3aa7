"""What the serving bench measures against, behind one interface (`Target`).

* `OfflineTarget`: an `Engine` in this process over ModelRunners (`InProcessClient`), the same
  scheduler and ModelRunner without any RPC: the baseline that says what the gRPC split costs.
* `GrpcTarget`: a client of a running scheduler's `Generate` stream.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.api_spread import spread_channels
from npuserve.proto.auth import bearer_metadata
from npuserve.proto.channel import (
    API_SERVERS,
    MAX_API_MESSAGE_BYTES,
    aio_client_channel,
    message_size_options,
)
from npuserve.proto.generate_many import GenerateFailed, GenerateManyClient
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.engine.engine import Engine
from npuserve.scheduler.engine.engine_config import EngineConfig
from npuserve.scheduler.lanes.in_process_client import InProcessClient
from npuserve.scheduler.text.prompts import PromptInput

if TYPE_CHECKING:
    from npuserve.executor.config import ExecutorConfig


@dataclass(slots=True)
class Chunk:
    """One streamed response: its new tokens, and on the last one the prompt's cached tokens."""

    num_tokens: int
    cached_prompt_tokens: int | None = None


class BenchError(RuntimeError):
    """A request that failed at the target."""


class Target(Protocol):
    """What the measurement loop needs of a target: open, stream one request, close."""

    name: str
    max_model_len: int

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def stream(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> AsyncIterator[Chunk]: ...


def _sampling(max_tokens: int, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)


class OfflineTarget:
    """An engine in this process over ``num_executors`` in-process ModelRunners."""

    def __init__(
        self,
        config: ExecutorConfig,
        num_executors: int = 1,
        enable_prefix_caching: bool = True,
        name: str = "offline",
    ) -> None:
        self.config = config
        self.num_executors = num_executors
        self.enable_prefix_caching = enable_prefix_caching
        self.name = name
        self.max_model_len = 0
        self.engine: Engine | None = None

    async def open(self) -> None:
        from npuserve.executor.model_runner import ModelRunner  # torch: only when measuring in process
        from npuserve.scheduler.text.tokenizer import Tokenizer

        def build() -> list[tuple[str, InProcessClient, Any]]:
            runners = [ModelRunner(self.config) for _ in range(self.num_executors)]
            return [
                (f"local-{i}", InProcessClient(runner), runner.info()) for i, runner in enumerate(runners)
            ]

        executors = await asyncio.to_thread(build)
        engine_config = EngineConfig(self.config.model, enable_prefix_caching=self.enable_prefix_caching)
        self.engine = Engine(engine_config, Tokenizer.from_pretrained(self.config.model), executors)
        self.engine.start()
        await self.engine.wait_started()
        self.max_model_len = self.engine.max_model_len

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
        gc.collect()  # NOTE: free the KV cache before the next variant allocates its own

    async def stream(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> AsyncIterator[Chunk]:
        assert self.engine is not None, "open() the target first"
        params = _sampling(max_tokens, temperature, seed)
        async for output in self.engine.generate(PromptInput(token_ids=prompt), params):
            if output.error or any(c.finish_reason in ("error", "abort") for c in output.completions):
                raise BenchError(output.error or "the request was aborted")
            usage = output.usage
            yield Chunk(
                sum(len(c.token_ids) for c in output.completions),
                usage.cached_prompt_tokens if usage is not None else None,
            )


# How a bench's gRPC client sends its generations: over one `GenerateMany` call (as the gateway
# does), or a `Generate` call each (as a client of single requests does).
CLIENT_CALLS = ("generate-many", "generate")


class GrpcTarget:
    """A `grpc.aio` client of a running scheduler's public API, as the gateway is: its
    generations take turns over `API_SERVERS` channels spread over the API server processes,
    over one `GenerateMany` call each, or a `Generate` call each (``client_call``, one of
    `CLIENT_CALLS`)."""

    def __init__(
        self,
        address: str,
        name: str = "grpc",
        connect_timeout_s: float = 60.0,
        api_key: str | None = None,
        tls_ca: bytes | None = None,
        client_call: str = CLIENT_CALLS[0],
    ) -> None:
        self.address = address
        self.name = name
        self.client_call = client_call
        self.connect_timeout_s = connect_timeout_s
        self.max_model_len = 0
        self._metadata = bearer_metadata(api_key)
        self._tls_ca = tls_ca
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[Any] = []
        self._generators: list[GenerateManyClient] = []
        self._turn = itertools.count()

    async def open(self) -> None:
        options = message_size_options(MAX_API_MESSAGE_BYTES)
        first = aio_client_channel(self.address, options, self._tls_ca)
        try:
            await asyncio.wait_for(first.channel_ready(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            await first.close()
            raise BenchError(f"no scheduler answers at {self.address}") from None
        await first.close()
        self._channels = await spread_channels(
            self.address, API_SERVERS, options, self._tls_ca, self._metadata or ()
        )
        self._stubs = [pb_grpc.SchedulerStub(channel) for channel in self._channels]
        try:
            models = await self._stubs[0].ListModels(pb.ListModelsRequest(), metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise BenchError(
                f"the scheduler at {self.address} refused: {exc.code().name}: {exc.details()}"
            ) from None
        self.max_model_len = models.models[0].max_model_len
        if self.client_call == "generate-many":
            self._generators = [GenerateManyClient(stub, self._metadata or ()) for stub in self._stubs]

    async def close(self) -> None:
        generators, self._generators = self._generators, []
        for generator in generators:
            await generator.close()
        channels, self._channels, self._stubs = self._channels, [], []
        for channel in channels:
            await channel.close()

    async def stream(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> AsyncIterator[Chunk]:
        sampling = pb.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True
        )
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
        turn = next(self._turn)
        responses = (
            self._generators[turn % len(self._generators)].generate(request)
            if self._generators
            else self._stubs[turn % len(self._stubs)].Generate(request, metadata=self._metadata)
        )
        try:
            async for response in responses:
                failed = [c for c in response.completions if c.finish_reason in ("error", "abort")]
                if failed:
                    raise BenchError(failed[0].error_message or f"finish_reason {failed[0].finish_reason}")
                usage = response.usage if response.HasField("usage") else None
                yield Chunk(
                    sum(len(c.token_ids) for c in response.completions),
                    usage.cached_prompt_tokens if usage is not None else None,
                )
        except grpc.aio.AioRpcError as exc:
            raise BenchError(f"{exc.code().name}: {exc.details()}") from None
        except GenerateFailed as exc:
            raise BenchError(str(exc)) from None
