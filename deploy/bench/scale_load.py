"""The scale bench's load: ``concurrency`` generations kept running against one scheduler from a
`grpc.aio` client (closed loop: a finished request is replaced at once), over a `GenerateMany`
call per channel or a `Generate` call each (`ScaleConfig.client_call`).

A mixed load adds long prompts (`ScaleConfig.long_prompt_len` tokens) arriving at a rate (open
loop, evenly spaced) beside the streams; their first tokens are recorded apart, and the ITL only
of the streams (the decode streams: tokens that arrive together have gaps of 0 after the first).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from npuserve.deploy.bench.scale_config import STREAMS_PER_CHANNEL, ScaleConfig
from npuserve.deploy.bench.targets import ApiClients
from npuserve.deploy.bench.workload import FIRST_TOKEN_ID
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto.generate_many import GenerateFailed


@dataclass
class LoadState:
    """What the streams record; times are `time.perf_counter()`."""

    window: tuple[float, float] = (math.inf, math.inf)
    stopping: bool = False
    tokens_in_window: int = 0
    awaiting_first_token: int = 0  # streams sent that have no token yet
    awaiting_at_window_end: int = 0
    awaiting_samples: list[int] = field(default_factory=list)  # over the window
    first_tokens: list[tuple[float, float]] = field(default_factory=list)  # (arrival, ttft)
    itls: list[float] = field(default_factory=list)  # the streams' gaps between tokens, in the window
    long_first_tokens: list[tuple[float, float]] = field(default_factory=list)  # the long prompts'
    completions: list[tuple[float, float]] = field(default_factory=list)  # (end, e2e)
    errors: Counter[str] = field(default_factory=Counter)

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t < self.window[1]


class Load:
    """Keeps ``concurrency`` Generate streams running against one scheduler."""

    def __init__(
        self,
        config: ScaleConfig,
        address: str,
        vocab_size: int,
        concurrency: int,
        long_prompt_rate: float = 0.0,
    ) -> None:
        self.config = config
        self.address = address
        self.vocab_size = vocab_size
        self.concurrency = concurrency
        self.long_prompt_rate = long_prompt_rate
        self.state = LoadState()
        self._rng = random.Random(f"scale-bench-{config.seed}-{concurrency}")
        self.clients = ApiClients(config.client_call)

    async def connect(self) -> None:
        """Opens a channel per `STREAMS_PER_CHANNEL` streams."""
        channels = max(1, -(-self.concurrency // STREAMS_PER_CHANNEL))
        await self.clients.open(self.address, channels, [("grpc.max_receive_message_length", 64 << 20)])

    def _request(self, long_prompt: bool = False) -> pb.GenerateRequest:
        rng, c = self._rng, self.config
        prompt_len = c.long_prompt_len if long_prompt else rng.randint(*c.prompt_len)
        output_len = c.long_output_len if long_prompt else rng.randint(*c.output_len)
        prompt = rng.choices(range(FIRST_TOKEN_ID, self.vocab_size), k=prompt_len)
        sampling = pb.SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)

    async def _stream(self, index: int, delay_s: float) -> None:
        """One stream: a request after another until the load stops."""
        await asyncio.sleep(delay_s)
        while not self.state.stopping:
            if not await self._generate(index):
                await asyncio.sleep(0.1)

    async def _generate(self, index: int, long_prompt: bool = False) -> bool:
        """One request: its first token's time and its tokens in the window; a stream's also its
        gaps between tokens in the window and its end. False when its call failed."""
        state, request = self.state, self._request(long_prompt)
        sent = last = time.perf_counter()
        first = True
        state.awaiting_first_token += not long_prompt
        try:
            async for response in self.clients.generate(index, request):
                now = time.perf_counter()
                num_new = sum(len(c.token_ids) for c in response.completions)
                if num_new and first:
                    first = False
                    state.awaiting_first_token -= not long_prompt
                    (state.long_first_tokens if long_prompt else state.first_tokens).append((now, now - sent))
                elif num_new and state.in_window(now) and not long_prompt:
                    state.itls.append(now - last)
                    state.itls.extend([0.0] * (num_new - 1))
                if num_new:
                    last = now
                if state.in_window(now):
                    state.tokens_in_window += num_new
        except (grpc.aio.AioRpcError, GenerateFailed) as exc:
            state.awaiting_first_token -= first and not long_prompt
            if not state.stopping:  # counted under its status code's name
                state.errors[exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc.code.name] += 1
            return False
        if not long_prompt:
            end = time.perf_counter()
            state.completions.append((end, end - sent))
        return True

    async def _long_prompts(self, delay_s: float) -> None:
        """Long prompts at ``long_prompt_rate`` per second, evenly spaced, until the load stops."""
        await asyncio.sleep(delay_s)
        sending: set[asyncio.Task[bool]] = set()
        try:
            for index in itertools.count():
                task = asyncio.create_task(self._generate(index, long_prompt=True))
                sending.add(task)
                task.add_done_callback(sending.discard)
                await asyncio.sleep(1 / self.long_prompt_rate)
        finally:
            for task in list(sending):
                task.cancel()  # cancels the RPC: the scheduler aborts the request
            await asyncio.gather(*sending, return_exceptions=True)

    def start(self, ramp_s: float) -> list[asyncio.Task[None]]:
        """Starts every stream, spread over ``ramp_s`` so they do not arrive in one burst, and
        the long prompts after it."""
        tasks = [
            asyncio.create_task(self._stream(i, ramp_s * i / self.concurrency))
            for i in range(self.concurrency)
        ]
        if self.long_prompt_rate:
            tasks.append(asyncio.create_task(self._long_prompts(ramp_s)))
        return tasks

    async def close(self, tasks: list[asyncio.Task[None]]) -> None:
        self.state.stopping = True
        for task in tasks:
            task.cancel()  # cancels the RPC: the scheduler aborts the request
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.clients.close()
