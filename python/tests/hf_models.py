"""Tiny checkpoints made here from transformers configs (nothing is downloaded), and the policy
program that sends one: a real transformers model's state_dict(), in a policy process."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

# vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, ...: 256 / 4 heads = 64.
_COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)

FAMILIES = {
    # name: (config class, extra config keys)
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),  # q/k/v biases
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 64}),  # q/k norms
    "qwen3-moe": ("Qwen3MoeConfig", {"tie_word_embeddings": False, "head_dim": 64, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                     "decoder_sparse_step": 1, "mlp_only_layers": []}),
}


def make_checkpoint(family: str, dtype: str, seed: int, path: str) -> str:
    """Saves a randomly initialised model of ``family`` (safetensors + config.json) to ``path``.
    Weights are scaled up so that a refit to another seed changes the greedy tokens."""
    import torch
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**_COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


def _save_like(base: str, tensors: dict, path: str) -> str:
    """``tensors`` as the checkpoint of ``base``'s other files (config.json ...), saved to ``path``."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    for f in os.listdir(base):
        if f != "model.safetensors":
            shutil.copy(os.path.join(base, f), path)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def mix_checkpoint(base: str, other: str, names: List[str], path: str) -> str:
    """``base`` with the tensors ``names`` taken from ``other``, saved to ``path``."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(base, "model.safetensors"))
    donor = load_file(os.path.join(other, "model.safetensors"))
    for name in names:
        tensors[name] = donor[name]
    return _save_like(base, tensors, path)


def nudge_checkpoint(base: str, share: float, seed: int, path: str) -> str:
    """``base`` after a simulated optimizer step: ``share`` of every floating tensor's elements
    move by one unit in the last place (their bits as an integer, +1 or -1), saved to ``path``."""
    import torch
    from safetensors.torch import load_file

    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(os.path.join(base, "model.safetensors"))
    for name, t in tensors.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        bits = t.view(integer[t.element_size()]).flatten()
        n = max(1, int(share * bits.numel()))
        where = torch.randperm(bits.numel(), generator=generator)[:n]
        step = torch.randint(0, 2, (n,), generator=generator, dtype=bits.dtype) * 2 - 1
        bits[where] += step
    return _save_like(base, tensors, path)


class CheckpointPolicy:
    """A policy program: refit ``index`` sends the state_dict() of a transformers model loaded from
    ``plan[index]`` (a checkpoint folder), optionally only some names, or edited by ``edit``, as
    a dict or (``stream``) a generator."""

    def __init__(self, plan: Dict[int, dict]):
        self.plan = plan
        self._weights: Dict[str, object] = {}

    def stage(self, index: int) -> None:
        import torch
        import transformers

        step = self.plan[index]
        model = transformers.AutoModelForCausalLM.from_pretrained(step["path"], dtype=getattr(torch, step["dtype"]))
        import refit

        weights = dict(refit.checkpoint_weights(model.state_dict()))
        if "only" in step:
            weights = {n: weights[n] for n in step["only"]}
        for name, change in step.get("edit", {}).items():
            weights = _edit(weights, name, change)
        self._weights = weights
        self._stream = step.get("stream", False)

    def weights(self, index: int):
        # A generator: nothing can be checked before it is sent (EngineWorker.weight_specs is None).
        return iter(self._weights.items()) if self._stream else self._weights

    def report(self, index: int) -> Tuple[int, int]:
        return len(self._weights), sum(t.numel() * t.element_size() for t in self._weights.values())


def _edit(weights: Dict[str, object], name: str, change: str) -> Dict[str, object]:
    import torch

    out = dict(weights)
    if change == "rename":
        out[name + ".typo"] = out.pop(name)
    elif change == "drop":
        out.pop(name)
    elif change == "bfloat16" or change == "float16":
        out[name] = out[name].to(getattr(torch, change))
    elif change == "transpose":
        out[name] = out[name].t().contiguous()
    elif change == "meta":
        out[name] = torch.empty_like(out[name], device="meta")
    else:
        raise ValueError(change)
    return out


def checkpoint_policy(plan: Dict[int, dict], role: str, rank: int) -> CheckpointPolicy:
    """The program factory of a policy group (functools.partial(checkpoint_policy, plan))."""
    return CheckpointPolicy(plan)
