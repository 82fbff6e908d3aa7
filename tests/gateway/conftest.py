"""Fixtures of the gateway tests: a chat template for stories260K (which has none)."""

from __future__ import annotations

from pathlib import Path

import pytest

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ChatML template file, for `npuserve serve --chat-template FILE`."""
    path = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    path.write_text(CHATML)
    return path


@pytest.fixture(scope="session")
def api_key() -> str:
    return "sk-npuserve-test"
