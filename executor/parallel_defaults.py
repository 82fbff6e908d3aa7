"""A tensor-parallel group's defaults, importable without torch: `ParallelConfig` takes them, and
so does `npuserve executor`'s command line (`npuserve.deploy.executor_flags`)."""

from __future__ import annotations

DEFAULT_TP_CONNECT_TIMEOUT_S = 120.0  # seconds every rank waits for the others to join
# Seconds one collective may wait for the other ranks (vLLM's --distributed-timeout-seconds): as
# long as gloo's default and HCCL's execution timeout (HCCL_EXEC_TIMEOUT, 1836 s on A2/A3), so a rank still
# compiling or capturing while the others wait does not fail the group.
DEFAULT_DISTRIBUTED_TIMEOUT_S = 1800.0
