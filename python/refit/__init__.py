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

from ._refit import (  # noqa: F401  (re-exported)
    BatchIterator,
    BucketSize,
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
    TensorInfo,
    TensorSet,
    TopologyError,
    TransportError,
    UnsupportedError,
    bucket_size_line,
    canonical_dtype,
    cuda_built,
    cuda_device_count,
    destination_layout,
    dtype_size,
    TransferPlan,
    dtensor_request as _dtensor_request,  # noqa: F401  (refit.reshard wraps it)
    fill_synthetic,
    is_fp8_linear_weight,
    is_kv_scale_name,
    fsdp_source_layout,
    layout_from_compact,
    load_config,
    load_model_inventory,
    megatron_source_layouts,
    log,
    new_session_id,
    parse_config,
    plan_transfers,
    resolve_bucket_size,
    set_log_level,
    source_rank_for_destination,
    tensor_info,
    total_device_memory_bytes,
    total_host_memory_bytes,
    xxh3_64,
)
from .reshard import holdings_of, local_tensors  # noqa: F401,E402
from ._refit import __version__  # noqa: F401
from .base import AsyncBatchIterator, CheckpointEngineBase  # noqa: F401
from .checkpoint_format import checkpoint_weights  # noqa: F401
from .chunks import TensorMeta, merge_weight_chunk_batches, split_weight_chunks  # noqa: F401
from .engine import (  # noqa: F401
    CheckpointEngine,
    as_config,
    create_checkpoint_engine,
    engine_kwargs_from_config,
    resolve_framework,
)
from .synchronizer import RefitReport, WeightSynchronizer, WorkerGroup  # noqa: F401
from .worker import BroadcastWorkerGroup, EngineWorker, WorkerProgram  # noqa: F401

__all__ = [name for name in dir() if not name.startswith("_")]
