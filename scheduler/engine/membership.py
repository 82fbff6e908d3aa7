"""Which executors the engine serves on, as they come and go.

`StaticMembership` serves the `--executors` list and reconnects to one that went down once it
answers again (a restarted executor rejoins with a fresh block pool). `RedisMembership`
(`scheduler/engine/registry.py`) discovers executors from their registrations instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.executor_client import ExecutorError

if TYPE_CHECKING:
    from npuserve.scheduler.engine.engine import Engine

log = structlog.get_logger(__name__)

ClientFactory = Callable[[str], AioExecutorClient]
Joined = tuple[str, AioExecutorClient, ExecutorInfo]  # an executor's id, its client, its handshake
PROBE_TIMEOUT_S = 2.0  # a handshake with an executor that may be down
RECONNECT_INTERVAL_S = 1.0  # between attempts to reconnect the `--executors` that are down


async def handshake(make_client: ClientFactory, address: str, probe_timeout_s: float | None = None) -> Joined:
    """Connects and runs the capacity handshake. ``probe_timeout_s`` bounds this handshake only
    (probing a down executor must not wait for the step timeout); steps keep the client's own."""
    client = make_client(address)
    try:
        info = await client.info(probe_timeout_s)
    except Exception:
        await client.close()
        raise
    return client.executor_id or address, client, info


async def wait_for_executors(
    make_client: ClientFactory, addresses: list[str], timeout_s: float
) -> list[Joined]:
    """The handshake with every address, retried while they start (up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    joined = []
    for address in addresses:
        while True:
            try:
                joined.append(await handshake(make_client, address))
                break
            except ExecutorError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"executor {address} did not answer within {timeout_s:.0f} s: {exc}"
                    ) from exc
                await asyncio.sleep(0.5)
        log.info("executor connected", address=address, num_blocks=joined[-1][2].num_blocks)
    return joined


class StaticMembership:
    def __init__(self, make_client: ClientFactory, addresses: list[str], joined: list[Joined]) -> None:
        """``joined``: the executors of ``addresses`` connected at start (`wait_for_executors`)."""
        self.make_client = make_client
        self.addresses = addresses
        # address -> executor id, once connected
        self.executor_of = {address: j[0] for address, j in zip(addresses, joined, strict=True)}

    def num_known(self) -> int:
        """The executors this scheduler serves on when all are up."""
        return len(self.addresses)

    async def run(self, engine: Engine) -> None:
        """Reconnects executors that went down; runs until cancelled."""
        while True:
            await asyncio.sleep(RECONNECT_INTERVAL_S)
            for address in self.addresses:
                if self.executor_of.get(address) in engine.lanes:
                    continue
                try:
                    executor_id, client, info = await handshake(self.make_client, address, PROBE_TIMEOUT_S)
                except ExecutorError:
                    continue
                try:
                    engine.add_executor(executor_id, client, info)
                except ValueError as exc:
                    log.error("executor refused", address=address, error=str(exc))
                    await client.close()
                    continue
                self.executor_of[address] = executor_id
