"""Cluster pieces for process-level tests: Redis registries and `npuserve` processes started
together (not one after another), each logging to its own file."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from npuserve.deploy.launcher import Child, Launcher, LaunchError, python_module

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


def wait_until(
    condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05
) -> object:
    """Polls ``condition`` until it returns something truthy; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- Redis ---------------------------------------------------------------------------------------


@dataclass
class Registry:
    """A Redis URL and a key prefix no other test uses."""

    url: str
    prefix: str
    client: redis.Redis

    def key(self, executor_id: str) -> str:
        return f"{self.prefix}:executor:{executor_id}"

    def record(self, executor_id: str) -> dict | None:
        value = self.client.get(self.key(executor_id))
        return json.loads(value) if value is not None else None

    def executor_ids(self) -> set[str]:
        return {key.rsplit(":executor:", 1)[1] for key in self.client.scan_iter(match=f"{self.prefix}:*")}


@contextmanager
def shared_registry() -> Iterator[Registry]:
    """The shared Redis at 127.0.0.1:6379 under a fresh prefix; the prefix's keys go at the end."""
    client = redis.Redis.from_url(SHARED_REDIS_URL, decode_responses=True, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {SHARED_REDIS_URL}: {exc}")
    registry = Registry(SHARED_REDIS_URL, f"npuserve-test-{uuid.uuid4().hex}", client)
    try:
        yield registry
    finally:
        keys = list(client.scan_iter(match=f"{registry.prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


class PrivateRedis:
    """A `redis-server` of this test's own (no persistence), to kill, restart and pause freely."""

    def __init__(
        self, workdir: Path, bind: Sequence[str] = ("127.0.0.1",), password: str | None = None
    ) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.bind = list(bind)  # the first is where this test connects
        self.password = password  # required of clients (Redis refuses others off loopback without one)
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}{self.bind[0]}:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def client(self, timeout_s: float = 5.0) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=timeout_s)

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", *self.bind, "--save", "",
                   "--appendonly", "no", "--dir", str(self.workdir),
                   *(["--requirepass", self.password] if self.password else [])]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client(timeout_s=1.0)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(answers, 10, f"redis-server on port {self.port}")
        client.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def pause(self, milliseconds: int) -> None:
        """CLIENT PAUSE ALL through a connection of its own."""
        client = self.client()
        client.execute_command("CLIENT", "PAUSE", milliseconds, "ALL")
        client.close()


@contextmanager
def private_redis(
    workdir: Path, bind: Sequence[str] = ("127.0.0.1",), password: str | None = None
) -> Iterator[PrivateRedis]:
    """A private Redis listening on the addresses ``bind``."""
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode != 0:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(workdir, bind, password)
    server.start()
    try:
        yield server
    finally:
        server.kill()


# -- npuserve processes --------------------------------------------------------------------------


class Proc:
    """One `npuserve COMMAND` process (a launcher's `Child`); its output goes to ``log_path``."""

    def __init__(self, launcher: Launcher, child: Child) -> None:
        self.launcher = launcher
        self.child = child
        self.name = child.name
        self.process = child.process
        self.log_path = child.log_path

    @property
    def pid(self) -> int:
        return self.child.pid

    def ready(self) -> dict | None:
        return self.child.ready()

    def wait_ready(self, timeout_s: float = 90.0) -> dict:
        try:
            (ready,) = self.launcher.wait_ready([self.child], timeout_s, watch=[self.child])
        except LaunchError as exc:
            pytest.fail(f"{self.name} did not start: {exc}")
        return ready

    def log(self) -> str:
        return self.child.log()

    def events(self) -> list[dict]:
        """The JSON log lines (run with ``--log-format json``)."""
        found = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
        return found

    def stop(self, timeout_s: float = 15.0) -> int:
        return self.child.stop(timeout_s)


class Processes:
    """Starts `npuserve` processes without waiting for each; stops all of them at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.launcher = Launcher(workdir)

    def start(
        self,
        name: str,
        command: str,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> Proc:
        """`npuserve COMMAND ARGS`, run through ``prefix`` (e.g. `ip netns exec NS`) if given."""
        child = self.launcher.start(
            name,
            [command, *args],
            env,
            command=[*prefix, *python_module()] if prefix else None,
            log_path=self.workdir / f"{name}.log",
        )
        return Proc(self.launcher, child)

    def stop_all(self) -> None:
        self.launcher.stop(grace_s=15)


@contextmanager
def processes(workdir: Path) -> Iterator[Processes]:
    started = Processes(workdir)
    try:
        yield started
    finally:
        started.stop_all()


def events(process: Proc, name: str) -> list[dict]:
    """The JSON log events of ``process`` whose name starts with ``name``."""
    return [e for e in process.events() if e["event"].startswith(name)]
