"""`npuserve`'s entry point: what it sets up before any command runs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from npuserve.deploy import cli
from npuserve.deploy.grpc_env import GRPC_EXPERIMENTS_ENV, GRPC_FORK_SUPPORT_ENV, GRPC_IO_EXPERIMENTS


def test_every_command_runs_with_npuserves_grpc_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A command has it before it can start gRPC: no fork handlers (it launches children while its
    # calls run), the I/O stack `grpc_env` picks.
    seen = []

    def command(args: argparse.Namespace) -> int:
        seen.append((os.environ.get(GRPC_FORK_SUPPORT_ENV), os.environ.get(GRPC_EXPERIMENTS_ENV)))
        return 0

    monkeypatch.delenv(GRPC_FORK_SUPPORT_ENV, raising=False)
    monkeypatch.delenv(GRPC_EXPERIMENTS_ENV, raising=False)
    monkeypatch.setitem(cli.COMMANDS, "doctor", dataclasses.replace(cli.COMMANDS["doctor"], run=command))
    with pytest.raises(SystemExit) as exited:
        cli.main(["doctor"])
    assert exited.value.code == 0 and seen == [("0", GRPC_IO_EXPERIMENTS)]


def test_a_command_is_parsed_with_its_own_flags_alone() -> None:
    """`main` builds only the named command's flags: the processes `serve` starts parse quickly."""
    parser = cli.build_parser(only="gateway")
    args = parser.parse_args(["gateway", "--scheduler", "127.0.0.1:1", "--port", "0"])
    assert (args.command, args.scheduler, args.port) == ("gateway", "127.0.0.1:1", 0)
    with pytest.raises(SystemExit):  # the executor's flags were not built
        parser.parse_args(["executor", "--model", "m"])
    full = cli.build_parser()
    assert full.parse_args(["executor", "--model", "m"]).model == "m"


@pytest.mark.parametrize(
    "command",
    [["serve"], ["gateway", "--scheduler", "127.0.0.1:1"]],
    ids=["serve", "gateway"],
)
def test_the_openai_api_on_a_public_address_without_a_key_refuses_to_start(command: list[str]) -> None:
    """As the scheduler does: exit 2 before anything starts, naming every way out."""
    env = {k: v for k, v in os.environ.items() if k != "NPUSERVE_API_KEY"}
    argv = [sys.executable, "-m", "npuserve.deploy.cli", *command, "--host", "0.0.0.0", "--port", "0"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    stderr = result.stderr
    assert "refusing to serve the OpenAI API on 0.0.0.0 with no API key" in stderr
    for fix in ("--api-key", "NPUSERVE_API_KEY", "--host 127.0.0.1", "--allow-unauthenticated"):
        assert fix in stderr, stderr
