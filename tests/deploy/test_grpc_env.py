"""The gRPC environment npuserve's processes run with is one this grpcio knows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from npuserve.deploy.grpc_env import GRPC_EXPERIMENTS_ENV, GRPC_IO_EXPERIMENTS


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
