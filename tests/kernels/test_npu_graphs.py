"""ACL graphs on the emulated NPU: a replay runs the captured operations again on the captured
tensors only, and whatever breaks a capture or a replay on a device is refused with its reason."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from npuserve.kernels.npu_emulation.graphs import GraphCaptureError, GraphReplayError
from npuserve.kernels.npu_emulation.runtime import EmulatedMachine, build_torch_npu

BLOCK = 128
CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(1).to(torch.int8)


@pytest.fixture(scope="module")
def torch_npu() -> ModuleType:
    """A torch_npu stand-in of its own (not installed: nothing else sees it)."""
    return build_torch_npu(EmulatedMachine())["torch_npu"]


def test_a_replay_reads_the_captured_tensors_again(torch_npu: ModuleType) -> None:
    npu = torch_npu.npu
    weight = torch.randn(8, 6)
    static_ids = torch.zeros(4, dtype=torch.int64)
    table = torch.randn(20, 6)

    def forward() -> torch.Tensor:
        hidden = F.embedding(static_ids, table)  # [4, 6]
        q, k = F.linear(hidden, weight).split([4, 4], dim=-1)
        normed = torch_npu.npu_rms_norm(q.contiguous(), torch.ones(4))[0]
        return normed * k.reshape(4, 2, 2).flatten(1)

    graph = npu.NPUGraph()
    with torch.inference_mode():
        reserved = npu.memory_reserved()
        with npu.graph(graph, pool=npu.graph_pool_handle()):
            out = forward()
        assert out.isnan().all(), "a capture leaves its outputs unwritten"
        assert npu.memory_reserved() > reserved
        for ids in ([1, 2, 3, 4], [7, 7, 0, 19]):
            static_ids.copy_(torch.tensor(ids))
            graph.replay()
            torch.testing.assert_close(out, forward(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (lambda x: x.sum().item(), "host sync"),
        (lambda x: x.tolist(), r"Tensor.tolist\(\)"),
        (lambda x: x.cpu(), r"Tensor.cpu\(\)"),
        (lambda x: bool(x[0] > 0), "host sync"),
        (lambda x: x + torch.tensor([1.0, 2.0, 3.0]), "host data"),
    ],
    ids=["item", "tolist", "cpu", "bool", "tensor-from-host-data"],
)
def test_capture_refuses_host_syncs_and_allocations_outside_its_pool(
    torch_npu: ModuleType, body: object, reason: str
) -> None:
    npu = torch_npu.npu
    x = torch.ones(3)
    graph = npu.NPUGraph()
    with torch.inference_mode(), pytest.raises(GraphCaptureError, match=reason), npu.graph(graph):
        body(x * 2)  # type: ignore[operator]
    with pytest.raises(GraphReplayError, match="captured nothing"):
        graph.replay()


def test_capture_refuses_synchronize_pinned_memory_and_foreign_pools(torch_npu: ModuleType) -> None:
    npu = torch_npu.npu
    with pytest.raises(GraphCaptureError, match="synchronize"), npu.graph(npu.NPUGraph()):
        npu.synchronize()
    with pytest.raises(GraphCaptureError, match="pinned"), npu.graph(npu.NPUGraph()):
        npu.emulated_host_memory.empty_pinned(4, torch.int32)
    with pytest.raises(GraphCaptureError, match="no graph pool"), npu.graph(npu.NPUGraph(), pool=(0, 1)):
        pass


class Attention:
    """One paged decode batch: ``kv_lens`` requests, one query token each."""

    def __init__(self, torch_npu: ModuleType, kv_lens: list[int]) -> None:
        self.torch_npu = torch_npu
        gen = torch.Generator().manual_seed(0)
        self.query = torch.randn(len(kv_lens), 2, 128, generator=gen).to(torch.bfloat16)
        self.cache = torch.randn(2, 8, BLOCK, 128, generator=gen).to(torch.bfloat16)
        self.block_table = torch.arange(1, 1 + 2 * len(kv_lens), dtype=torch.int32).reshape(-1, 2)
        self.kv_lens = kv_lens

    def arguments(self, kv_lens: list[int]) -> dict[str, object]:
        return dict(
            query=self.query,
            key=self.cache[0],
            value=self.cache[1],
            atten_mask=CAUSAL,
            block_table=self.block_table,
            input_layout="TND",
            block_size=BLOCK,
            actual_seq_lengths=list(range(1, len(kv_lens) + 1)),
            actual_seq_lengths_kv=kv_lens,
            num_key_value_heads=1,
            num_heads=2,
            scale=128**-0.5,
            sparse_mode=3,
        )

    def eager(self, kv_lens: list[int]) -> torch.Tensor:
        return self.torch_npu.npu_fused_infer_attention_score(**self.arguments(kv_lens))[0]


def capture_attention(torch_npu: ModuleType, case: Attention) -> tuple[object, object, object, torch.Tensor]:
    """As vllm-ascend's full_graph_fia: an external event, then a task group around `.out`."""
    npu = torch_npu.npu
    arguments = case.arguments(case.kv_lens)
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**arguments)
    graph = npu.NPUGraph()
    with npu.graph(graph):
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        output = torch.empty_like(case.query)
        lse = torch.empty(1, dtype=case.query.dtype)
        npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(**arguments, workspace=workspace, out=[output, lse])
        handle = npu.graph_task_group_end(stream)
    return graph, handle, event, output


def update(
    torch_npu: ModuleType,
    case: Attention,
    handle: object,
    event: object,
    output: torch.Tensor,
    kv_lens: list[int],
) -> None:
    npu = torch_npu.npu
    stream = npu.Stream()
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**case.arguments(case.kv_lens))
    lse = torch.empty(1, dtype=case.query.dtype)
    with npu.stream(stream):
        npu.graph_task_update_begin(stream, handle)
        # NOTE: another softmax_lse than the captured one: refused as "other tensors" below
        torch_npu.npu_fused_infer_attention_score.out(
            **case.arguments(kv_lens), workspace=workspace, out=[output, lse]
        )
        npu.graph_task_update_end(stream)
        event.record(stream)  # type: ignore[attr-defined]


def test_the_attention_replays_with_the_lengths_of_each_update(torch_npu: ModuleType) -> None:
    npu = torch_npu.npu
    case = Attention(torch_npu, [200, 5, 130])
    with torch.inference_mode():
        graph, handle, event, output = capture_attention(torch_npu, case)
        captured_lse = handle.tasks[0].kwargs["out"][1]  # type: ignore[attr-defined]
        for kv_lens in ([201, 6, 131], [17, 250, 1]):
            stream = npu.Stream()
            arguments = case.arguments(kv_lens)
            workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**arguments)
            with npu.stream(stream):
                npu.graph_task_update_begin(stream, handle)
                torch_npu.npu_fused_infer_attention_score.out(
                    **arguments, workspace=workspace, out=[output, captured_lse]
                )
                npu.graph_task_update_end(stream)
                event.record(stream)
            graph.replay()
            assert torch.equal(output, case.eager(kv_lens))

        # Replayed again without an update: the last step's lengths would run.
        with pytest.raises(GraphReplayError, match="not updated since the last replay"):
            graph.replay()
        # An update into other tensors than the captured task's is no update of it.
        with pytest.raises(GraphCaptureError, match="other tensors"):
            update(torch_npu, case, handle, event, output, [3, 3, 3])


def test_an_unrecorded_external_event_would_hang_the_replay(torch_npu: ModuleType) -> None:
    case = Attention(torch_npu, [9])
    with torch.inference_mode():
        graph, handle, _, _output = capture_attention(torch_npu, case)
        handle.updated = True  # type: ignore[attr-defined]  # as if updated, but no event recorded
        with pytest.raises(GraphReplayError, match="hang"):
            graph.replay()


def test_attention_captures_only_as_an_updatable_task_with_its_workspace(torch_npu: ModuleType) -> None:
    npu = torch_npu.npu
    case = Attention(torch_npu, [40, 2])
    arguments = case.arguments(case.kv_lens)
    output, lse = torch.empty_like(case.query), torch.empty(1, dtype=case.query.dtype)
    with torch.inference_mode():
        with pytest.raises(GraphCaptureError, match="without a task group"), npu.graph(npu.NPUGraph()):
            torch_npu.npu_fused_infer_attention_score(**arguments)
        with pytest.raises(GraphCaptureError, match="without a workspace"), npu.graph(npu.NPUGraph()):
            torch_npu.npu_fused_infer_attention_score.out(**arguments, out=[output, lse])
        small = torch.empty(8, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="workspace of 8 bytes"):
            torch_npu.npu_fused_infer_attention_score.out(**arguments, workspace=small, out=[output, lse])
