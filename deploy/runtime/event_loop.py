"""The event loop every npuserve server runs on: uvloop where it is installed (it comes with
``uvicorn[standard]`` on Linux), else asyncio's own.

uvloop's loop runs callbacks in C: the scheduler wakes a stream handler per token and gRPC's
asyncio server accepts one new call per loop iteration, so a cheaper iteration is more tokens per
core and faster admission under load (see the scale bench).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the loop above."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
