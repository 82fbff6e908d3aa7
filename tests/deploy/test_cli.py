"""`npuserve`'s entry point: what it sets up before any command runs."""

from __future__ import annotations

import argparse
import os

import pytest

from npuserve.deploy import cli
from npuserve.deploy.launcher import GRPC_FORK_SUPPORT_ENV


def test_every_command_runs_without_grpcs_fork_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    # A command sees them off before it can start gRPC (it launches children while its calls run).
    seen = []

    def command(args: argparse.Namespace) -> int:
        seen.append(os.environ.get(GRPC_FORK_SUPPORT_ENV))
        return 0

    monkeypatch.delenv(GRPC_FORK_SUPPORT_ENV, raising=False)
    monkeypatch.setitem(cli.COMMANDS, "doctor", command)
    with pytest.raises(SystemExit) as exited:
        cli.main(["doctor"])
    assert exited.value.code == 0 and seen == ["0"]
