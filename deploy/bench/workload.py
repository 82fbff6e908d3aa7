"""The serving bench's workload: seeded random token-id prompts (optionally sharing prefixes),
arriving at once or as a Poisson process; the same for a given config and vocabulary.

A mixed load adds ``long_prompts`` long prompts that keep arriving while the others decode, evenly
spaced (``long_prompt_rate`` per second, the first one interval after the start): what
prefill/decode disaggregation is measured under (`npuserve bench --compare colocated,disaggregated`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

FIRST_TOKEN_ID = 3  # random prompts avoid the usual unk/bos/eos ids 0-2


@dataclass(slots=True)
class WorkloadConfig:
    """A benchmark workload. Prompt lengths include the shared prefix."""

    num_requests: int = 64
    prompt_len_min: int = 128
    prompt_len_max: int = 384  # with the output, within the demo model's 512-token context
    output_len: int = 128
    shared_prefix_len: int = 0
    num_prefixes: int = 1  # prompts share one of this many prefixes, in turn
    request_rate: float = math.inf  # requests/s; finite: Poisson arrivals, inf: all at once
    temperature: float = 0.0
    seed: int = 0
    long_prompts: int = 0  # long prompts arriving while the others decode (0: none)
    long_prompt_len: int = 1024
    long_prompt_rate: float = 1.0  # long prompts per second, evenly spaced
    long_output_len: int = 16  # each long prompt's output tokens

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(
                f"need 1 <= --prompt-len-min <= --prompt-len-max, got {self.prompt_len_min}, {self.prompt_len_max}"
            )
        if self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if not 0 <= self.shared_prefix_len <= self.prompt_len_min:
            raise ValueError(
                f"--shared-prefix-len must be in [0, --prompt-len-min={self.prompt_len_min}], "
                f"got {self.shared_prefix_len}"
            )
        if self.num_prefixes < 1:
            raise ValueError(f"--num-prefixes must be >= 1, got {self.num_prefixes}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.long_prompts < 0:
            raise ValueError(f"--long-prompts must be >= 0, got {self.long_prompts}")
        if self.long_prompts and (self.long_prompt_len < 1 or self.long_output_len < 1):
            raise ValueError("--long-prompt-len and --long-output-len must be >= 1")
        if self.long_prompts and not 0 < self.long_prompt_rate < math.inf:
            raise ValueError(f"--long-prompt-rate must be > 0 and finite, got {self.long_prompt_rate}")


@dataclass(slots=True, frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    arrival_s: float  # after the start of the run
    output_len: int
    long_prompt: bool = False  # one of a mixed load's long prompts


def build_workload(config: WorkloadConfig, vocab_size: int) -> list[BenchRequest]:
    """The requests of a workload: the same for a given config and vocabulary.

    NOTE: prompts and arrivals draw from separate seeded streams, so changing the request rate
    keeps the prompts; the long prompts, after the others, from a stream of their own.
    """
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for random prompts")
    tokens = random.Random(f"npuserve-bench-prompts-{config.seed}")
    arrivals = random.Random(f"npuserve-bench-arrivals-{config.seed}")

    def draw(n: int) -> list[int]:
        return [tokens.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    prefixes = [draw(config.shared_prefix_len) for _ in range(config.num_prefixes)]
    requests, clock = [], 0.0
    for index in range(config.num_requests):
        length = tokens.randint(config.prompt_len_min, config.prompt_len_max)
        if index and math.isfinite(config.request_rate):
            clock += arrivals.expovariate(config.request_rate)
        prefix = prefixes[index % len(prefixes)]
        requests.append(BenchRequest(index, prefix + draw(length - len(prefix)), clock, config.output_len))
    return requests + _long_prompts(config, vocab_size)


def _long_prompts(config: WorkloadConfig, vocab_size: int) -> list[BenchRequest]:
    tokens = random.Random(f"npuserve-bench-long-prompts-{config.seed}")
    return [
        BenchRequest(
            config.num_requests + k,
            [tokens.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(config.long_prompt_len)],
            (k + 1) / config.long_prompt_rate,
            config.long_output_len,
            long_prompt=True,
        )
        for k in range(config.long_prompts)
    ]


def warmup_requests(config: WorkloadConfig, vocab_size: int, token_budget: int = 8192) -> list[BenchRequest]:
    """Prompts as long as the workload's but of their own tokens (no prefix shared with it), about
    one full step of them (``token_budget`` prompt tokens, at least two requests), and one long
    prompt when it has any; all at once, of up to 4 output tokens.

    NOTE: on CPU the first step of a large shape runs far slower than later ones (a 4k-token
    prefill of a 150M model: 6.0 s cold, 4.1 s warm); warming up with the workload's shapes keeps
    that out of whichever variant happens to run first.
    """
    own = replace(config, shared_prefix_len=0, request_rate=math.inf, seed=config.seed + 1)
    chosen: list[BenchRequest] = []
    total = 0
    for request in build_workload(replace(own, long_prompts=0), vocab_size):
        total += len(request.prompt_token_ids)
        if len(chosen) >= 2 and total > token_budget:
            break
        chosen.append(request)
    chosen += _long_prompts(replace(own, long_prompts=min(1, config.long_prompts)), vocab_size)
    return [replace(r, arrival_s=0.0, output_len=min(4, r.output_len)) for r in chosen]
