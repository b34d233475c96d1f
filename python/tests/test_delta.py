"""Delta refit (refit_cfg.nixl.delta) with real training on the policy side: a transformers model
trains with AdamW (python/bench/delta_workload.py, fp32 master weights, bf16 sent), each version
goes to a transformers model in another process over UCX, and after every refit the destination's
state_dict() equals the policy's bitwise while, after the first, only the changed elements cross."""

from __future__ import annotations

import functools
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import refit  # noqa: E402
from refit.multiprocessing_group import ProcessWorkerGroup  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import delta_workload  # noqa: E402

# Small enough that an AdamW step takes well under a second on two cores.
MODEL = dict(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=512)


def _hashes(state: dict) -> dict:
    return {n: refit.xxh3_64(t.contiguous().view(torch.uint8)) for n, t in state.items()}


class TrainingProgram:
    """The policy trains one AdamW step per refit and sends the bf16 cast of its weights; the
    rollout side loads them into its own model (other initial weights) with ParameterLoader."""

    def __init__(self, lr: float, role: str, rank: int):
        self.role = role
        if role == "policy":
            self.versions = delta_workload.generate_versions("llama", steps=10, lr=lr, seed=1, batch=4, seq=64,
                                                             **MODEL)
            self.state = None
        else:
            self.model = delta_workload.build_model("llama", seed=2, **MODEL).to(torch.bfloat16)
            self.loader_ = refit.ParameterLoader(self.model.state_dict())

    def stage(self, index: int) -> None:
        if self.role == "policy":
            _, self.state = next(self.versions)

    def weights(self, index: int):
        return self.state

    def loader(self, index: int):
        return self.loader_

    def report(self, index: int):
        return _hashes(self.state if self.role == "policy" else self.model.state_dict())


@pytest.mark.parametrize("lr", [1e-5])
def test_every_refit_of_real_training_steps_is_bitwise_and_later_ones_send_only_changes(lr):
    program = functools.partial(TrainingProgram, lr)
    with ProcessWorkerGroup(1, 1, program, framework="torch", timeout_s=300) as group:
        sync = refit.WeightSynchronizer({"bucket_bytes": "256KiB", "timeout_s": 60, "delta": True}, group)
        ratios = []
        for index in range(4):
            report = sync.sync_weights()
            source, destination = report.source_results[0], report.destination_results[0]
            assert source["report"] == destination["report"], f"refit {index}: the destination differs"
            stats = destination["stats"]
            if index == 0:
                assert stats["delta_tensors"] == 0  # no base yet: everything whole
                continue
            assert stats["delta_tensors"] == stats["tensors"], f"refit {index}"
            assert source["stats"]["delta_tensors"] == stats["delta_tensors"]
            ratios.append(stats["payload_bytes"] / stats["wire_bytes"])
        # Real AdamW steps at lr 1e-5 move ~10-20% of the bf16 elements in the first steps: the
        # wire carries several times fewer bytes than the model, never more.
        assert min(ratios) > 2, ratios


def test_delta_at_one_end_only_is_refused_naming_the_key():
    # The synchronizer gives every worker one configuration; engines made by hand can disagree.
    session = refit.new_session_id()
    with refit.create_checkpoint_engine("nixl", 1 << 20, {"delta": True}, session=session) as source, \
            refit.create_checkpoint_engine("nixl", 1 << 20, {"delta": False}, session=session) as destination:
        metadata = [source.prepare(), destination.prepare()]
        with pytest.raises(refit.ConfigError, match=r"refit_cfg\.nixl\.delta is true on source rank 0 but false"):
            source.init_policy_process_group(0, 1, 1, metadata)
        with pytest.raises(refit.ConfigError, match=r"delta is false on destination rank 0 but true on source rank 0"):
            destination.init_rollout_process_group(0, 1, 1, metadata)


def test_a_destination_may_ask_for_the_whole_model():
    import numpy as np

    from helpers import Pair, config

    rng = np.random.default_rng(0)
    weights = [("w", rng.standard_normal(1 << 16).astype(np.float32)), ("b", np.ones(64, np.float32))]
    pair = Pair(1 << 20, config(delta=True))
    try:
        def refit_once():
            got = {}
            _, stats = pair.refit(weights, lambda batch: got.update((n, np.array(t)) for n, t in batch))
            assert all(np.array_equal(got[n], t) for n, t in weights)
            return stats

        assert refit_once()["delta_tensors"] == 0
        weights[0][1][::97] += 1.0
        assert refit_once()["delta_tensors"] == 2
        pair.destination.request_full_refit()
        pair.connect()  # its next metadata declares no version
        weights[0][1][::89] += 1.0
        assert refit_once()["delta_tensors"] == 0
        weights[0][1][::83] += 1.0
        assert refit_once()["delta_tensors"] == 2
    finally:
        pair.close()
