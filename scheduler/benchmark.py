"""`npuserve bench`: a serving benchmark, in process or through the public gRPC API.

A workload of random token-id prompts (seeded; optionally sharing a prefix; arriving at once or
as a Poisson process) runs against one or more targets behind one interface:

* `OfflineTarget`: an `Engine` in this process over `LocalExecutor`s, the same scheduler and
  ModelRunner without any RPC: the baseline that says what the gRPC split costs.
* `GrpcTarget`: a client of a running scheduler's `Generate` stream; without `--address` the bench
  launches executors and a scheduler with the offline engine's flags (`launched_server`), as
  `npuserve serve` does, and stops them after.

Every request asks for exactly ``output_len`` tokens (``ignore_eos``), so variants do equal work.
The report (throughput, TTFT, ITL, TPOT, e2e, prefix-cache hits) lives in `bench_report`. This
module imports no torch; the offline target loads the executor lazily.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import structlog
from tqdm import tqdm

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.deploy.flags import add_api_key_flag, api_key
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import bearer_metadata
from npuserve.proto.channel import MAX_API_MESSAGE_BYTES, aio_client_channel, message_size_options
from npuserve.scheduler.bench_report import (
    BenchSummary,
    RequestRecord,
    format_table,
    plot,
    summarize,
    write_json,
)
from npuserve.scheduler.engine import Engine, EngineConfig, PromptInput
from npuserve.scheduler.request import SamplingParams

if TYPE_CHECKING:
    from npuserve.executor.config import ExecutorConfig

log = structlog.get_logger(__name__)

FIRST_TOKEN_ID = 3  # random prompts avoid the usual unk/bos/eos ids 0-2


@dataclass(slots=True)
class WorkloadConfig:
    """A benchmark workload. Prompt lengths include the shared prefix."""

    num_requests: int = 64
    prompt_len_min: int = 128
    prompt_len_max: int = 512
    output_len: int = 128
    shared_prefix_len: int = 0
    request_rate: float = math.inf  # requests/s; finite: Poisson arrivals, inf: all at once
    seed: int = 0
    temperature: float = 0.0

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
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")


@dataclass(slots=True, frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    arrival_s: float  # after the start of the run


def build_workload(config: WorkloadConfig, vocab_size: int) -> list[BenchRequest]:
    """The requests of a workload: the same for a given config and vocabulary.

    NOTE: prompts and arrivals draw from separate seeded streams, so changing the request rate
    keeps the prompts.
    """
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for random prompts")
    tokens = random.Random(f"npuserve-bench-prompts-{config.seed}")
    arrivals = random.Random(f"npuserve-bench-arrivals-{config.seed}")

    def draw(n: int) -> list[int]:
        return [tokens.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    prefix = draw(config.shared_prefix_len)
    requests, clock = [], 0.0
    for index in range(config.num_requests):
        length = tokens.randint(config.prompt_len_min, config.prompt_len_max)
        if index and math.isfinite(config.request_rate):
            clock += arrivals.expovariate(config.request_rate)
        requests.append(BenchRequest(index, prefix + draw(length - len(prefix)), clock))
    return requests


# -- targets ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Chunk:
    """One streamed response: its new tokens, and on the last one the prompt's cached tokens."""

    num_tokens: int
    cached_prompt_tokens: int | None = None


class BenchError(RuntimeError):
    """A request that failed at the target."""


class Target(Protocol):
    """What the measurement loop needs of a target: open, stream one request, close."""

    name: str
    max_model_len: int

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def stream(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> AsyncIterator[Chunk]: ...


def _sampling(max_tokens: int, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)


class OfflineTarget:
    """An engine in this process over ``num_executors`` in-process ModelRunners."""

    def __init__(
        self,
        config: ExecutorConfig,
        num_executors: int = 1,
        enable_prefix_caching: bool = True,
        name: str = "offline",
    ) -> None:
        self.config = config
        self.num_executors = num_executors
        self.enable_prefix_caching = enable_prefix_caching
        self.name = name
        self.max_model_len = 0
        self.engine: Engine | None = None

    async def open(self) -> None:
        from npuserve.executor.local import LocalExecutor  # torch: only when measuring in process
        from npuserve.scheduler.tokenizer import Tokenizer

        def build() -> list[tuple[str, LocalExecutor, Any]]:
            executors = [LocalExecutor(self.config) for _ in range(self.num_executors)]
            return [(f"local-{i}", ex, ex.info()) for i, ex in enumerate(executors)]

        executors = await asyncio.to_thread(build)
        engine_config = EngineConfig(self.config.model, enable_prefix_caching=self.enable_prefix_caching)
        self.engine = Engine(engine_config, Tokenizer.from_pretrained(self.config.model), executors)
        self.engine.start()
        self.max_model_len = self.engine.max_model_len

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
            self.engine = None
        gc.collect()  # NOTE: free the KV cache before the next variant allocates its own

    async def stream(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> AsyncIterator[Chunk]:
        assert self.engine is not None, "open() the target first"
        params = _sampling(max_tokens, temperature, seed)
        async for output in self.engine.generate(PromptInput(token_ids=prompt), params):
            if output.error or any(c.finish_reason in ("error", "abort") for c in output.completions):
                raise BenchError(output.error or "the request was aborted")
            usage = output.usage
            yield Chunk(
                sum(len(c.token_ids) for c in output.completions),
                usage.cached_prompt_tokens if usage is not None else None,
            )


class GrpcTarget:
    """A `grpc.aio` client of a running scheduler's public `Generate` stream."""

    def __init__(
        self,
        address: str,
        name: str = "grpc",
        connect_timeout_s: float = 60.0,
        api_key: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        self.address = address
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.max_model_len = 0
        self._metadata = bearer_metadata(api_key)
        self._tls_ca = tls_ca
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def open(self) -> None:
        options = message_size_options(MAX_API_MESSAGE_BYTES)
        self._channel = aio_client_channel(self.address, options, self._tls_ca)
        self._stub = pb_grpc.SchedulerStub(self._channel)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise BenchError(f"no scheduler answers at {self.address}") from None
        try:
            models = await self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise BenchError(
                f"the scheduler at {self.address} refused: {exc.code().name}: {exc.details()}"
            ) from None
        self.max_model_len = models.models[0].max_model_len

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def stream(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> AsyncIterator[Chunk]:
        sampling = pb.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True
        )
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
        try:
            async for response in self._stub.Generate(request, metadata=self._metadata):
                failed = [c for c in response.completions if c.finish_reason in ("error", "abort")]
                if failed:
                    raise BenchError(failed[0].error_message or f"finish_reason {failed[0].finish_reason}")
                usage = response.usage if response.HasField("usage") else None
                yield Chunk(
                    sum(len(c.token_ids) for c in response.completions),
                    usage.cached_prompt_tokens if usage is not None else None,
                )
        except grpc.aio.AioRpcError as exc:
            raise BenchError(f"{exc.code().name}: {exc.details()}") from None


# -- measurement ------------------------------------------------------------------------------------


async def _run_one(
    target: Target, request: BenchRequest, config: WorkloadConfig, start: float
) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    record = RequestRecord(len(request.prompt_token_ids), time.perf_counter())
    try:
        seed = config.seed + request.index
        async for chunk in target.stream(
            request.prompt_token_ids, config.output_len, config.temperature, seed
        ):
            now = time.perf_counter()
            record.token_times += [now] * chunk.num_tokens
            if chunk.cached_prompt_tokens is not None:
                record.cached_prompt_tokens = chunk.cached_prompt_tokens
        record.end_time = time.perf_counter()
    except Exception as exc:  # one failed request must not end the run: it is counted
        record.error = str(exc) or type(exc).__name__
    return record


async def _measure(
    target: Target,
    config: WorkloadConfig,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    progress: bool,
) -> BenchSummary:
    try:
        await target.open()
        longest = max(len(r.prompt_token_ids) for r in requests) + config.output_len
        if longest > target.max_model_len:
            raise ValueError(
                f"prompts of up to {longest - config.output_len} tokens plus {config.output_len} output "
                f"tokens exceed {target.name}'s max_model_len {target.max_model_len}"
            )
        if warmup:
            start = time.perf_counter()
            short = replace(config, num_requests=len(warmup), output_len=min(4, config.output_len))
            await asyncio.gather(*(_run_one(target, r, short, start) for r in warmup))
        with tqdm(
            total=len(requests), desc=target.name, unit="req", file=sys.stderr, disable=not progress
        ) as bar:
            start = time.perf_counter()

            async def tracked(request: BenchRequest) -> RequestRecord:
                record = await _run_one(target, request, config, start)
                bar.update(1)
                return record

            records = await asyncio.gather(*(tracked(r) for r in requests))
            duration = time.perf_counter() - start
    finally:
        await target.close()
    return summarize(target.name, records, duration)


def measure(
    target: Target,
    config: WorkloadConfig,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest] = (),
    progress: bool = False,
) -> BenchSummary:
    """Opens the target, warms it up, runs the workload, closes it, and summarises the run."""
    return asyncio.run(_measure(target, config, requests, warmup, progress))


def warmup_requests(config: WorkloadConfig, vocab_size: int, token_budget: int = 8192) -> list[BenchRequest]:
    """Prompts as long as the workload's but of their own tokens (no prefix shared with it), about
    one full step of them (``token_budget`` prompt tokens, at least two requests).

    NOTE: on CPU the first step of a large shape runs far slower than later ones (a 4k-token
    prefill of a 150M model: 6.0 s cold, 4.1 s warm); warming up with the workload's shapes keeps
    that out of whichever variant happens to run first.
    """
    own = replace(config, shared_prefix_len=0, request_rate=math.inf, seed=config.seed + 1)
    chosen: list[BenchRequest] = []
    total = 0
    for request in build_workload(own, vocab_size):
        total += len(request.prompt_token_ids)
        if len(chosen) >= 2 and total > token_budget:
            break
        chosen.append(request)
    return chosen


@dataclass(slots=True, frozen=True)
class ServerSpec:
    """What `launched_server` starts: `npuserve executor` and `npuserve scheduler` flags."""

    executor_args: list[str]
    scheduler_args: list[str]
    num_executors: int = 1
    device: str = "auto"


@contextlib.contextmanager
def launched_server(spec: ServerSpec, timeout_s: float = 600.0) -> Iterator[str]:
    """Starts executors and a scheduler on loopback, as `npuserve serve` does, and yields the
    scheduler's gRPC address; stops every process after.

    NOTE: the processes are launched here rather than through `npuserve serve`, which also
    starts the REST gateway: the benchmark measures the gRPC split alone.
    """
    from npuserve.deploy.launcher import Launcher, LaunchError

    launcher = Launcher()
    try:
        executors = [
            launcher.start(
                f"executor-{i}",
                ["executor", *spec.executor_args, "--port", "0"],
                _device_env(spec.device, i, spec.num_executors),
            )
            for i in range(spec.num_executors)
        ]
        addresses = ",".join(str(r["address"]) for r in launcher.wait_ready(executors, timeout_s))
        scheduler_args = ["scheduler", *spec.scheduler_args, "--executors", addresses, "--port", "0"]
        (info,) = launcher.wait_ready([launcher.start("scheduler", scheduler_args)], timeout_s)
        yield str(info["address"])
    except LaunchError as exc:
        raise BenchError(f"the gRPC server did not start: {exc}") from None
    finally:
        launcher.stop()


def _device_env(device: str, index: int, count: int) -> dict[str, str]:
    """Pins executor ``index`` to one device when several share the machine (as `npuserve serve`)."""
    if count == 1 or device not in ("npu", "cuda"):
        return {}
    return {"ASCEND_RT_VISIBLE_DEVICES" if device == "npu" else "CUDA_VISIBLE_DEVICES": str(index)}


# -- variants and the command line ------------------------------------------------------------------

VARIANT_KINDS = ("offline", "grpc", "grpc-unary", "grpc-stream", "caching")


@dataclass(slots=True, frozen=True)
class Variant:
    name: str
    kind: str  # "offline" or "grpc"
    enable_prefix_caching: bool
    step_transport: str = "unary"


def parse_variants(args: argparse.Namespace) -> list[Variant]:
    """`--mode` (default: grpc with `--address`, else offline) or the `--compare` list, as variants.

    ``grpc`` uses `--step-transport`; ``grpc-unary``/``grpc-stream`` name the transport;
    ``caching`` is two offline variants, prefix caching on and off.
    """
    compare, address = args.compare, args.address
    names = (
        [n.strip() for n in compare.split(",")]
        if compare
        else [args.mode or ("grpc" if address else "offline")]
    )
    caching = args.enable_prefix_caching
    variants: list[Variant] = []
    for name in names:
        if name == "offline":
            variants.append(Variant("offline", "offline", caching))
        elif name == "grpc":
            variants.append(Variant("grpc", "grpc", caching, args.step_transport))
        elif name in ("grpc-unary", "grpc-stream"):
            variants.append(Variant(name, "grpc", caching, name.removeprefix("grpc-")))
        elif name == "caching":
            variants += [
                Variant("prefix-cache-on", "offline", True),
                Variant("prefix-cache-off", "offline", False),
            ]
        else:
            raise ValueError(
                f"unknown variant {name!r} in --compare (choose from {', '.join(VARIANT_KINDS)})"
            )
    if len({v.name for v in variants}) != len(variants):
        raise ValueError(f"--compare names a variant twice: {compare}")
    if address and sum(v.kind == "grpc" for v in variants) > 1:
        raise ValueError("--address serves one gRPC variant; omit it to launch one server per variant")
    return variants


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `npuserve bench` (engine flags keep `npuserve serve`'s names and defaults)."""
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        default=str(DEMO_MODEL_DIR),
        help="a local Hugging Face model directory (default: the bundled stories260K demo model)",
    )
    model.add_argument(
        "--preset", help="a random-weight model (e.g. llama-150m) with a synthetic tokenizer, loaded as dummy"
    )
    parser.add_argument(
        "--address", help="HOST:PORT of a running scheduler (default: launch one, or run offline)"
    )
    add_api_key_flag(parser, "present `authorization: Bearer KEY` to the scheduler at --address")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA certificates: reach --address over TLS")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--mode", choices=["offline", "grpc"], help="default: grpc with --address, else offline"
    )
    which.add_argument(
        "--compare", help=f"comma list of variants run on the same workload: {', '.join(VARIANT_KINDS)}"
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-requests", type=int, default=64)
    workload.add_argument("--prompt-len-min", type=int, default=128)
    workload.add_argument("--prompt-len-max", type=int, default=512)
    workload.add_argument("--output-len", type=int, default=128, help="tokens per request (EOS ignored)")
    workload.add_argument(
        "--shared-prefix-len", type=int, default=0, help="leading tokens every prompt shares"
    )
    workload.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: all at once)"
    )
    workload.add_argument("--temperature", type=float, default=0.0)
    workload.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine (offline, and the gRPC server when launched)")
    engine.add_argument("--num-executors", type=int, default=1)
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    engine.add_argument("--kv-cache-memory", type=float, help="KV cache GiB per executor")
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192)
    engine.add_argument("--block-size", type=int)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--step-transport", default="unary", choices=["unary", "stream"])
    engine.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a launched server")
    out = parser.add_argument_group("output")
    out.add_argument("--output-json", type=Path, help="write the summaries and ratios here")
    out.add_argument("--plot", type=Path, help="write a PNG of throughput, TTFT and ITL per variant")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    out.add_argument("--log-format", default="console", choices=["console", "json"])


def _executor_config(args: argparse.Namespace, model: str, load_format: str) -> ExecutorConfig:
    from npuserve.executor.config import ExecutorConfig

    return ExecutorConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gib=args.kv_cache_memory,
        load_format=load_format,
        seed=args.seed,
    )


def _server_spec(args: argparse.Namespace, model: str, load_format: str, variant: Variant) -> ServerSpec:
    """Executor and scheduler flags equal to the offline engine's configuration."""
    executor = {
        "--model": model,
        "--device": args.device,
        "--dtype": args.dtype,
        "--load-format": load_format,
        "--kv-cache-memory": args.kv_cache_memory,
        "--max-model-len": args.max_model_len,
        "--max-num-seqs": args.max_num_seqs,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--block-size": args.block_size,
        "--seed": args.seed,
    }
    logging = {"--log-level": args.log_level, "--log-format": args.log_format}
    scheduler = {"--model": model, "--step-transport": variant.step_transport}
    caching = "--enable-prefix-caching" if variant.enable_prefix_caching else "--no-enable-prefix-caching"
    return ServerSpec(
        _flag_list(executor | logging),
        [*_flag_list(scheduler | logging), caching],
        args.num_executors,
        args.device,
    )


def _flag_list(flags: dict[str, object]) -> list[str]:
    return [item for key, value in flags.items() if value is not None for item in (key, str(value))]


def materialise_preset(name: str, directory: Path, seed: int) -> Path:
    """A random-weight preset's config.json plus a synthetic word-level tokenizer (one word per id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from npuserve.executor import benchmark as runner_benchmark  # torch: only for presets

    if name not in runner_benchmark.PRESETS:
        raise ValueError(f"unknown --preset {name!r} (choose from {', '.join(runner_benchmark.PRESETS)})")
    runner_benchmark.materialise_preset(name, directory, with_weights=False, seed=seed)
    vocab_size = _vocab_size(str(directory))
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)} | {
        f"t{i}": i for i in range(len(specials), vocab_size)
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    special_map = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special_map))
    return directory


def _vocab_size(model: str) -> int:
    path = Path(model) / "config.json"
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot read vocab_size from {path}: {exc}") from None


def _run_variant(
    variant: Variant,
    args: argparse.Namespace,
    model: str,
    load_format: str,
    workload: WorkloadConfig,
    requests: Sequence[BenchRequest],
) -> BenchSummary:
    warmup = warmup_requests(workload, _vocab_size(model), args.max_num_batched_tokens)
    progress = not args.disable_tqdm
    if variant.kind == "offline":
        target = OfflineTarget(
            _executor_config(args, model, load_format),
            args.num_executors,
            variant.enable_prefix_caching,
            variant.name,
        )
        return measure(target, workload, requests, warmup, progress)
    if args.address:
        tls_ca = args.tls_ca.read_bytes() if args.tls_ca else None
        target = GrpcTarget(args.address, variant.name, api_key=api_key(args), tls_ca=tls_ca)
        return measure(target, workload, requests, warmup, progress)
    with launched_server(_server_spec(args, model, load_format, variant), args.startup_timeout) as address:
        return measure(GrpcTarget(address, variant.name), workload, requests, warmup, progress)


def run_bench(args: argparse.Namespace) -> int:
    """`npuserve bench`: runs every variant on one workload; prints, writes and plots the results.

    Returns 0, 1 when a variant failed or lost requests, 2 on a usage error.
    """
    try:
        workload = WorkloadConfig(
            num_requests=args.num_requests,
            prompt_len_min=args.prompt_len_min,
            prompt_len_max=args.prompt_len_max,
            output_len=args.output_len,
            shared_prefix_len=args.shared_prefix_len,
            request_rate=args.request_rate,
            seed=args.seed,
            temperature=args.temperature,
        )
        variants = parse_variants(args)
    except ValueError as exc:
        print(f"npuserve bench: error: {exc}", file=sys.stderr)
        return 2
    summaries: list[BenchSummary] = []
    with tempfile.TemporaryDirectory(prefix="npuserve-bench-model-") as scratch:
        try:
            if args.preset:
                model, load_format = str(materialise_preset(args.preset, Path(scratch), args.seed)), "dummy"
            else:
                model, load_format = args.model, args.load_format
            requests = build_workload(workload, _vocab_size(model))
            print(
                f"workload: {workload.num_requests} requests, prompts {workload.prompt_len_min}-"
                f"{workload.prompt_len_max} tokens (shared prefix {workload.shared_prefix_len}), output "
                f"{workload.output_len}, rate {workload.request_rate} req/s; model {args.preset or model}",
                flush=True,
            )
            for variant in variants:
                summaries.append(_run_variant(variant, args, model, load_format, workload, requests))
        except (BenchError, ValueError) as exc:
            print(f"npuserve bench: error: {exc}", file=sys.stderr)
            return 1
    print(format_table(summaries))
    if args.output_json:
        write_json(args.output_json, {**asdict(workload), "model": args.preset or model}, summaries)
    if args.plot:
        plot(summaries, args.plot, f"{args.preset or Path(model).name}: {workload.num_requests} requests")
    failed = [s for s in summaries if s.num_failed]
    for s in failed:
        print(
            f"npuserve bench: {s.variant}: {s.num_failed} requests failed: {s.first_error}", file=sys.stderr
        )
    return 1 if failed else 0
