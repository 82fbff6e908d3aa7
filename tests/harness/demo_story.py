"""What the bundled demo model, stories260K, writes greedily: a prompt and its continuation."""

from __future__ import annotations

from typing import Any

ONCE = "Once upon a time"
ONCE_60 = (  # its first 60 greedy tokens, as the model's SOURCE.txt records them
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a "
    "big, red ball. She wanted to play with it, but it was too high.\nLily"
)


def stream_the_story(client: Any, model: str) -> list[Any]:
    """The chunks of ONCE's 60-token greedy completion streamed through the official `openai`
    ``client``, the usage chunk last."""
    return list(
        client.completions.create(
            model=model,
            prompt=ONCE,
            temperature=0,
            max_tokens=60,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
