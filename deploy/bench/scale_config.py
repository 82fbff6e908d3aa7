"""The scale bench's settings (`ScaleConfig`) and limits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from npuserve.deploy.bench.targets import CLIENT_CALLS
from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.executor.simulated import LatencyModel, SimulatedConfig
from npuserve.scheduler.core.router import DEFAULT_PREFILL_WEIGHT
from npuserve.scheduler.core.step_passes import AUTO_SCHEDULER_STEPS

START_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 60.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Streams per client channel: one HTTP/2 connection carrying thousands of streams queues them.
STREAMS_PER_CHANNEL = 256
AWAITING_SAMPLE_S = 0.1  # how often the window samples the streams without a token yet
SATURATED_GAIN = 1.10  # a step up that raises tokens/s by less than this is saturated
TTFT_EXPLODED = 10.0  # TTFT p99 this many times its value at the lowest load has exploded
# The simulated executors' niceness. They stand in for NPUs on other hosts (their steps are
# sleeps), so the CPU they use here (gRPC, step pipelines) is taken from the scheduler; at the
# lowest priority they get what the scheduler and the client leave. At 16 executors x 1,024
# streams (2 cores, interleaved runs) the mean of streams without a first token went 92 -> 74
# from nice 0 to 10, and 51.9 -> 48.2 from 10 to 19, for the same tokens/s; at 64 executors
# nice 19 gave 77k and 114k tokens/s (1,024 and 4,096 streams) against 74k and 115k.
SIMULATED_EXECUTOR_NICE = 19


@dataclass(slots=True)
class ScaleConfig:
    executors: tuple[int, ...] = (16, 32, 64)
    concurrency: tuple[int, ...] = (256, 1024, 4096)
    warmup_s: float = 8.0
    duration_s: float = 15.0
    prompt_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (64, 128)
    base_ms: float = 5.0
    per_token_ms: float = 0.02
    per_seq_ms: float = 0.01
    block_size: int = 128
    num_blocks: int = 0  # per executor; 0: 4x what an even share of the largest concurrency needs
    max_num_seqs: int = 512
    model: Path = DEMO_MODEL_DIR
    routing: str = "prefix-aware"
    routing_prefill_weight: float = DEFAULT_PREFILL_WEIGHT  # the scheduler's --routing-prefill-weight
    executor_nice: int = SIMULATED_EXECUTOR_NICE  # the simulated executors' process (0: as the rest)
    scheduler_workers: int | None = None  # None: the scheduler's default (from the cores)
    api_server_count: int | None = None  # None: the scheduler's default (from the cores)
    async_scheduling: bool = True
    stream_interval: int = 1  # the scheduler's --stream-interval
    num_scheduler_steps: int = AUTO_SCHEDULER_STEPS  # the scheduler's --num-scheduler-steps
    client_call: str = CLIENT_CALLS[0]
    scheduler_log_level: str = "warning"
    seed: int = 0
    # Prefill/decode disaggregation: of each executor count, this many prefill and the rest
    # decode (0: all mixed), one cluster each; long prompts arriving at each of these rates
    # beside the streams (0: none), evenly spaced, in a window each.
    prefill_executors: tuple[int, ...] = (0,)
    long_prompt_rate: tuple[float, ...] = (0.0,)
    long_prompt_len: int = 4096
    long_output_len: int = 16
    max_local_prefill_length: int | None = None  # None: the streams' longest prompt (prompt_len[1])
    kv_bytes_per_token: int = SimulatedConfig().kv_bytes_per_token  # what a pull moves
    pull_gb_per_s: float = LatencyModel().pull_bytes_per_s / 1e9
    repeat: int = 1  # the whole sweep this many rounds, one after another
    profile: bool = False
    profile_at: tuple[int, int] | None = None  # (executors, concurrency); None: the largest
    profile_s: float = 10.0
    profile_native: bool = False  # py-spy --native: C frames too (gRPC's Cython, protobuf's upb)
    switch_interval_ms: float | None = None  # the scheduler's sys.setswitchinterval; None: Python's 5 ms
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if not self.executors or min(self.executors) < 1:
            raise ValueError(f"--executors must be positive counts, got {self.executors}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency must be positive counts, got {self.concurrency}")
        if not 1 <= self.prompt_len[0] <= self.prompt_len[1]:
            raise ValueError(f"bad --prompt-len range {self.prompt_len}")
        if not 1 <= self.output_len[0] <= self.output_len[1]:
            raise ValueError(f"bad --output-len range {self.output_len}")
        if self.client_call not in CLIENT_CALLS:
            raise ValueError(
                f"--client-call must be one of {', '.join(CLIENT_CALLS)}, got {self.client_call}"
            )
        if not 0 <= self.executor_nice <= 19:
            raise ValueError(f"--executor-nice must be within 0..19, got {self.executor_nice}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {self.repeat}")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("--duration must be > 0 and --warmup >= 0")
        if min(self.prefill_executors) < 0 or max(self.prefill_executors) >= min(self.executors):
            raise ValueError(
                f"--prefill-executors {self.prefill_executors} must be >= 0 and leave every executor "
                f"count {self.executors} a decode executor"
            )
        if min(self.long_prompt_rate) < 0:
            raise ValueError(f"--long-prompt-rate must be >= 0, got {self.long_prompt_rate}")
        if (
            max(self.prefill_executors)
            and max(self.long_prompt_rate)
            and self.long_prompt_len <= self.local_prefill
        ):
            raise ValueError(
                f"--long-prompt-len {self.long_prompt_len} would prefill where it decodes: raise it "
                f"above --max-local-prefill-length {self.local_prefill}"
            )
        if (
            min(self.long_prompt_len, self.long_output_len, self.kv_bytes_per_token) < 1
            or self.pull_gb_per_s <= 0
        ):
            raise ValueError(
                "--long-prompt-len, --long-output-len, --kv-bytes-per-token and --pull-gb-per-s must be > 0"
            )
        if self.max_num_seqs < -(-max(self.concurrency) // min(self.executors)):
            raise ValueError(
                f"{max(self.concurrency)} streams over {min(self.executors)} executors exceed "
                f"--max-num-seqs {self.max_num_seqs} per executor; raise it"
            )

    @property
    def local_prefill(self) -> int:
        """The scheduler's --max-local-prefill-length: by default the streams' longest prompt."""
        return self.prompt_len[1] if self.max_local_prefill_length is None else self.max_local_prefill_length

    @property
    def max_model_len(self) -> int:
        long_prompts = self.long_prompt_len + self.long_output_len if max(self.long_prompt_rate) else 0
        return max(self.prompt_len[1] + self.output_len[1], long_prompts)

    @property
    def blocks_per_executor(self) -> int:
        if self.num_blocks:
            return self.num_blocks
        # NOTE: 4x an even share, so a lane that routing overloads queues on max_num_seqs and
        # its step time rather than on blocks (a real NPU holds tens of thousands of blocks);
        # and room for 64 long prompts, held where they prefilled until their KV is pulled.
        per_request = -(-(self.prompt_len[1] + self.output_len[1]) // self.block_size)
        per_executor = -(-max(self.concurrency) // min(self.executors))
        per_long = -(-(self.long_prompt_len + self.long_output_len) // self.block_size)
        long_prompts = 64 * per_long if max(self.long_prompt_rate) else 0
        return max(1024, 4 * per_executor * per_request + long_prompts) + 1
