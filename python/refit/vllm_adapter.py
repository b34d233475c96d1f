"""vLLM adapter for refit -- AN EXAMPLE, NOT TESTED.

vLLM cannot be installed on the machines refit is developed and tested on (no GPU, and its wheels
pull CUDA builds of PyTorch), so this module has never run against a real vLLM. It follows vLLM's
documented extension points (``worker_extension_cls`` and ``collective_rpc``) and the reference's
worker glue (NeMo RL's VllmCheckpointEngineMixin), and nothing in refit imports it. Treat it as a
starting point to adapt and test on a GPU machine, not as a supported integration.

What it does: a worker extension that gives every vLLM worker a refit checkpoint engine and feeds
every received batch into the model's ``load_weights`` (``receive_weights(load)``, the callback
form of ``receive_weight_batches()``)::

    llm = vllm.LLM(model=..., worker_extension_cls="refit.vllm_adapter.RefitWorkerExtension",
                   load_format="dummy")            # the first refit brings the real weights
    group = VllmRolloutGroup(llm, policy_group)    # a refit.WorkerGroup (policy side: yours)
    sync = refit.WeightSynchronizer(config, group)
    sync.sync_weights()

Limits, plainly:
- untested (see above); vLLM's internal APIs change between releases: ``collective_rpc``,
  ``model_runner.model`` and ``load_weights(weights=...)`` are assumed as in vLLM 0.8-0.10 (V1);
- received tensors are torch tensors on the transfer device: with refit's default ``device: cpu``
  (and any build without the CUDA data path) they are host tensors and ``load_weights`` copies
  them to the GPU (one host-to-device copy per tensor, pageable memory);
- views are valid until ``load`` returns (the next batch): ``load_weights`` must finish its
  copies before returning, hence the ``torch.cuda.synchronize()`` after each batch (as the
  reference);
- one engine per vLLM worker; rollout ranks follow the reference's ``resolve_rollout_rank``
  (external data parallelism or DP leader prefix + local rank);
- FP8 KV-cache scales: the policy side sends them (``send_weights(weights, kv_scales=...)``;
  a refit.EngineWorker source does so with its program's ``kv_scales(index)``), and they reach
  ``load_weights`` as ``model.layers.{i}.self_attn.attn.q_scale`` / ``...self_attn.k_scale`` /
  ``...self_attn.v_scale`` tensors; vLLM's post-processing of them after loading is not ported;
- not ported from the reference: wiring the sharded-expert direct loader (refit.ExpertLoader)
  into vLLM's fused expert parameters, and the async engine's RPC flavour.

python/tests/test_vllm_adapter.py drives VllmRolloutGroup with stand-ins for vLLM's workers and
``collective_rpc`` (NumPy tensors): it checks the adapter's plumbing, not vLLM.
"""

from __future__ import annotations

import sys
from typing import Any, List, Mapping, Optional, Sequence

import refit


def resolve_rollout_rank(rank_prefix: int, rollout_world_size: int) -> int:
    """The reference's rollout rank of this vLLM worker: its global rank when the worker's process
    group already spans every rollout rank (external DP), else rank_prefix + local rank."""
    try:
        import torch.distributed as dist
    except ImportError:  # no torch.distributed: one worker per engine
        return rank_prefix
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == rollout_world_size:
            return dist.get_rank()
        return rank_prefix + dist.get_rank()
    return rank_prefix


class RefitWorkerExtension:
    """Mixed into every vLLM worker by ``worker_extension_cls``; call its methods with
    ``llm.collective_rpc("refit_...", args=(...))``. ``self`` is the vLLM worker."""

    _refit_engine: Optional[refit.CheckpointEngine] = None
    #: How received tensors reach load_weights (torch tensors for vLLM).
    refit_framework: str = "torch"

    def refit_total_memory_bytes(self, device: str = "cuda") -> int:
        """Total memory of this worker's transfer device (the reference asks torch for the GPU's)."""
        if device.startswith("cuda"):
            import torch

            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return refit.total_device_memory_bytes(device)

    def refit_init_engine(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None:
        """Creates this worker's engine once (later calls do nothing, as in the reference)."""
        if self._refit_engine is None:
            kwargs = dict(engine_kwargs)
            kwargs.setdefault("framework", self.refit_framework)
            self._refit_engine = refit.create_checkpoint_engine(backend, bucket_size_bytes, kwargs)

    def refit_prepare(self) -> bytes:
        return self._refit_engine.prepare()

    def refit_init_process_group(self, rank_prefix: int, train_world_size: int, rollout_world_size: int,
                                 metadata: Sequence[bytes]) -> None:
        rank = resolve_rollout_rank(rank_prefix, rollout_world_size)
        self._refit_engine.init_rollout_process_group(rank, train_world_size, rollout_world_size, list(metadata))

    def refit_update_weights(self) -> bool:
        """One refit: every batch (the FP8 KV-cache scales too, when the policy sends them) goes
        to the model's load_weights. Returns True on success (a failure raises, and the driver
        treats a destination's False result as a failure too)."""
        torch = sys.modules.get("torch")
        sync = torch is not None and torch.cuda.is_available()
        model = self.model_runner.model

        def load(batch):
            model.load_weights(weights=batch)
            if sync:
                torch.cuda.synchronize()  # the batch's views die when load returns

        self._refit_engine.receive_weights(load, framework=self.refit_framework)
        return True

    def refit_finalize(self) -> None:
        if self._refit_engine is not None:
            self._refit_engine.finalize()


class PolicySide:
    """What VllmRolloutGroup needs of the training side (your policy workers, e.g. Ray actors that
    are refit.EngineWorker("policy", rank, program)). Every call acts on all policy workers."""

    world_size: int

    def total_memory_bytes(self, device: str) -> List[int]: ...

    def create_engines(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None: ...

    def prepare(self) -> List[bytes]: ...

    def init_process_groups(self, train_world_size: int, rollout_world_size: int, metadata: Sequence[bytes]) -> None:
        """init_policy_process_group(rank, T, R, metadata) on every policy worker."""

    def refit(self, index: int) -> List[Any]:
        """send_weights(weights, kv_scales=...) on every policy worker: a refit.EngineWorker
        source sends its program's weights(index) and, with an fp8 kv_cache_dtype engine, the
        FP8 KV-cache scales its program's kv_scales(index) gives."""

    def finalize(self) -> None: ...


class VllmRolloutGroup:
    """A refit.WorkerGroup: the policy workers (a PolicySide) are the sources, the workers of one
    vLLM engine the destinations (through collective_rpc). A sketch for one vLLM engine without
    data parallelism: rank_prefix is 0 for every worker."""

    def __init__(self, llm: Any, policy: PolicySide):
        self.llm = llm
        self.policy = policy
        self._rollout = len(self._rpc("refit_total_memory_bytes", "cpu"))

    def _rpc(self, method: str, *args: Any) -> List[Any]:
        return list(self.llm.collective_rpc(method, args=args))

    @property
    def train_world_size(self) -> int:
        return self.policy.world_size

    @property
    def rollout_world_size(self) -> int:
        return self._rollout

    def total_memory_bytes(self, device: str) -> List[int]:
        return list(self.policy.total_memory_bytes(device)) + self._rpc("refit_total_memory_bytes", device)

    def create_engines(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None:
        self.policy.create_engines(backend, bucket_size_bytes, engine_kwargs)
        self._rpc("refit_init_engine", backend, bucket_size_bytes, dict(engine_kwargs))

    def prepare(self) -> List[bytes]:
        return list(self.policy.prepare()) + self._rpc("refit_prepare")

    def init_process_groups(self, metadata: Sequence[bytes]) -> None:
        self.policy.init_process_groups(self.train_world_size, self.rollout_world_size, metadata)
        self._rpc("refit_init_process_group", 0, self.train_world_size, self.rollout_world_size, list(metadata))

    def refit(self, index: int) -> List[Any]:
        # Both sides at once: collective_rpc blocks, so the policy side sends from a thread.
        import threading

        out: dict = {}

        def send() -> None:
            try:
                out["policy"] = self.policy.refit(index)
            except BaseException as e:  # noqa: BLE001
                out["error"] = e

        t = threading.Thread(target=send)
        t.start()
        rollout = self._rpc("refit_update_weights")
        t.join()
        if "error" in out:
            raise out["error"]
        return list(out["policy"]) + rollout

    def finalize(self) -> None:
        self.policy.finalize()
        self._rpc("refit_finalize")
