"""What the serving bench measures against, behind one interface (`Target`).

* `OfflineTarget`: an `Engine` in this process over ModelRunners (`InProcessClient`), the same
  scheduler and ModelRunner without any RPC: the baseline that says what the gRPC split costs.
* `GrpcTarget`: a client of a running scheduler's `Generate` stream.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import AsyncIterator, Iterable, Sequence
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

    @classmethod
    def of(cls, completions: Iterable[Any], usage: Any) -> Chunk:
        """A response's completions (their new ``token_ids``) and its usage (None: not the last)."""
        cached = usage.cached_prompt_tokens if usage is not None else None
        return cls(sum(len(c.token_ids) for c in completions), cached)


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


@dataclass
class OfflineTarget:
    """An engine in this process over ``num_executors`` in-process ModelRunners."""

    config: ExecutorConfig
    num_executors: int = 1
    enable_prefix_caching: bool = True
    name: str = "offline"
    max_model_len: int = 0  # the engine's, once open
    engine: Engine | None = None

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
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)
        async for output in self.engine.generate(PromptInput(token_ids=prompt), params):
            if output.error or any(c.finish_reason in ("error", "abort") for c in output.completions):
                raise BenchError(output.error or "the request was aborted")
            yield Chunk.of(output.completions, output.usage)


CONNECT_TIMEOUT_S = 60.0  # for a scheduler to answer at the address
# How a bench's gRPC client sends its generations: over one `GenerateMany` call (as the gateway
# does), or a `Generate` call each (as a client of single requests does).
CLIENT_CALLS = ("generate-many", "generate")


class ApiClients:
    """A benchmark's channels to a scheduler's public API, spread over its API server processes
    as the gateway spreads its own (`api_spread`); a generation goes over one of them, in the
    channel's `GenerateMany` call or a `Generate` call of its own (``client_call``, one of
    `CLIENT_CALLS`). ``metadata`` goes with every call."""

    def __init__(self, client_call: str, metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        self.client_call = client_call
        self.metadata = metadata
        self.stubs: list[pb_grpc.SchedulerStub] = []
        self._channels: list[grpc.aio.Channel] = []
        self._generators: list[GenerateManyClient] = []

    async def open(
        self, address: str, count: int, options: Sequence[tuple[str, int]], tls_ca: bytes | None = None
    ) -> None:
        """``count`` channels to ``address``."""
        self._channels = await spread_channels(address, count, options, tls_ca, self.metadata or ())
        self.stubs = [pb_grpc.SchedulerStub(channel) for channel in self._channels]
        if self.client_call == "generate-many":
            self._generators = [GenerateManyClient(stub, self.metadata or ()) for stub in self.stubs]

    def generate(self, index: int, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The responses to ``request``, over channel ``index`` (modulo the channels)."""
        if self._generators:
            return self._generators[index % len(self._generators)].generate(request)
        return self.stubs[index % len(self.stubs)].Generate(request, metadata=self.metadata)

    async def close(self) -> None:
        generators, self._generators = self._generators, []
        for generator in generators:
            await generator.close()  # cancels its call: the scheduler aborts every request on it
        channels, self._channels, self.stubs = self._channels, [], []
        for channel in channels:
            await channel.close()


class GrpcTarget:
    """A `grpc.aio` client of a running scheduler's public API, as the gateway is: its
    generations take turns over `API_SERVERS` channels (`ApiClients`)."""

    def __init__(
        self,
        address: str,
        name: str = "grpc",
        api_key: str | None = None,
        tls_ca: bytes | None = None,
        client_call: str = CLIENT_CALLS[0],
    ) -> None:
        self.address = address
        self.name = name
        self.max_model_len = 0
        self._tls_ca = tls_ca
        self._clients = ApiClients(client_call, bearer_metadata(api_key))
        self._turn = itertools.count()

    async def open(self) -> None:
        options = message_size_options(MAX_API_MESSAGE_BYTES)
        first = aio_client_channel(self.address, options, self._tls_ca)
        try:
            await asyncio.wait_for(first.channel_ready(), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            await first.close()
            raise BenchError(f"no scheduler answers at {self.address}") from None
        await first.close()
        await self._clients.open(self.address, API_SERVERS, options, self._tls_ca)
        try:
            models = await self._clients.stubs[0].ListModels(
                pb.ListModelsRequest(), metadata=self._clients.metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise BenchError(
                f"the scheduler at {self.address} refused: {exc.code().name}: {exc.details()}"
            ) from None
        self.max_model_len = models.models[0].max_model_len

    async def close(self) -> None:
        await self._clients.close()

    async def stream(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> AsyncIterator[Chunk]:
        sampling = pb.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True
        )
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
        try:
            async for response in self._clients.generate(next(self._turn), request):
                failed = [c for c in response.completions if c.finish_reason in ("error", "abort")]
                if failed:
                    raise BenchError(failed[0].error_message or f"finish_reason {failed[0].finish_reason}")
                yield Chunk.of(response.completions, response.usage if response.HasField("usage") else None)
        except grpc.aio.AioRpcError as exc:
            raise BenchError(f"{exc.code().name}: {exc.details()}") from None
        except GenerateFailed as exc:
            raise BenchError(str(exc)) from None
