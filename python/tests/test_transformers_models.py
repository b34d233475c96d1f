"""Real transformers models (built from configs here, nothing downloaded) on both ends of a refit,
in real processes over UCX: a source sends its model's state_dict() in checkpoint format
(refit.checkpoint_weights), a destination loads it into its own model with refit.ParameterLoader,
and every tensor of the destination's state_dict() equals the source's bitwise. refit's model
inventory of each saved config.json matches the checkpoint transformers writes."""

from __future__ import annotations

import functools
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import refit  # noqa: E402
from refit.multiprocessing_group import ProcessWorkerGroup  # noqa: E402

from hf_models import FAMILIES, make_checkpoint  # noqa: E402


def _safetensors_table(path: str) -> dict:
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: (info["dtype"], tuple(info["shape"])) for name, info in header.items() if name != "__metadata__"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_inventory_of_a_saved_config_is_the_checkpoint_transformers_writes(family, tmp_path):
    path = make_checkpoint(family, "bfloat16", 1, str(tmp_path / family))
    table = _safetensors_table(path)
    inventory = refit.load_model_inventory(os.path.join(path, "config.json"))
    assert {t.name: tuple(t.shape) for t in inventory.tensors} == {n: s for n, (_, s) in table.items()}
    assert {t.dtype for t in inventory.tensors} == {"bfloat16"}
    # What a source sends of the live model is that checkpoint (fused experts split as views).
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    sent = dict(refit.checkpoint_weights(model.state_dict()))
    if FAMILIES[family][1].get("tie_word_embeddings"):
        assert sent.pop("lm_head.weight").data_ptr() == sent["model.embed_tokens.weight"].data_ptr()
    assert {n: tuple(t.shape) for n, t in sent.items()} == {n: s for n, (_, s) in table.items()}


class ModelProgram:
    """A source sends checkpoint ``seeds[index]``'s state_dict(); a destination loads into its own
    model (another seed) and reports the XXH3 of every tensor of its state_dict()."""

    def __init__(self, family: str, dtype: str, root: str, role: str, rank: int):
        self.family, self.dtype, self.root, self.role = family, getattr(torch, dtype), root, role
        self.model = self._load(0 if role == "rollout" else 1)
        self._loader = None

    def _load(self, seed: int):
        path = os.path.join(self.root, f"seed{seed}")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)

    def stage(self, index: int) -> None:
        if self.role == "policy":
            self.model = self._load(1 + index % 2)

    def weights(self, index: int):
        return self.model.state_dict()

    def loader(self, index: int):
        # state_dict() names a tied lm_head.weight and its embedding both: the same memory, written twice.
        if self._loader is None:
            self._loader = refit.ParameterLoader(self.model.state_dict())
        return self._loader

    def report(self, index: int):
        return {n: refit.xxh3_64(t.view(torch.uint8) if t.dtype == torch.bfloat16 else t)
                for n, t in self.model.state_dict().items()}


@pytest.mark.parametrize("family,dtype", [("llama-tied", "bfloat16"), ("llama", "float32"), ("qwen2", "bfloat16"),
                                          ("qwen3", "float32")])
def test_a_state_dict_refits_bitwise_into_another_transformers_model(family, dtype, tmp_path):
    for seed in range(3):
        make_checkpoint(family, dtype, seed, str(tmp_path / f"seed{seed}"))
    program = functools.partial(ModelProgram, family, dtype, str(tmp_path))
    with ProcessWorkerGroup(1, 1, program, framework="torch", timeout_s=300) as group:
        sync = refit.WeightSynchronizer({"bucket_bytes": "128KiB", "timeout_s": 60}, group)
        for index in range(3):
            report = sync.sync_weights()
            sent, received = report.source_results[0]["report"], report.destination_results[0]["report"]
            assert sent == received, f"refit {index}"
        assert len(set(map(str, received.values()))) > 1
