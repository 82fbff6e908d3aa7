"""A tensor-parallel group's defaults, importable without torch: `ParallelConfig` takes them, and
so does `npuserve executor`'s command line (`npuserve.deploy.executor_flags`)."""

from __future__ import annotations

DEFAULT_TP_CONNECT_TIMEOUT_S = 120.0  # seconds every rank waits for the others (and for a collective)
