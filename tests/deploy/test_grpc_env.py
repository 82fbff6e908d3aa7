"""The gRPC environment npuserve's processes run with: one this grpcio knows, set by every entry
point that starts gRPC."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from npuserve.deploy.bench import scale, simulated_fleet
from npuserve.deploy.grpc_env import GRPC_EXPERIMENTS_ENV, GRPC_FORK_SUPPORT_ENV, GRPC_IO_EXPERIMENTS


def test_grpcio_knows_the_experiments_and_a_stream_round_trip_runs_under_them() -> None:
    # NOTE: in a process of its own: gRPC reads its experiments once, when it starts.
    script = textwrap.dedent(
        """
        import asyncio
        import grpc
        from grpc import aio

        async def main():
            async def echo(requests, context):
                async for request in requests:
                    yield request + b"!"

            server = aio.server()
            handler = grpc.stream_stream_rpc_method_handler(echo)
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"E": handler})])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream("/t.T/E")()
                answers = []
                for message in (b"a", b"b"):
                    await call.write(message)
                    answers.append(await call.read())
                await call.done_writing()
            await server.stop(None)
            print(answers)

        asyncio.run(main())
        """
    )
    env = {**os.environ, GRPC_EXPERIMENTS_ENV: GRPC_IO_EXPERIMENTS}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[b'a!', b'b!']"
    assert "Unknown experiment" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (scale.main, ["--executors", "none"]),  # refused by its parser
        (simulated_fleet.main, ["--count", "0"]),  # refused by its check
    ],
    ids=["bench-scale", "simulated-fleet"],
)
def test_the_benches_run_as_python_modules_set_the_same_environment(
    main: Callable[[list[str]], None], argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m npuserve.deploy.bench.scale` and the simulated executors it starts run gRPC as
    `npuserve bench-scale` and a real executor do (`cli.main`), before they parse anything."""
    monkeypatch.delenv(GRPC_FORK_SUPPORT_ENV, raising=False)
    monkeypatch.delenv(GRPC_EXPERIMENTS_ENV, raising=False)
    with pytest.raises(SystemExit):
        main(argv)
    assert (os.environ[GRPC_FORK_SUPPORT_ENV], os.environ[GRPC_EXPERIMENTS_ENV]) == ("0", GRPC_IO_EXPERIMENTS)
