"""Tensor parallelism: one executor group across N devices, one executor to the scheduler.

Launch. On one node, ``npuserve executor --tensor-parallel-size N`` is rank 0 and starts ranks
1..N-1 itself through the ``start_ranks`` it is given (`npuserve executor` gives
`npuserve.deploy.local_ranks.LocalRanks`: the same Python with ``--tp-rank r``, each pinned to one
device through ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES), rendezvousing on a free port of
127.0.0.1. Across nodes every rank is started on its own with ``--tensor-parallel-size N
--tp-rank R --master-addr A --master-port P`` (or NPUSERVE_TP_RANK, MASTER_ADDR, MASTER_PORT);
rank 0 listens on A:P. Only rank 0 serves gRPC.

Environment, passed through untouched (started ranks inherit it): HCCL_IF_IP and
HCCL_SOCKET_IFNAME (the address / interface HCCL uses between nodes), GLOO_SOCKET_IFNAME (the
interface of the gloo group), HCCL_CONNECT_TIMEOUT (seconds HCCL waits for its peers),
HCCL_BUFFSIZE (MB of HCCL's buffer per communicator), ASCEND_RT_VISIBLE_DEVICES (the NPUs a
process sees: give each rank of a multi-node group its own).

Rendezvous (`RankGroup`, in `rank_group`: the store, the process groups and their backends).
Ranks wait for each other for ``--tp-connect-timeout`` seconds (default 120), a collective up to
``--distributed-timeout-seconds`` (default 1800, vLLM's name). They meet again after loading their
weights, so that ranks done minutes apart meet before the first all-reduce (the memory
profile's), and agree on the KV block count (the minimum over ranks).

Steps (`GroupLeader`). Rank 0 broadcasts each plan over the gloo group (pickled) and every rank
runs the same step. NOTE: the LM head all-gathers the logits, so every rank samples the same
tokens (as vLLM V1's workers do) and keeps its request state in step without a second message;
only rank 0 answers. While idle, rank 0 broadcasts a heartbeat so the others' receive never
times out and a lost rank is noticed.

KV blocks between executors (`kv_transfer_group`). A step's pulls run on every rank, each taking
its shard through rank 0. Another executor's read of this group's blocks comes to rank 0, which
sends a "read" message per chunk between steps, as it sends steps, and gathers the ranks' shards.

Failures. A rank that dies breaks the current or next collective (gloo reports the closed
connection at once; rank 0 also watches the ranks it started): rank 0 answers the step with
UNAVAILABLE (`GroupLost`), so the scheduler treats the executor as down, stops serving and
exits 1. A rank >= 1 that loses rank 0 exits 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NoReturn, Protocol

import structlog
import torch
import torch.distributed as dist

from npuserve.deploy.runtime.gc_heap import settle_heap_for_serving
from npuserve.executor.config import ExecutorConfig, ModelConfig
from npuserve.executor.input_batch import PlanError
from npuserve.executor.kv_transfer import block_chunk, chunk_spans
from npuserve.executor.kv_transfer_group import GroupKvPuller, gather_shards
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.parallel_config import ParallelConfig, check_devices, check_model_split
from npuserve.executor.platform import resolve_device
from npuserve.executor.rank_group import RankGroup, post_failure
from npuserve.executor.rank_messages import Heartbeat, RankMessage, ReadShards, RunStep, StopRanks
from npuserve.executor.rpc_status import ExecutorStopping, KvPullFailed
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.plan_checks import check_read_block_ids
from npuserve.proto.step_plan import ExecutorInfo, FirstPassAnswer, JoiningSteps, StepPlan, StepResult

log = structlog.get_logger(__name__)

HEARTBEAT_MAX_S = 10.0
# After a lost group, how long a graceful stop may take before the process exits anyway (a
# step stuck in a device collective cannot be interrupted).
HARD_EXIT_AFTER_S = 30.0
STOP_RANKS_GRACE_S = 10.0


class GroupLost(ExecutorStopping):
    """A rank is gone: this executor cannot run steps any more (UNAVAILABLE to the scheduler)."""


class RankProcesses(Protocol):
    """Ranks 1..N-1 of a single-node group, as rank 0 started them."""

    def exited(self) -> str | None:
        """Why a started rank is gone, or None while all run."""

    def stop(self, grace_s: float) -> None:
        """Waits ``grace_s`` for the ranks to exit (they were told to stop), then ends them."""


class StartRanks(Protocol):
    """Starts ranks 1..N-1 of ``parallel``'s group on this node, on ``device``'s kind, to join
    rank 0's rendezvous at ``host``:``port``."""

    def __call__(
        self, config: ExecutorConfig, parallel: ParallelConfig, device: torch.device, host: str, port: int
    ) -> RankProcesses: ...


class TensorParallelRunner(ModelRunner):
    """A ModelRunner holding one rank's shard; its KV cache has the fewest blocks of any rank.
    Its pulls take its shard of the blocks through rank 0 (`GroupKvPuller`)."""

    def __init__(self, config: ExecutorConfig, model_config: ModelConfig, group: RankGroup) -> None:
        self.group = group
        super().__init__(config, model_config, group.tp)
        self.kv_puller = GroupKvPuller(group, self.kv_puller.client)

    def _size_kv_cache(self) -> int:
        # NOTE: ModelRunner sizes the cache right after loading the weights: every rank must have
        # loaded before the profiling run's first all-reduce, or ranks loading minutes apart would
        # spend the collective timeout waiting inside it.
        self.group.barrier("loaded", "load their weights")
        local = super()._size_kv_cache()
        num_blocks = self.group.agree_min("num_blocks", local)
        if num_blocks < local:
            log.info("kv cache shrunk to the smallest rank's", num_blocks=num_blocks, local=local)
        return num_blocks


class GroupLeader:
    """Rank 0: the runner the gRPC server drives. Sends each plan to the other ranks first."""

    def __init__(self, runner: TensorParallelRunner, ranks: RankProcesses | None) -> None:
        self.runner = runner
        self.group = runner.group
        self.ranks = ranks
        self.lost: str | None = None
        self._lost_lock = threading.Lock()
        self._lock = threading.Lock()  # one message at a time: steps and heartbeats
        self._last_sent = time.monotonic()
        self._stopping = threading.Event()
        # Called once when the group is lost, before the process signals itself to stop: the
        # server refuses new schedulers at once (`serve_executor` sets it).
        self.on_lost: Callable[[], None] = lambda: None
        self._heartbeat_s = min(HEARTBEAT_MAX_S, runner.group.parallel.collective_timeout_s / 4)
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()
        if ranks is not None:
            threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def info(self) -> ExecutorInfo:
        return self.runner.info()

    @property
    def num_requests(self) -> int:
        return self.runner.num_requests

    def read_blocks(self, block_ids: list[int]) -> Iterator[pb.BlockChunk]:
        """Every rank's shard of ``block_ids``, chunk by chunk (`gather_shards`), for another
        group's pull; `PlanError` at once for an id outside 1..num_blocks-1. Each chunk is read on
        every rank at once, as a message between steps (the caller keeps steps out meanwhile)."""
        check_read_block_ids(block_ids, self.runner.num_blocks)
        return self._read_shards(block_ids)

    def _read_shards(self, block_ids: list[int]) -> Iterator[pb.BlockChunk]:
        kv_caches = self.runner.kv_caches
        for layer, first, ids in chunk_spans(kv_caches, block_ids):
            with self._lock:
                self._send(ReadShards(layer, ids))
                try:
                    shards = gather_shards(self.group, kv_caches, layer, ids)
                except Exception as exc:
                    raise self._lose(f"cannot gather the ranks' KV blocks: {exc}") from exc
            for shard, blocks in enumerate(shards):
                yield block_chunk(layer, first, blocks, shard)

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        """Sends the step to the other ranks and runs it here. ``joining`` must be None: the
        other ranks run the steps as sent, whole (`ModelRunner.info` says `joins_steps` no)."""
        if joining is not None:
            raise ValueError("a tensor-parallel group runs no step inside another")
        with self._lock:
            self._send(RunStep(plan))
            try:
                return self.runner.execute(plan, on_first_pass)
            except (PlanError, KvPullFailed):
                raise  # every rank refused the plan, or failed its pulls, alike: the group is intact
            except Exception as exc:
                # NOTE: a failure inside the step may have left ranks out of step; never go on.
                raise self._lose(f"step {plan.step_id} failed: {exc}") from exc

    def _send(self, message: RankMessage) -> None:
        """One message to the other ranks (the caller holds the lock); GroupLost once it is lost."""
        if self.lost is not None:
            raise GroupLost(f"tensor-parallel group lost: {self.lost}")
        try:
            self.group.send(message)
        except Exception as exc:
            raise self._lose(f"cannot reach the other ranks: {exc}") from exc
        self._last_sent = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stopping.wait(self._heartbeat_s / 2):
            if time.monotonic() - self._last_sent < self._heartbeat_s or not self._lock.acquire(False):
                continue
            try:
                if not self._stopping.is_set():
                    self._send(Heartbeat())
            except GroupLost:
                pass
            finally:
                self._lock.release()

    def _watch(self) -> None:
        assert self.ranks is not None
        while not self._stopping.wait(0.2):
            exited = self.ranks.exited()
            if exited is not None and not self._stopping.is_set():
                self._lose(exited)
                return

    def _lose(self, reason: str) -> GroupLost:
        """Marks the group lost (once), and unless it is stopping already, stops this process:
        SIGTERM to itself runs the server's graceful stop (`serve_executor`), and a timer ends
        the process if that cannot finish (a step stuck in a device collective)."""
        with self._lost_lock:
            first, self.lost = self.lost is None, self.lost or reason
        if first and not self._stopping.is_set():
            log.error("tensor-parallel group lost; the executor stops", reason=reason)
            self.on_lost()
            timer = threading.Timer(HARD_EXIT_AFTER_S, os._exit, (1,))
            timer.daemon = True
            timer.start()
            os.kill(os.getpid(), signal.SIGTERM)
        return GroupLost(f"tensor-parallel group lost: {self.lost}")

    def close(self) -> None:
        """Stops the other ranks; raises SystemExit(1) when the group was lost."""
        self._stopping.set()
        with self._lock, contextlib.suppress(GroupLost):
            self._send(StopRanks())
        if self.ranks is not None:
            # NOTE: after a loss the others may wait in a collective until it times out: end them.
            self.ranks.stop(STOP_RANKS_GRACE_S if self.lost is None else 0.0)
        self.group.close()
        if self.lost is not None:
            raise SystemExit(f"npuserve executor: error: tensor-parallel group lost: {self.lost}")


def run_follower(runner: TensorParallelRunner) -> NoReturn:
    """Ranks >= 1: run every step rank 0 sends, and give it this rank's part of every KV read,
    until it says stop, then end the process (status 0); SystemExit(1) if it is lost."""
    group = runner.group
    settle_heap_for_serving()
    while True:
        try:
            message = group.receive()
        except Exception as exc:
            _leave(group, f"lost rank 0: {exc}")
        match message:
            case StopRanks():
                break
            case ReadShards(layer, block_ids):
                try:
                    gather_shards(group, runner.kv_caches, layer, block_ids)
                except Exception as exc:
                    _leave(group, f"failed a KV read: {exc}")
            case RunStep(plan):
                try:
                    runner.execute(plan)
                except (PlanError, KvPullFailed):
                    pass  # rank 0 refused the same plan, or failed the same pulls, and answered so
                except Exception as exc:
                    log.exception("tensor-parallel step failed", rank=group.rank, step_id=plan.step_id)
                    _leave(group, f"failed a step: {exc}")
            case Heartbeat():
                pass
    group.close()
    log.info("tensor-parallel rank stopped", rank=group.rank)
    # NOTE: ended here, not by the interpreter's teardown: tearing down the distributed runtime
    # can find one of its threads still running and abort ("terminate called without an active
    # exception", status -6), which the rank's launcher would take for a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave(group: RankGroup, why: str) -> NoReturn:
    """Ranks >= 1: leave the group and end the process with status 1, saying ``why``."""
    group.close()
    raise SystemExit(f"npuserve executor: error: tensor-parallel rank {group.rank} {why}") from None


def start_tensor_parallel(
    config: ExecutorConfig, parallel: ParallelConfig, start_ranks: StartRanks | None
) -> GroupLeader:
    """Builds this process's rank. Rank 0 returns the `GroupLeader` to serve (call `close()`
    when done); ranks >= 1 run the group's steps here until rank 0 stops them, and end the process.
    Rank 0 of a single-node group (`ParallelConfig.starts_ranks`) starts the others with
    ``start_ranks``.

    Everything a user can get wrong (a size that does not split the model, too few devices)
    raises ConfigError before any weight is loaded.
    """
    if parallel.starts_ranks and start_ranks is None:
        raise ValueError("rank 0 of a single-node tensor-parallel group needs start_ranks")
    model_config = ModelConfig.from_pretrained(config.model)
    check_model_split(model_config, parallel.size)
    device = resolve_device(config.device)
    if parallel.starts_ranks:
        check_devices(device, parallel.size)
    rank = parallel.this_rank
    structlog.contextvars.bind_contextvars(tp_rank=rank)
    host = parallel.master_addr or "127.0.0.1"
    store = RankGroup.connect_store(parallel, host, parallel.master_port or 0)
    ranks = None
    if parallel.starts_ranks and start_ranks is not None:
        ranks = start_ranks(config, parallel, device, host, store.port)
    try:
        group = RankGroup(parallel, device, store, ranks.exited if ranks is not None else lambda: None)
        # What must be equal on every rank for their steps to agree (the model path may differ).
        m = model_config
        shape = (m.architecture, m.vocab_size, m.hidden_size, m.num_layers, m.num_heads)
        group.check_same("settings", f"{replace(config, model='')!r} {shape}")
        runner = TensorParallelRunner(config, model_config, group)
    except BaseException as exc:
        post_failure(store, rank, str(exc))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        if ranks is not None:
            ranks.stop(grace_s=2.0)
        raise
    if rank > 0:
        run_follower(runner)
    return GroupLeader(runner, ranks)
