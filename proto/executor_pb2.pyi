from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("model", "architecture", "block_size", "num_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "vocab_size", "eos_token_ids", "dtype", "device", "tensor_parallel_size", "executor_id", "version", "instance_id", "joins_steps", "num_host_blocks", "role")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    JOINS_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    tensor_parallel_size: int
    executor_id: str
    version: str
    instance_id: str
    joins_steps: bool
    num_host_blocks: int
    role: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., executor_id: _Optional[str] = ..., version: _Optional[str] = ..., instance_id: _Optional[str] = ..., joins_steps: _Optional[bool] = ..., num_host_blocks: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "num_logprobs", "min_tokens", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    num_logprobs: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., num_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: SamplingOptions
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("req_id", "new_block_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "scheduled_req_ids", "num_scheduled_tokens", "finished_req_ids", "reset", "bitmask", "executor_instance_id", "num_steps", "early_results", "session", "joins_running", "block_copies", "kv_pulls")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    EARLY_RESULTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    JOINS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    KV_PULLS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    scheduled_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    reset: bool
    bitmask: TokenBitmask
    executor_instance_id: str
    num_steps: _containers.RepeatedScalarFieldContainer[int]
    early_results: bool
    session: int
    joins_running: bool
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    kv_pulls: _containers.RepeatedCompositeFieldContainer[KvPull]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., scheduled_req_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., reset: _Optional[bool] = ..., bitmask: _Optional[_Union[TokenBitmask, _Mapping]] = ..., executor_instance_id: _Optional[str] = ..., num_steps: _Optional[_Iterable[int]] = ..., early_results: _Optional[bool] = ..., session: _Optional[int] = ..., joins_running: _Optional[bool] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., kv_pulls: _Optional[_Iterable[_Union[KvPull, _Mapping]]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("to_host", "src", "dst")
    TO_HOST_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    to_host: bool
    src: int
    dst: int
    def __init__(self, to_host: _Optional[bool] = ..., src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class KvPull(_message.Message):
    __slots__ = ("address", "instance_id", "src_block_ids", "dst_block_ids", "req_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    instance_id: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    req_id: str
    def __init__(self, address: _Optional[str] = ..., instance_id: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., req_id: _Optional[str] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("block_ids", "instance_id", "tensor_parallel_size")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    tensor_parallel_size: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("layer", "first", "shape", "dtype", "data", "shard")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    shard: int
    def __init__(self, layer: _Optional[int] = ..., first: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., shard: _Optional[int] = ...) -> None: ...

class TokenBitmask(_message.Message):
    __slots__ = ("req_ids", "words")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    words: bytes
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., words: _Optional[bytes] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("indices", "logprobs", "ranks", "num_top", "top_token_ids", "top_logprobs")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("prepare_s", "forward_s", "sample_s", "total_s", "graph_passes", "eager_passes", "kv_transfers")
    PREPARE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    GRAPH_PASSES_FIELD_NUMBER: _ClassVar[int]
    EAGER_PASSES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    prepare_s: float
    forward_s: float
    sample_s: float
    total_s: float
    graph_passes: int
    eager_passes: int
    kv_transfers: _containers.RepeatedCompositeFieldContainer[KvTransfer]
    def __init__(self, prepare_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., sample_s: _Optional[float] = ..., total_s: _Optional[float] = ..., graph_passes: _Optional[int] = ..., eager_passes: _Optional[int] = ..., kv_transfers: _Optional[_Iterable[_Union[KvTransfer, _Mapping]]] = ...) -> None: ...

class KvTransfer(_message.Message):
    __slots__ = ("kind", "num_bytes", "seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    num_bytes: int
    seconds: float
    def __init__(self, kind: _Optional[str] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "sampled_req_ids", "sampled_token_ids", "logprobs", "timings", "draining", "partial", "failed_pull_req_ids", "landed_pull_req_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    FAILED_PULL_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LANDED_PULL_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: SampledLogprobs
    timings: StepTimings
    draining: bool
    partial: bool
    failed_pull_req_ids: _containers.RepeatedScalarFieldContainer[str]
    landed_pull_req_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., sampled_req_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[SampledLogprobs, _Mapping]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., draining: _Optional[bool] = ..., partial: _Optional[bool] = ..., failed_pull_req_ids: _Optional[_Iterable[str]] = ..., landed_pull_req_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "executor_id", "last_step_id", "instance_id")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    executor_id: str
    last_step_id: int
    instance_id: str
    def __init__(self, serving: _Optional[bool] = ..., executor_id: _Optional[str] = ..., last_step_id: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ("profile_dir",)
    PROFILE_DIR_FIELD_NUMBER: _ClassVar[int]
    profile_dir: str
    def __init__(self, profile_dir: _Optional[str] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("trace_files",)
    TRACE_FILES_FIELD_NUMBER: _ClassVar[int]
    trace_files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trace_files: _Optional[_Iterable[str]] = ...) -> None: ...
