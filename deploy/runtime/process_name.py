"""Names of npuserve's processes as `ps`, `top` and the scale bench see them (Linux `comm`).

The scheduler's child processes all run `python -c "from multiprocessing.spawn ..."`: their
name says their role, the way vLLM titles its engine-core and API-server processes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

COMM_PATH = Path("/proc/self/comm")
MAX_COMM_BYTES = 15  # the kernel keeps this many
STEP_WORKER = "npuserve-step"
API_SERVER = "npuserve-api"
CHAT_RENDER = "npuserve-render"
GRAMMAR_COMPILE = "npuserve-gram"  # grammar compiles
ROLES = (STEP_WORKER, API_SERVER, CHAT_RENDER, GRAMMAR_COMPILE)


def set_process_name(name: str) -> None:
    """Names this process (where the platform allows it; elsewhere it keeps its name)."""
    with contextlib.suppress(OSError):
        COMM_PATH.write_bytes(name.encode()[:MAX_COMM_BYTES])


def process_name(pid: int) -> str | None:
    """The name of process ``pid``; None when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
