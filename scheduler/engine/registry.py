"""Executors discovered from the Redis registry that `executor/registration.py` writes.

`RedisMembership` polls the registry (SCAN + MGET every ``poll_interval_s``) and keeps the
engine's executors equal to the registered ones: a new registration is handshaken and added;
one whose key expired, or whose ``instance_id`` changed (the executor restarted, its KV cache is
empty), is removed, and a restarted one is added back with a fresh block pool. A registered
executor whose lane went down (a failed step) is probed again with a capped backoff until it
answers or its key expires. A record marked ``draining`` (the executor got SIGTERM) gets no new
requests: the engine lets that executor's requests finish, then drops it, and a draining
executor is never admitted.

Redis going away changes nothing that serves: the executors already known keep serving, the
outage is logged once, and discovery resumes when Redis answers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
import structlog

from npuserve.proto.registry_record import parse_record, redis_client, registry_pattern
from npuserve.scheduler.engine.membership import PROBE_TIMEOUT_S, ClientFactory, Joined, handshake
from npuserve.scheduler.lanes.executor_client import ExecutorError

if TYPE_CHECKING:
    from npuserve.scheduler.engine.engine import Engine

log = structlog.get_logger(__name__)

PROBE_BACKOFF_S = 1.0  # after an instance's first failed handshake; doubled after each next one
MAX_PROBE_BACKOFF_S = 10.0


@dataclass(slots=True)
class Member:
    """A registration the engine serves on."""

    instance_id: str
    ttl_s: float


@dataclass(slots=True)
class _Probe:
    """Failed handshakes with one registered instance, to space the next attempt."""

    instance_id: str
    failures: int = 0
    next_at: float = 0.0


class RedisMembership:
    """Runs on the event loop, which alone touches its attributes; Redis calls run on worker
    threads."""

    def __init__(
        self, make_client: ClientFactory, url: str, prefix: str = "npuserve", poll_interval_s: float = 0.5
    ) -> None:
        self.make_client = make_client
        self.prefix = prefix
        self.poll_interval_s = poll_interval_s
        self.members: dict[str, Member] = {}  # executor id -> the registration served
        self._redis = redis_client(url)
        self._latest: dict[str, dict[str, Any]] = {}  # the last registry read
        self._joining: dict[str, asyncio.Task[None]] = {}
        self._probes: dict[str, _Probe] = {}
        self._down_since: float | None = None
        self._run_id: str | None = None
        # NOTE: after an outage or a Redis restart (a new run_id) a missing key proves nothing
        # until the executors have had a TTL to register again; nobody is removed before then.
        self._trusted_since = time.monotonic()

    # -- reading the registry --------------------------------------------------------------------

    def _read(self) -> tuple[str, dict[str, dict[str, Any]]]:
        """The server's run id and every registration (blocking: runs on a worker thread)."""
        try:
            run_id = str(self._redis.info("server").get("run_id", ""))
        except redis.ResponseError:  # INFO refused (ACLs): no restart detection, still discovery
            run_id = ""
        keys = list(self._redis.scan_iter(match=registry_pattern(self.prefix), count=1000))
        records: dict[str, dict[str, Any]] = {}
        for value in self._redis.mget(keys) if keys else []:
            record = parse_record(value) if value is not None else None  # None: expired meanwhile
            if record is not None:
                records[record["executor_id"]] = record
        return run_id, records

    async def poll(self) -> dict[str, dict[str, Any]] | None:
        """The registrations now; None while Redis does not answer (logged once per outage)."""
        try:
            run_id, records = await asyncio.to_thread(self._read)
        except redis.RedisError as exc:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning(
                    "registry unreachable; serving with the executors already known",
                    executors=len(self.members),
                    error=str(exc),
                )
            return None
        now = time.monotonic()
        if self._down_since is not None:
            log.info("registry reachable again", outage_s=round(now - self._down_since, 2))
            self._down_since, self._trusted_since = None, now
        elif self._run_id is not None and run_id != self._run_id:
            log.warning("registry restarted; waiting for executors to register again")
            self._trusted_since = now
        self._run_id = run_id
        self._latest = records
        return records

    def num_known(self) -> int:
        """The executors registered (draining ones included) or served."""
        return len(set(self._latest) | set(self.members))

    # -- joining ---------------------------------------------------------------------------------

    async def _handshake(self, executor_id: str, record: dict[str, Any]) -> Joined | None:
        """Connects to a registered executor; None (and a backoff) when it does not answer."""
        address = record["address"]
        try:
            seen_id, client, info = await handshake(self.make_client, address, PROBE_TIMEOUT_S)
        except ExecutorError as exc:
            self._failed(executor_id, record, f"no handshake at {address}: {exc}")
            return None
        if seen_id != executor_id:
            await client.close()
            self._failed(executor_id, record, f"{address} answers as executor {seen_id}")
            return None
        self._probes.pop(executor_id, None)
        return executor_id, client, info

    def _failed(self, executor_id: str, record: dict[str, Any], why: str) -> None:
        probe = self._probes.get(executor_id)
        if probe is None or probe.instance_id != record["instance_id"]:
            probe = self._probes[executor_id] = _Probe(record["instance_id"])
        probe.failures += 1
        backoff = min(PROBE_BACKOFF_S * 2 ** (probe.failures - 1), MAX_PROBE_BACKOFF_S)
        probe.next_at = time.monotonic() + backoff
        # NOTE: the first failure of an instance is worth a warning; its retries are not.
        level = log.warning if probe.failures == 1 else log.debug
        level("registered executor unreachable", executor=executor_id, error=why, retry_in_s=backoff)

    def _remember(self, executor_id: str, record: dict[str, Any]) -> None:
        ttl_s = record.get("ttl_s")
        ttl_s = float(ttl_s) if isinstance(ttl_s, (int, float)) and ttl_s > 0 else 10.0
        self.members[executor_id] = Member(record["instance_id"], ttl_s)

    async def wait_for_executors(self, timeout_s: float) -> list[Joined]:
        """The executors registered and answering, once there is at least one (the engine needs
        one to start); waits up to ``timeout_s`` for the first to register."""
        deadline = time.monotonic() + timeout_s
        waiting_logged = False
        while True:
            records = {i: r for i, r in (await self.poll() or {}).items() if not r.get("draining")}
            joined = [
                j
                for j in await asyncio.gather(*(self._handshake(i, r) for i, r in records.items()))
                if j is not None
            ]
            if joined:
                for executor_id, _, info in joined:
                    self._remember(executor_id, records[executor_id])
                    log.info("executor discovered", executor=executor_id, num_blocks=info.num_blocks)
                return joined
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no executor registered under {self.prefix!r} in the registry answered within "
                    f"{timeout_s:.0f} s (registrations seen: {len(records)})"
                )
            if not waiting_logged:
                log.info("waiting for executors to register", prefix=self.prefix)
                waiting_logged = True
            await asyncio.sleep(self.poll_interval_s)

    # -- following the registry ------------------------------------------------------------------

    async def run(self, engine: Engine) -> None:
        """Follows the registry until cancelled."""
        try:
            while True:
                await asyncio.sleep(self.poll_interval_s)
                records = await self.poll()
                try:
                    # While Redis is down, rejoin executors from the last read but remove nobody.
                    self._sync(engine, self._latest if records is None else records, records is not None)
                except Exception:  # a bad registration must not end discovery
                    log.exception("registry sync failed")
        finally:
            for task in self._joining.values():
                task.cancel()
            self._redis.close()

    def _sync(self, engine: Engine, records: dict[str, dict[str, Any]], trust_absence: bool) -> None:
        now = time.monotonic()
        for executor_id, member in list(self.members.items()):
            record = records.get(executor_id)
            if record is None:
                if trust_absence and now - self._trusted_since >= member.ttl_s:
                    self._drop(engine, executor_id, "its registration expired")
            elif record["instance_id"] != member.instance_id:
                self._drop(engine, executor_id, "it restarted (a new instance registered)")
            elif record.get("draining"):
                engine.drain_executor(executor_id, "its registration is marked draining")
        if trust_absence:
            for executor_id in set(self._probes) - set(records):
                del self._probes[executor_id]  # it never joined, and its registration is gone
        for executor_id, record in records.items():
            if executor_id in self._joining or record.get("draining"):
                continue
            if executor_id in self.members and executor_id in engine.lanes:
                continue  # serving
            probe = self._probes.get(executor_id)
            if probe is not None and probe.instance_id == record["instance_id"] and now < probe.next_at:
                continue
            self._joining[executor_id] = asyncio.create_task(self._admit(engine, executor_id, record))

    async def _admit(self, engine: Engine, executor_id: str, record: dict[str, Any]) -> None:
        """Handshakes a new, restarted or lost executor and serves on it."""
        try:
            joined = await self._handshake(executor_id, record)
            if joined is None:
                return
            _, client, info = joined
            current = self._latest.get(executor_id)
            if current is None or current["instance_id"] != record["instance_id"]:
                await client.close()  # it left or restarted during the handshake; the next poll sees it
                return
            try:
                engine.add_executor(executor_id, client, info)
            except ValueError as exc:
                await client.close()
                self._failed(executor_id, record, f"refused: {exc}")
                return
            self._remember(executor_id, record)
            log.info("executor discovered", executor=executor_id, address=record["address"])
        finally:
            self._joining.pop(executor_id, None)

    def _drop(self, engine: Engine, executor_id: str, reason: str) -> None:
        self.members.pop(executor_id, None)
        self._probes.pop(executor_id, None)
        log.info("executor left", executor=executor_id, reason=reason)
        engine.remove_executor(executor_id, f"executor {executor_id} left: {reason}")
