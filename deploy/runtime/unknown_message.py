"""The default case of a receiver's dispatch over the messages another process sends it.

Each family of messages between npuserve's processes is a union of classes, and its receiver
matches a message against every class of the union. `unknown_message` ends that match: mypy
reports a class of the union that no case handles (its argument must be unreachable), and a
message of no class of the union (a newer peer's, say) raises `UnknownMessage`, naming it.
"""

from __future__ import annotations

from typing import NoReturn


class UnknownMessage(TypeError):
    """A process received a message of no class its receiver handles."""


def unknown_message(receiver: str, message: NoReturn) -> NoReturn:
    raise UnknownMessage(f"{receiver} has no handler for {type(message).__qualname__}: {message!r}")
