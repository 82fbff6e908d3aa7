"""The scheduler's executor client (`AioExecutorClient`) for synchronous tests of the executor's
service: each call runs on an event loop of the client's own thread, and blocks until it ends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from npuserve.proto.step_plan import ExecutorInfo, StepPlan, StepResult
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient

T = TypeVar("T")


class BlockingClient:
    """Steps over the `StepStream`, one at a time."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = 60.0,
        token: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="blocking-client", daemon=True)
        self._thread.start()

        async def connect() -> AioExecutorClient:  # NOTE: a grpc.aio channel takes the loop it is made on
            return AioExecutorClient(address, "", timeout_s, token, tls_ca)

        self.client = self._run(connect())

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def executor_id(self) -> str | None:
        return self.client.executor_id

    @property
    def version(self) -> str | None:
        return self.client.version

    @property
    def instance_id(self) -> str:
        return self.client.instance_id

    @instance_id.setter
    def instance_id(self, instance_id: str) -> None:
        self.client.instance_id = instance_id

    @property
    def timeout_s(self) -> float | None:
        return self.client.timeout_s

    @timeout_s.setter
    def timeout_s(self, timeout_s: float | None) -> None:
        self.client.timeout_s = timeout_s

    def info(self) -> ExecutorInfo:
        return self._run(self.client.info())

    def step(self, plan: StepPlan) -> StepResult:
        return self._run(self.client.step(plan))

    def health(self) -> bool:
        return self._run(self.client.health())

    def close(self) -> None:
        self._run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
