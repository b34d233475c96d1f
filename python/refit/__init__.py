"""refit: moves LLM weights from RL training processes (sources, the policy) to inference
processes (destinations, the rollout engines) over UCX, with the lifecycle and API of NeMo RL's
checkpoint-engine refit. The C++ engine is inside (refit._refit); see docs/PYTHON.md.

Workers::

    engine = refit.create_checkpoint_engine("nixl", bucket_size_bytes, engine_kwargs)
    metadata = engine.prepare()                                   # bytes, picklable
    engine.init_policy_process_group(rank, T, R, all_metadata)    # or init_rollout_process_group
    engine.send_weights(model.named_parameters())                 # a source, every refit
    for batch in engine.receive_weight_batches():                 # a destination, every refit
        model.load_weights(batch)                                 # views valid until the next batch
    engine.finalize()

Async code: ``await engine.send_weights_async(...)``, ``async for batch in
engine.receive_weight_batches_async()``. Plugins (``create_checkpoint_engine("module:ClassName",
...)``) subclass ``refit.CheckpointEngineBase``; ``split_weight_chunks`` and
``merge_weight_chunk_batches`` cut tensors into bucket-sized chunks and put them back together.

Driver::

    sync = refit.WeightSynchronizer(config, worker_group)        # any refit.WorkerGroup
    sync.sync_weights()                                           # raises when a refit failed
"""

from ._refit import (
    ConfigError,
    ExpertLoader,
    Fp8QuantizingLoader,
    IntegrityError,
    InternalError,
    InvalidArgumentError,
    Layout,
    LayoutError,
    ModelError,
    ModelInventory,
    ParameterLoader,
    PeerLostError,
    ProtocolError,
    RefitConfig,
    RefitError,
    RefitIOError,
    RefitTimeoutError,
    TensorSet,
    TopologyError,
    TransportError,
    UnsupportedError,
    bucket_size_line,
    config_keys,
    cuda_built,
    cuda_device_count,
    destination_layout,
    fill_synthetic,
    fp8_block_inventory,
    fsdp_source_layout,
    is_fp8_linear_weight,
    is_kv_scale_name,
    layout_from_compact,
    load_config,
    load_model_inventory,
    log,
    megatron_source_layouts,
    new_session_id,
    parse_config,
    plan_transfers,
    resolve_bucket_size,
    set_log_level,
    total_device_memory_bytes,
    total_host_memory_bytes,
    xxh3_64,
)
from .base import CheckpointEngineBase
from .checkpoint_format import checkpoint_weights
from .chunks import TensorMeta, merge_weight_chunk_batches, split_weight_chunks
from .engine import CheckpointEngine, as_config, create_checkpoint_engine
from .reshard import holdings_of, local_tensors, megatron_weights
from .synchronizer import RefitReport, WeightSynchronizer, WorkerGroup
from .worker import BroadcastWorkerGroup, EngineWorker, TensorProgram

# Public but not (yet) in docs/PYTHON.md, so not in __all__: return types to annotate with, and
# helpers refit's own modules and tests use. "X as X" re-exports them for type checkers (mypy
# --strict accepts only names in __all__ or imported so).
from ._refit import BatchIterator as BatchIterator
from ._refit import BucketSize as BucketSize
from ._refit import TensorInfo as TensorInfo
from ._refit import TransferPlan as TransferPlan
from ._refit import canonical_dtype as canonical_dtype
from ._refit import dtype_size as dtype_size
from ._refit import source_rank_for_destination as source_rank_for_destination
from ._refit import tensor_info as tensor_info
from .base import AsyncBatchIterator as AsyncBatchIterator
from .engine import engine_kwargs_from_config as engine_kwargs_from_config
from .engine import resolve_framework as resolve_framework
from .worker import WorkerProgram as WorkerProgram

from . import _refit

# nanobind's stubgen leaves __version__ out of the extension's stub.
__version__: str = _refit.__version__  # type: ignore[attr-defined]

# The names docs/PYTHON.md documents (python/tests/test_package.py checks them): no submodules
# (refit.ray, refit.testing... are imported by name) and no helpers of refit's own.
__all__ = [
    # the engine API
    "create_checkpoint_engine", "CheckpointEngine", "CheckpointEngineBase", "checkpoint_weights",
    "destination_layout", "layout_from_compact", "new_session_id", "Layout", "ModelInventory",
    "ParameterLoader", "TensorSet",
    # errors
    "RefitError", "ConfigError", "InvalidArgumentError", "ModelError", "TopologyError", "LayoutError",
    "TransportError", "RefitTimeoutError", "PeerLostError", "IntegrityError", "ProtocolError", "RefitIOError",
    "UnsupportedError", "InternalError",
    # configuration, bucket sizing, machines, models, checks, the log
    "RefitConfig", "parse_config", "load_config", "as_config", "config_keys", "resolve_bucket_size",
    "bucket_size_line", "total_device_memory_bytes", "total_host_memory_bytes", "cuda_built", "cuda_device_count",
    "load_model_inventory", "xxh3_64", "fill_synthetic", "set_log_level", "log",
    # FP8 and sharded experts
    "Fp8QuantizingLoader", "is_kv_scale_name", "is_fp8_linear_weight", "fp8_block_inventory", "ExpertLoader",
    # plugins and chunks
    "TensorMeta", "split_weight_chunks", "merge_weight_chunk_batches",
    # resharding
    "holdings_of", "local_tensors", "megatron_source_layouts", "megatron_weights", "fsdp_source_layout",
    "plan_transfers",
    # the driver
    "WeightSynchronizer", "RefitReport", "WorkerGroup", "EngineWorker", "BroadcastWorkerGroup", "TensorProgram",
]
