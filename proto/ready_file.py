"""The ready file: how a launched npuserve process tells its launcher it serves, and where.

A process started with ``--ready-file PATH`` writes one JSON object there once it listens
(addresses, pid, handshake); the launcher polls for the file. The write is atomic (a temp file in
the same folder, then a rename), so a reader never sees half an object.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_ready_file(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def read_ready_file(path: Path) -> dict[str, Any] | None:
    """The payload, or None while the process has not written it yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return json.loads(text)
