"""`SandboxPool`, serving chat template renders: jobs run in worker processes; a job past its
time is stopped and its worker replaced, one past its memory fails inside the job, a worker that
dies fails its job alone, and other jobs go on meanwhile."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from multiprocessing import resource_tracker

import grpc
import pytest

from npuserve.deploy.runtime.process_name import CHAT_RENDER
from npuserve.deploy.runtime.unknown_message import UnknownMessage
from npuserve.scheduler.api.api_status import status_of
from npuserve.scheduler.text.chat_template import ChatRender, RenderLimits, render_worker
from npuserve.scheduler.text.prompts import render_in
from npuserve.scheduler.text.sandbox_pool import SandboxPool, SandboxUnavailable
from npuserve.scheduler.text.tokenizer import TokenizerError

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
ECHO = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOG = "{% set s = 'x' * 800000000 %}{{ s | length }}"


def job(template: str, max_chars: int = 1 << 20) -> ChatRender:
    return ChatRender(
        template=template,
        variables={"messages": MESSAGES},
        limits=RenderLimits(max_chars=max_chars),
        field="chat_template",
    )


def render_pool(size: int, **options: float) -> SandboxPool:
    return SandboxPool("test", size, render_worker, CHAT_RENDER, **options)  # type: ignore[arg-type]


def run(coroutine_factory: object) -> object:
    return asyncio.run(coroutine_factory())  # type: ignore[operator]


@asynccontextmanager
async def started(size: int, **options: float) -> AsyncIterator[SandboxPool]:
    pool = render_pool(size, **options)
    pool.start()
    try:
        yield pool
    finally:
        pool.close()


def test_renders_in_a_worker_process() -> None:
    async def main() -> str:
        async with started(1) as pool:
            return await render_in(pool, job(ECHO))

    assert run(main) == "user: Once upon a time"


def test_wait_started_returns_once_every_worker_serves() -> None:
    async def main() -> tuple[int, int]:
        async with started(2) as pool:
            await asyncio.wait_for(pool.wait_started(), 60)
            return len(pool.worker_pids), pool._idle.qsize()  # type: ignore[union-attr]

    assert run(main) == (2, 2)


def test_wait_started_returns_at_once_for_a_pool_never_started() -> None:
    """The core's engine, whose API processes render instead, waits on pools it never started."""

    async def main() -> None:
        await asyncio.wait_for(render_pool(2).wait_started(), 5)

    run(main)


def test_endless_render_is_stopped_its_worker_replaced_and_others_go_on() -> None:
    async def main() -> str:
        async with started(2, timeout_s=1.0) as pool:
            await wait_for_workers(pool, 2)
            before = pool.worker_pids
            endless = asyncio.create_task(render_in(pool, job(FOREVER)))
            await asyncio.sleep(0.1)
            assert await render_in(pool, job(ECHO)) == "user: Once upon a time"  # the other worker, meanwhile
            with pytest.raises(TokenizerError, match="longer than 1 s") as caught:
                await endless
            assert caught.value.field == "chat_template"
            await wait_for_workers(pool, 2)
            assert len(pool.worker_pids - before) == 1  # the stopped worker was replaced
            renders = await asyncio.gather(*(render_in(pool, job(ECHO)) for _ in range(4)))
            return renders[-1]

    assert run(main) == "user: Once upon a time"


async def wait_for_workers(pool: SandboxPool, count: int) -> None:
    async def started() -> None:
        while len(pool.worker_pids) < count:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(started(), 60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the address-space limit is Linux's")
def test_memory_past_the_limit_fails_inside_the_template() -> None:
    async def main() -> str:
        async with started(1, memory_bytes=256 << 20) as pool:
            with pytest.raises(TokenizerError, match="memory") as caught:
                await render_in(pool, job(HOG, max_chars=1 << 40))
            assert caught.value.field == "chat_template"
            return await render_in(pool, job(ECHO))  # the worker lives on

    assert run(main) == "user: Once upon a time"


def test_a_cancelled_render_leaves_its_worker_usable() -> None:
    async def main() -> str:
        async with started(1, timeout_s=1.0) as pool:
            slow = asyncio.create_task(render_in(pool, job(FOREVER)))
            await asyncio.sleep(0.2)
            slow.cancel()
            return await render_in(pool, job(ECHO))  # waits for the stopped render's replacement

    assert run(main) == "user: Once upon a time"


def test_a_worker_killed_mid_render_fails_that_render_and_is_replaced() -> None:
    async def main() -> str:
        async with started(1, timeout_s=60.0) as pool:
            await wait_for_workers(pool, 1)
            (pid,) = pool.worker_pids
            endless = asyncio.create_task(render_in(pool, job(FOREVER)))
            await asyncio.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(TokenizerError, match="ended its render process"):
                await endless
            return await render_in(pool, job(ECHO))

    assert run(main) == "user: Once upon a time"


def test_a_pool_whose_workers_cannot_start_fails_renders_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a wait until the client's deadline: UNAVAILABLE (HTTP 503), and the pool keeps trying.
    The workers' interpreter is broken for real (no standard library where it looks): each
    worker process exits at once, as on a node whose Python install is damaged."""
    resource_tracker.ensure_running()  # NOTE: started before, with the environment intact
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")

    async def scenario() -> None:
        pool = render_pool(2)
        pool.start()
        try:
            await asyncio.wait_for(pool.wait_started(), 60)  # NOTE: tried once each, not forever
            with pytest.raises(SandboxUnavailable, match="exit code 1"):
                await asyncio.wait_for(render_in(pool, job(ECHO)), 30)
        finally:
            pool.close()

    run(scenario)
    assert status_of(SandboxUnavailable("x")) == grpc.StatusCode.UNAVAILABLE


def test_an_outcome_of_no_class_a_render_handles_is_refused_by_name() -> None:
    """`render_in` matches a job's outcome against `sandbox_outcomes`: anything else (a tuple,
    as outcomes once were) raises, naming it."""

    class TuplePool:
        timeout_s = 1.0

        async def run(self, job: object) -> object:
            return ("ok", "text")

    with pytest.raises(
        UnknownMessage, match=r"a chat template render has no handler for tuple: \('ok', 'text'\)"
    ):
        asyncio.run(render_in(TuplePool(), job(ECHO)))  # type: ignore[arg-type]
