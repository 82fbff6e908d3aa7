"""`start_eagerly`: a coroutine runs at once up to its first wait, then goes on in a task that
behaves as one started with it: values and failures of its waits, cancellation, its context."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from npuserve.scheduler.api.eager_start import start_eagerly

NAME: contextvars.ContextVar[str] = contextvars.ContextVar("name", default="caller")


def test_a_coroutine_that_never_waits_ends_at_once_in_a_context_of_its_own() -> None:
    async def scenario() -> list[str]:
        seen: list[str] = []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)

        async def opens() -> None:
            NAME.set("opened")
            await asyncio.shield(done)  # a wait for what is done already does not suspend
            seen.append(NAME.get())

        assert start_eagerly(opens()) is None
        seen.append(NAME.get())  # the caller's context is untouched
        return seen

    assert asyncio.run(scenario()) == ["opened", "caller"]


def test_a_coroutine_that_waits_goes_on_in_a_task() -> None:
    async def scenario() -> list[object]:
        seen: list[object] = []
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        failure: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def waits() -> None:
            NAME.set("opened")
            seen.append("before")
            seen.append(await answer)
            await asyncio.sleep(0)  # a bare turn of the loop
            try:
                await failure
            except ValueError as exc:
                seen.append(str(exc))
            seen.append(NAME.get())
            seen.append(asyncio.current_task() is task)

        task = start_eagerly(waits())
        assert task is not None and seen == ["before"]
        answer.set_result(7)
        failure.set_exception(ValueError("refused"))
        await task
        return seen

    assert asyncio.run(scenario()) == ["before", 7, "refused", "opened", True]


def test_cancelling_its_task_cancels_the_wait() -> None:
    async def scenario() -> list[str]:
        seen: list[str] = []
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def waits() -> None:
            try:
                await never
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            finally:
                seen.append("closed")

        task = start_eagerly(waits())
        assert task is not None
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert never.cancelled()
        return seen

    assert asyncio.run(scenario()) == ["cancelled", "closed"]


def test_a_failure_before_the_first_wait_is_logged_not_raised() -> None:
    async def scenario() -> asyncio.Task[None] | None:
        async def fails() -> None:
            raise RuntimeError("a bug")

        return start_eagerly(fails())

    assert asyncio.run(scenario()) is None
