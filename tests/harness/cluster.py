"""Cluster pieces for process-level tests: Redis registries and `npuserve` processes started
together (not one after another), each logging to its own file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

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

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def client(self, timeout_s: float = 5.0) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=timeout_s)

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(self.workdir)]  # fmt: skip
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
def private_redis(workdir: Path) -> Iterator[PrivateRedis]:
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode != 0:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(workdir)
    server.start()
    try:
        yield server
    finally:
        server.kill()


# -- npuserve processes --------------------------------------------------------------------------


@dataclass
class Proc:
    """One `npuserve COMMAND` process; stderr goes to ``log_path``."""

    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def ready(self) -> dict | None:
        return json.loads(self.ready_file.read_text()) if self.ready_file.exists() else None

    def wait_ready(self, timeout_s: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while (ready := self.ready()) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{self.name} did not start (exit {self.process.poll()}):\n{self.log()[-4000:]}")
            time.sleep(0.05)
        return ready

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

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
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(10)


class Processes:
    """Starts `npuserve` processes without waiting for each; stops all of them at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []

    def start(self, name: str, command: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        ready_file = self.workdir / f"{name}.ready.json"
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "npuserve.deploy.cli",
                    command,
                    *args,
                    "--ready-file",
                    str(ready_file),
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env={**os.environ, **(env or {})},
            )
        proc = Proc(name, process, ready_file, log_path)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.process.poll() is None:
                proc.process.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.process.wait(15)
            except subprocess.TimeoutExpired:
                proc.process.kill()
                proc.process.wait(10)


@contextmanager
def processes(workdir: Path) -> Iterator[Processes]:
    started = Processes(workdir)
    try:
        yield started
    finally:
        started.stop_all()
