"""refit.vllm_adapter's plumbing without vLLM: stand-ins for vLLM's workers (RefitWorkerExtension
mixed into a class with a model_runner whose model records load_weights) and for LLM.collective_rpc,
a policy side over refit.EngineWorker, and refit.WeightSynchronizer driving both. FP8 KV-cache scales
from the policy's program reach load_weights."""

from __future__ import annotations

from typing import Any, List, Mapping, Sequence

import numpy as np

import refit
from refit.vllm_adapter import RefitWorkerExtension, VllmRolloutGroup

from helpers import call_on_threads, hashes
from test_kv_scales import ScaledSource, make_weights, scale_names


class FakeModel:
    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        self.loaded.update((name, np.array(t, copy=True)) for name, t in weights)


class FakeVllmWorker(RefitWorkerExtension):
    refit_framework = "numpy"  # vLLM gets torch tensors; this stand-in keeps NumPy

    def __init__(self):
        self.model_runner = type("ModelRunner", (), {})()
        self.model_runner.model = FakeModel()


class FakeLLM:
    def __init__(self, workers: int):
        self.workers = [FakeVllmWorker() for _ in range(workers)]

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> List[Any]:
        return call_on_threads([getattr(w, method) for w in self.workers], *args)


class EngineWorkerPolicy:
    """A vllm_adapter.PolicySide over refit.EngineWorker sources of this process."""

    def __init__(self, workers: List[refit.EngineWorker]):
        self.workers = workers
        self.world_size = len(workers)

    def _all(self, method: str, *args: Any) -> List[Any]:
        return call_on_threads([getattr(w, method) for w in self.workers], *args)

    def total_memory_bytes(self, device: str) -> List[int]:
        return self._all("total_memory_bytes", device)

    def create_engines(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None:
        self._all("create_engine", backend, bucket_size_bytes, dict(engine_kwargs))

    def prepare(self) -> List[bytes]:
        return self._all("prepare")

    def init_process_groups(self, train_world_size: int, rollout_world_size: int, metadata: Sequence[bytes]) -> None:
        self._all("init_process_group", train_world_size, rollout_world_size, list(metadata))

    def refit(self, index: int) -> List[Any]:
        self._all("stage", index)
        return self._all("refit", index)

    def finalize(self) -> None:
        self._all("finalize")


def test_the_policys_kv_scales_reach_vllms_load_weights():
    policy = EngineWorkerPolicy([refit.EngineWorker("policy", 0, ScaledSource(),
                                                    engine_kwargs={"kv_cache_dtype": "fp8", "num_layers": 2})])
    llm = FakeLLM(1)
    group = VllmRolloutGroup(llm, policy)
    assert (group.train_world_size, group.rollout_world_size) == (1, 1)
    try:
        sync = refit.WeightSynchronizer({"bucket_bytes": "1MiB", "timeout_s": 30}, group)
        for index in range(2):
            report = sync.sync_weights()
            assert report.destination_results == [True]
            loaded = llm.workers[0].model_runner.model.loaded
            weights = make_weights(seed=index)
            assert hashes([(n, loaded[n]) for n, _ in weights]) == hashes(weights)
            assert float(loaded["model.layers.0.self_attn.k_scale"][0]) == 0.5 + index
            assert float(loaded["model.layers.1.self_attn.attn.q_scale"][0]) == 4.0
            assert {n for n in loaded if refit.is_kv_scale_name(n)} == set(scale_names(2))
        sync.shutdown()
    finally:
        for w in policy.workers:
            w.close()
        for w in llm.workers:
            if w._refit_engine is not None:
                w._refit_engine.close()
