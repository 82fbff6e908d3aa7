"""`--tensor-parallel-size`: one executor group over two CPU ranks (gloo), end to end.

Greedy tokens through `npuserve serve --tensor-parallel-size 2` (real processes, real gRPC)
equal an in-process TP=1 runner's and transformers', for a Llama with GQA (2 KV heads over 2
ranks) and a tied-embedding Qwen2 whose single KV head is replicated on both ranks. Each rank
holds and reads about half the weights. Bad input fails before loading, a rank that cannot join
fails the group within the connect timeout, and a rank killed mid-run takes its executor out:
the scheduler moves the requests to a second executor, where they finish with the same tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from harness.reference import save_random_llama, transformers_greedy
from harness.serve import child_pids, generate_concurrently, npuserve_process, serve
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.deploy.executor_flags import TP_RANK_ENV, parallel_config_from_args
from npuserve.executor import model_loader, parallel_config, rank_group
from npuserve.executor.config import ConfigError, ExecutorConfig, ModelConfig
from npuserve.executor.layers import TensorParallel
from npuserve.executor.model_loader import load_model, weight_bytes
from npuserve.executor.model_runner import ModelRunner
from npuserve.kernels import get_backend
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.step_plan import SamplingOptions

transformers = pytest.importorskip("transformers")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
NUM_NEW = 16
TP2 = ("--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "0.02")
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.2,  # spread logits: no argmax ties for float rounding to flip
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    "llama-gqa": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False)
    ),
    "qwen2-kv1-tied": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**COMMON, num_key_value_heads=1, tie_word_embeddings=True)
    ),
}


def save_model(name: str, path: Path, tokenizer_dir: Path | None) -> Path:
    torch.manual_seed(5)
    model = MODELS[name]().eval()
    if name.startswith("qwen2"):  # q/k/v biases start at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    for file in TOKENIZER_FILES if tokenizer_dir is not None else ():
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, path / file)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> dict[str, Path]:
    """Random-weight models with the TinyStories tokenizer (vocab 512), for `npuserve serve`."""
    root = tmp_path_factory.mktemp("tp-models")
    return {name: save_model(name, root / name, stories_dir) for name in MODELS}


def prompts(count: int, seed: int, max_len: int = 40) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def greedy_request(prompt_ids: list[int], num_new: int) -> pb.GenerateRequest:
    """Exactly ``num_new`` greedy tokens, EOS held back until then, as transformers'
    ``min_new_tokens`` does (with ``ignore_eos`` an EOS could be sampled and differ)."""
    params = pb.SamplingParams(temperature=0, max_tokens=num_new, min_tokens=num_new)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=params)


def tp1_greedy(model_dir: Path, prompt_ids: list[list[int]], num_new: int) -> list[list[int]]:
    """Greedy tokens of an in-process, single-rank ModelRunner (EOS held back like above)."""
    runner = ModelRunner(ExecutorConfig(model=str(model_dir), dtype="float32", kv_cache_memory_gib=0.02))
    eos = ModelConfig.from_pretrained(model_dir).eos_token_ids
    options = SamplingOptions(temperature=0, min_tokens=num_new, stop_token_ids=eos)
    requests = [DrivenRequest(f"r{i}", p, num_new, options) for i, p in enumerate(prompt_ids)]
    return [r.output for r in StepDriver(runner, token_budget=64).run(requests)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "npuserve.deploy.cli", *args]


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize(("name", "num_scheduler_steps"), [("llama-gqa", 1), ("qwen2-kv1-tied", 4)])
@pytest.mark.slow
def test_tp2_serve_matches_tp1_and_transformers(
    name: str, num_scheduler_steps: int, model_dirs: dict[str, Path]
) -> None:
    """Through a two-rank group, with one pass a step or four (every rank feeds back the tokens
    all of them sampled alike)."""
    model_dir = model_dirs[name]
    prompt_ids = prompts(8, seed=1)
    expected = transformers_greedy(model_dir, prompt_ids, NUM_NEW)
    assert tp1_greedy(model_dir, prompt_ids, NUM_NEW) == expected
    # A small token budget: chunked prefill runs through the group too.
    steps = ("--num-scheduler-steps", str(num_scheduler_steps))
    with serve(model_dir, *TP2, "--max-num-batched-tokens", "48", *steps) as served:
        results = generate_concurrently(served.stub(), [greedy_request(p, NUM_NEW) for p in prompt_ids])
        assert [tokens for tokens, _, _ in results] == expected
        check = served.integrity(expect_idle=True)
        assert check.ok, check.message
    assert "".join(served.log).count("tensor-parallel group formed") == 2  # both ranks


# --------------------------------------------------------------------------- sharded weights


def test_each_rank_holds_and_reads_half_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-rank weight bytes at TP=2 are about half of TP=1's; every rank reads only its slices
    from disk (only the replicated norms whole); the shards put back together are the model."""
    model_dir = save_model("qwen2-kv1-tied", tmp_path / "qwen2", None)
    config = ModelConfig.from_pretrained(model_dir)
    backend = get_backend(torch.device("cpu"))
    read_whole: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        model_loader.SafetensorsSlice,
        "read",
        lambda self: read_whole.append(tuple(self.shape)) or self._handle.get_tensor(self._name),
    )

    def load(tp: TensorParallel) -> torch.nn.Module:
        return load_model(config, backend, torch.float32, torch.device("cpu"), 64, tp=tp)

    full = load(TensorParallel())
    read_whole.clear()
    shards = [load(TensorParallel(rank, 2)) for rank in range(2)]
    assert all(len(shape) == 1 and shape[0] == config.hidden_size for shape in read_whole), read_whole
    full_bytes = weight_bytes(full)
    for shard in shards:
        assert 0.45 * full_bytes < weight_bytes(shard) < 0.55 * full_bytes

    params = [dict(shard.named_parameters()) for shard in shards]
    whole = dict(full.named_parameters())
    embed = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([p[embed] for p in params]), whole[embed])
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q_size, kv_size = 2 * config.head_dim, config.head_dim  # per rank: 2 query heads, 1 KV head
    q0, k0, v0 = params[0][qkv].split([q_size, kv_size, kv_size])
    q1, k1, v1 = params[1][qkv].split([q_size, kv_size, kv_size])
    q, k, v = whole[qkv].split([2 * q_size, kv_size, kv_size])
    assert torch.equal(torch.cat([q0, q1]), q)
    assert torch.equal(k0, k) and torch.equal(k1, k) and torch.equal(v0, v) and torch.equal(v1, v)


def test_vocabulary_not_divisible_is_padded(tmp_path: Path) -> None:
    """Vocab 511 over 2 ranks: 256 rows each, the last padded with zeros; the logits of the
    shards, put side by side and cut to 511, are the full logits."""
    torch.manual_seed(0)
    config_kwargs = {**COMMON, "vocab_size": 511, "num_key_value_heads": 2, "tie_word_embeddings": False}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_kwargs)).save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    backend = get_backend(torch.device("cpu"))
    models = [
        load_model(config, backend, torch.float32, torch.device("cpu"), 64, tp=tp)
        for tp in (TensorParallel(), TensorParallel(0, 2), TensorParallel(1, 2))
    ]
    full, rank0, rank1 = (m.lm_head for m in models)
    assert rank0.weight.shape == rank1.weight.shape == (256, 64)
    assert torch.equal(rank1.weight[-1], torch.zeros(64))
    hidden = torch.randn(3, 64)
    local = [torch.nn.functional.linear(hidden, head.weight) for head in (rank0, rank1)]
    assert torch.allclose(torch.cat(local, dim=-1)[:, :511], full.logits(hidden), atol=1e-5)


# --------------------------------------------------------------------------- bad input


def test_parallel_config_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def args(**kwargs: object) -> argparse.Namespace:
        base = dict(tensor_parallel_size=2, tp_rank=None, master_addr=None, master_port=None)
        return argparse.Namespace(**{**base, "tp_connect_timeout": 120.0, **kwargs})

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    single_node = parallel_config_from_args(args())
    assert single_node.starts_ranks and single_node.master_addr is None  # MASTER_* unused here
    monkeypatch.setenv(TP_RANK_ENV, "1")
    joined = parallel_config_from_args(args())
    assert (joined.rank, joined.master_addr, joined.master_port) == (1, "10.0.0.1", 29500)
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ConfigError, match="--master-addr and --master-port"):
        parallel_config_from_args(args(tp_rank=1))
    with pytest.raises(ConfigError, match=r"--tp-rank 2 is outside 0\.\.1"):
        parallel_config_from_args(args(tp_rank=2, master_addr="h", master_port=1))


def test_more_ranks_than_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_config, "device_count", lambda device: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError) as refused:
        parallel_config.check_devices(torch.device("cuda"), 4)
    message = str(refused.value)
    assert "--tensor-parallel-size 4 needs 4 cuda devices" in message and "2 are visible" in message
    assert "CUDA_VISIBLE_DEVICES='0,1'" in message
    parallel_config.check_devices(torch.device("cuda"), 2)
    parallel_config.check_devices(torch.device("cpu"), 8)  # ranks share the CPU


@pytest.mark.slow
def test_bad_size_and_ranks_that_cannot_join_fail_clearly(model_dirs: dict[str, Path]) -> None:
    model = str(model_dirs["llama-gqa"])
    base = ("executor", "--model", model, "--device", "cpu", "--kv-cache-memory", "0.01")
    free = [str(free_port()) for _ in range(2)]
    alone = ("--tensor-parallel-size", "2", "--master-addr", "127.0.0.1", "--tp-connect-timeout", "3")
    commands = {
        "size": cli(*base, "--tensor-parallel-size", "3"),
        "rank 0 alone": cli(*base, *alone, "--tp-rank", "0", "--master-port", free[0]),
        "rank 1 alone": cli(*base, *alone, "--tp-rank", "1", "--master-port", free[1]),
    }
    processes = {
        name: subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for name, command in commands.items()
    }
    errors = {}
    for name, process in processes.items():
        # NOTE: generous for a loaded machine's start-up; a rank that hung would wait for ever.
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (name, stderr)
        errors[name] = stderr
    assert "--tensor-parallel-size 3 does not divide num_attention_heads (4)" in errors["size"]
    assert "choose a --tensor-parallel-size in [1, 2, 4]" in errors["size"]
    assert "model loaded" not in errors["size"]  # refused before any weight was read
    assert "ranks [1] of 2 did not join the group within 3 s" in errors["rank 0 alone"]
    assert "rank 1 could not reach rank 0 at 127.0.0.1" in errors["rank 1 alone"]


def test_each_rank_selects_the_device_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cuda:3`` (or npu:3) binds the communicator to device 3, not to device 0."""
    selected: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    rank_group.select_device(torch.device("cuda", 3))
    rank_group.select_device(torch.device("cuda"))  # a rank pinned to one device sees it as 0
    rank_group.select_device(torch.device("cpu"))
    assert selected == [3, 0]


# A rank started with PYTHONPATH at this module's folder runs ModelRunner's NAME DELAY s late.
LATE_RANK = """
import time
from npuserve.executor import model_runner

_original = model_runner.{name}


def _late(*args, **kwargs):
    time.sleep({delay})
    return _original(*args, **kwargs)


model_runner.{name} = _late
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("late", "timeouts"),
    [
        # Loading 10 s late against a 4 s collective timeout: the barrier after loading keeps
        # rank 0 out of the memory profile's all-reduce until rank 1 has its weights.
        ("load_model", ("--tp-connect-timeout", "60", "--distributed-timeout-seconds", "4")),
        # Profiling 10 s late: rank 0 waits in the all-reduce longer than the 6 s rendezvous
        # timeout, which no longer bounds a collective.
        ("profile_kv_budget", ("--tp-connect-timeout", "6", "--distributed-timeout-seconds", "60")),
    ],
    ids=["loads-late", "profiles-late"],
)
def test_a_rank_minutes_behind_the_other_still_forms_the_group(
    late: str, timeouts: tuple[str, ...], emulated_npu: pytest.MonkeyPatch, tmp_path: Path, stories_dir: Path
) -> None:
    """Two ranks on the emulated NPU, started node by node (its KV cache is sized by a profiling
    run, whose first all-reduce comes right after the weights load); rank 1 is slow."""
    emulated_npu.setenv("NPUSERVE_EMULATE_NPU_MEMORY_GIB", "3")
    model = save_random_llama(
        tmp_path / "llama-d64",
        stories_dir,
        seed=4,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    site = tmp_path / "late-rank"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LATE_RANK.format(name=late, delay=10))
    port = str(free_port())
    group = ("--tensor-parallel-size", "2", "--master-addr", "127.0.0.1", "--master-port", port, *timeouts)
    flags = (
        "--model",
        str(model),
        "--device",
        "npu",
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.5",
    )
    flags += ("--max-num-batched-tokens", "256", *group)
    rank1 = subprocess.Popen(
        cli("executor", *flags, "--tp-rank", "1", "--port", "0"),
        env={**os.environ, "PYTHONPATH": str(site)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with npuserve_process("executor", *flags, "--tp-rank", "0", "--port", "0") as (_, ready):
            assert ready["info"]["tensor_parallel_size"] == 2
        _, stderr = rank1.communicate(timeout=60)
        assert rank1.returncode == 0, stderr
        assert "tensor-parallel rank stopped" in stderr
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()


# --------------------------------------------------------------------------- a rank dies


@pytest.mark.slow
def test_killed_rank_fails_its_executor_over_to_another(model_dirs: dict[str, Path]) -> None:
    """SIGKILL rank 1 of a TP=2 executor while streams run: rank 0 exits non-zero, the scheduler
    moves its requests to the TP=1 executor, and every stream ends with the undisturbed tokens."""
    model_dir = model_dirs["llama-gqa"]
    model = str(model_dir)
    num_new = 200  # long enough that the kill lands mid-generation
    prompt_ids = prompts(8, seed=2)
    expected = tp1_greedy(model_dir, prompt_ids, num_new)
    common = ("--model", model, "--port", "0", "--device", "cpu", "--dtype", "float32")
    with (
        npuserve_process("executor", *common, *TP2) as (group, group_ready),
        npuserve_process("executor", *common, "--kv-cache-memory", "0.02") as (_, single_ready),
    ):
        assert group_ready["info"]["tensor_parallel_size"] == 2
        (rank1,) = child_pids(group.pid)
        addresses = f"{group_ready['address']},{single_ready['address']}"
        with npuserve_process(
            "scheduler", "--model", model, "--executors", addresses, "--port", "0", "--routing", "least-load"
        ) as (scheduler, scheduler_ready):
            stub = pb_grpc.SchedulerStub(grpc.insecure_channel(scheduler_ready["address"]))
            outputs: list[list[int]] = [[] for _ in prompt_ids]
            reasons = [""] * len(prompt_ids)
            first_tokens = threading.Barrier(len(prompt_ids) + 1)

            def stream(index: int) -> None:
                waited = False
                for response in stub.Generate(greedy_request(prompt_ids[index], num_new), timeout=120):
                    for completion in response.completions:
                        outputs[index] += completion.token_ids
                        reasons[index] = completion.finish_reason or reasons[index]
                    if not waited and outputs[index]:
                        waited = True
                        first_tokens.wait(60)

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompt_ids))]
            for thread in threads:
                thread.start()
            first_tokens.wait(60)  # every stream has its first token: both executors are busy
            os.kill(rank1, signal.SIGKILL)
            for thread in threads:
                thread.join(120)
            assert group.process.wait(30) != 0  # rank 0 noticed, and failed the executor
            assert reasons == ["length"] * len(prompt_ids)
            assert outputs == expected
            # The lost group's lane is taken down after its last failed step: wait for that (a
            # hang guard, not a timing bound); then only the TP=1 executor's pool is left.
            deadline = time.monotonic() + 30
            while True:
                check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=10)
                assert check.ok, check.message
                if len(check.executors) == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert len(check.executors) == 1
        assert "requests moved" in scheduler.log()  # the group's requests failed over
        # ... and never came back: the lost group's rank 0 refuses a handshake from the moment
        # it is lost, not only once its main thread begins the drain.
        assert scheduler.log().count("executor joined") == 2
        assert "tensor-parallel group lost" in group.log()
