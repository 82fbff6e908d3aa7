"""An executor's registration in the Redis registry, kept alive by a heartbeat thread.

Once the executor serves, it writes ``{prefix}:executor:{executor_id}`` as JSON (where to reach
it, which process it is, what it serves) with a TTL, and rewrites it every TTL/3. The scheduler
(`scheduler/engine/registry.py`) reads these keys: a key that expired means the executor is gone, a new
``instance_id`` under the same key means it restarted with an empty KV cache. A draining executor
(SIGTERM) rewrites its record with ``"draining": true`` at once, so the scheduler routes no new
request to it while its requests finish; its stop then deletes the key.

Redis going away never stops the executor: the heartbeat logs once per outage, retries with a
capped backoff, and registers again as soon as Redis answers (a restarted Redis has lost the key).

The record format and key layout are in `proto/registry_record.py`.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from npuserve.proto.registry_record import MAX_SOCKET_TIMEOUT_S, redis_client, registry_key

log = structlog.get_logger(__name__)

MIN_BACKOFF_S = 0.25
# Deletes the key only while it still holds this process's record: an executor that stops late
# must not remove the registration of the instance that replaced it.
_DELETE_IF_OURS = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


@dataclass(slots=True)
class RegistryConfig:
    url: str  # redis://HOST:PORT/DB
    prefix: str = "npuserve"
    ttl_s: float = 10.0
    advertise_address: str | None = None  # None: the address the server bound

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--registry must be a redis://HOST:PORT/DB URL, not {self.url!r}")
        if self.ttl_s < 0.3:
            raise ValueError(f"--registry-ttl must be at least 0.3 s, not {self.ttl_s}")
        if not self.prefix:
            raise ValueError("--registry-prefix must not be empty")
        if self.advertise_address is not None and ":" not in self.advertise_address:
            raise ValueError(f"--advertise-address must be HOST:PORT, not {self.advertise_address!r}")


class ExecutorRegistration:
    """Registers one executor and keeps its key alive.

    Ownership: `start` and `stop` run on the serving thread; the Redis client is used only by the
    heartbeat thread until `stop` has joined it.
    """

    def __init__(
        self, config: RegistryConfig, record: dict[str, Any], client: redis.Redis | None = None
    ) -> None:
        self.config = config
        self.record = record
        self.key = registry_key(config.prefix, record["executor_id"])
        self._payload = json.dumps(record, sort_keys=True)
        self._ttl_ms = max(1, round(config.ttl_s * 1000))
        self.interval_s = config.ttl_s / 3
        self._redis = client or redis_client(config.url, min(MAX_SOCKET_TIMEOUT_S, self.interval_s))
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # the payload and its writes: heartbeat vs drain
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)
        self._backoff_s = 0.0
        self._down_since: float | None = None  # monotonic start of the current outage
        self.num_registrations = 0  # successful writes (first registration and every refresh)
        self.num_failed_beats = 0
        self.num_outages = 0

    def start(self) -> None:
        """Registers now (on the heartbeat thread, so a slow Redis never delays serving)."""
        self._thread.start()

    def drain(self) -> None:
        """Marks the record draining, now and in every later heartbeat (best effort)."""
        with self._write_lock:
            self.record = {**self.record, "draining": True}
            self._payload = json.dumps(self.record, sort_keys=True)
            try:
                self._redis.set(self.key, self._payload, px=self._ttl_ms)
            except redis.RedisError as exc:
                log.warning("could not mark the registration draining", key=self.key, error=str(exc))
                return
        log.info("registration marked draining", key=self.key)

    def stop(self) -> None:
        """Ends the heartbeat and deletes the key (best effort: a dead Redis lets it expire)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        try:
            deleted = self._redis.eval(_DELETE_IF_OURS, 1, self.key, self._payload)
        except redis.RedisError as exc:
            log.warning("could not deregister; the key expires by itself", key=self.key, error=str(exc))
        else:
            log.info("deregistered", key=self.key, deleted=bool(deleted))
        self._redis.close()

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self._beat()

    def _beat(self) -> float:
        """One write of the key; returns the seconds until the next."""
        try:
            # NOTE: SET (not EXPIRE) on every beat, so a Redis that lost the key gets it back.
            with self._write_lock:
                self._redis.set(self.key, self._payload, px=self._ttl_ms)
        except redis.RedisError as exc:
            self.num_failed_beats += 1
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.num_outages += 1
                log.warning(
                    "registry unreachable; serving on and retrying",
                    key=self.key,
                    url=_safe_url(self.config.url),
                    error=str(exc),
                )
            self._backoff_s = min(max(MIN_BACKOFF_S, 2 * self._backoff_s), self.interval_s)
            return self._backoff_s
        if self._down_since is not None and self.num_registrations:
            log.info("registered again", key=self.key, outage_s=round(time.monotonic() - self._down_since, 2))
        elif self.num_registrations == 0:
            log.info(
                "registered",
                key=self.key,
                address=self.record["address"],
                instance_id=self.record["instance_id"],
                ttl_s=self.config.ttl_s,
            )
        self._down_since = None
        self._backoff_s = 0.0
        self.num_registrations += 1
        return self.interval_s


def _safe_url(url: str) -> str:
    """The URL without a password, for logs."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}"
