"""Which decode batch sizes graph mode captures (``--graph-capture-sizes``).

A pure-decode step of ``B`` requests replays the graph of the smallest captured size ``>= B``
(its bucket), padded to it; steps above the largest size run eagerly. The default ladder is
vLLM's: 1, 2, 4, then every multiple of 8 up to 256 and of 16 beyond, up to ``--max-num-seqs``
(which is added when the ladder misses it, so every decode batch has a bucket).

On Ascend the number of graphs is bounded by the device's streams: vllm-ascend v0.13.0
(``utils.update_aclgraph_sizes``) keeps at most 1800 of the 2048 streams for graphs, each graph
taking one per layer and one more, and with a communication group (tensor parallel) 40 streams
fewer and three times the streams per graph (HCCL's unfolding on A3 can take one per rank). Too
many sizes are thinned evenly, keeping the smallest and the largest.
"""

from __future__ import annotations

import structlog

log = structlog.get_logger(__name__)

ACL_GRAPH_STREAMS = 1800
COMM_GROUP_STREAMS = 40


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ..., 256, 272, 288, ... up to ``max_num_seqs``, and it."""
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs + 1, 16)]
    sizes = [size for size in ladder if size <= max_num_seqs]
    return sizes if sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


def max_npu_graphs(num_layers: int, tp_size: int) -> int:
    """Graphs an Ascend device's streams hold for a model of ``num_layers`` layers."""
    comm_groups = 1 if tp_size > 1 else 0
    streams = ACL_GRAPH_STREAMS - COMM_GROUP_STREAMS * comm_groups
    return max(1, streams // (num_layers + 1) // (1 + 2 * comm_groups))


def thin(sizes: list[int], limit: int) -> list[int]:
    """At most ``limit`` of ``sizes`` (ascending), evenly spread, the first and last kept."""
    if len(sizes) <= limit:
        return sizes
    if limit == 1:
        return [sizes[-1]]
    step = (len(sizes) - 1) / (limit - 1)
    return sorted({sizes[round(i * step)] for i in range(limit)})


def capture_sizes(
    requested: tuple[int, ...] | None, max_num_seqs: int, num_layers: int, tp_size: int, on_npu: bool
) -> list[int]:
    """The sizes to capture, ascending: ``requested`` (``--graph-capture-sizes``) or the default
    ladder, none above ``max_num_seqs``, thinned to the device's graph limit on Ascend."""
    sizes = sorted({size for size in requested if size <= max_num_seqs}) if requested else []
    if requested and len(sizes) < len(set(requested)):
        log.warning("graph capture sizes above --max-num-seqs dropped", max_num_seqs=max_num_seqs)
    if not requested:
        sizes = default_capture_sizes(max_num_seqs)
    if on_npu:
        limit = max_npu_graphs(num_layers, tp_size)
        if len(sizes) > limit:
            log.info(
                "graph capture sizes thinned to the device's stream limit", limit=limit, sizes=len(sizes)
            )
            sizes = thin(sizes, limit)
    return sizes
