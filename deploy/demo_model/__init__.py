"""The bundled demo model: stories260K, the 260K-parameter TinyStories Llama of Andrej Karpathy's
llama2.c (MIT, see stories260K/LICENSE and NOTICE), in Hugging Face layout with a story chat
template. Every command that takes ``--model`` serves it when none is given, so a machine holding
only npuserve can serve and test. Torch-free: the scheduler reads the name from here."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "stories260K"
DEMO_MODEL_DIR = Path(__file__).resolve().parent / DEMO_MODEL_NAME


def default_served_name(model: str) -> str:
    """The name clients use when no --served-model-name is given: stories260K for the demo model,
    else --model as given."""
    return DEMO_MODEL_NAME if Path(model).expanduser().resolve() == DEMO_MODEL_DIR else model
