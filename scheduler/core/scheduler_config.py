"""The policy core's limits for one executor (`Scheduler`), from its capacity handshake; the
scheduler service's own settings are `scheduler.service_config.ServiceConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.core.step_passes import AUTO_SCHEDULER_STEPS


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    # Multi-step decoding (vLLM's --num-scheduler-steps): a request that samples in a step runs
    # up to this many passes in it, one token each, so every per-step cost is paid once for them.
    num_scheduler_steps: int = 1
    # `--num-scheduler-steps auto`: the lane sets `num_scheduler_steps` as it goes (`step_passes`).
    auto_passes: bool = False
    # The executor answers the requests that run only a step's first pass (the ones it admits)
    # as soon as that pass is done (`early_results`, over the step stream): a step that admits
    # requests then runs every pass for the running ones; otherwise it runs one pass.
    early_first_tokens: bool = False
    # KV blocks of the executor's host-memory tier (`--kv-host-memory`): prefix-cache blocks
    # evicted from the device go there, and hits there come back (`host_tier`).
    num_host_blocks: int = 0

    @classmethod
    def for_executor(
        cls,
        info: ExecutorInfo,
        enable_prefix_caching: bool = True,
        num_scheduler_steps: int = 1,
        early_first_tokens: bool = False,
    ) -> SchedulerConfig:
        """Scheduling within what an executor reported in its capacity handshake;
        ``num_scheduler_steps`` may be `AUTO_SCHEDULER_STEPS` (one pass to start with)."""
        auto_passes = num_scheduler_steps == AUTO_SCHEDULER_STEPS
        return cls(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            num_scheduler_steps=1 if auto_passes else num_scheduler_steps,
            auto_passes=auto_passes,
            early_first_tokens=early_first_tokens,
            num_host_blocks=info.num_host_blocks,
        )
