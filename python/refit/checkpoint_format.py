"""A transformers model's weights in checkpoint format: the names and shapes its safetensors files
have, which is what inference engines load (vLLM's load_weights, refit's model inventories).

transformers 5 keeps a MoE layer's experts fused in memory (``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]) and splits them back only when it saves.
``checkpoint_weights`` does that split as views (each expert's rows are contiguous: no copy), so
``send_weights(checkpoint_weights(model.state_dict()))`` sends what the checkpoint would hold::

    model.layers.0.mlp.experts.gate_up_proj [E, 2I, H] -> experts.{e}.gate_proj.weight [I, H]
                                                        + experts.{e}.up_proj.weight   [I, H]
    model.layers.0.mlp.experts.down_proj    [E, H, I]  -> experts.{e}.down_proj.weight [H, I]

Every other tensor passes unchanged.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Tuple, Union

Weights = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


def checkpoint_weights(weights: Weights) -> Iterator[Tuple[str, Any]]:
    """(name, tensor) pairs in checkpoint format from a state dict or pairs (see the module)."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    for name, tensor in items:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf == "gate_up_proj" and tensor.dim() == 3:
            if tensor.shape[1] % 2:
                raise ValueError(f"tensor '{name}' {list(tensor.shape)}: a fused gate/up projection needs an even "
                                 f"dimension 1 (gate rows, then up rows)")
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:]
        elif prefix.endswith(".experts") and leaf == "down_proj" and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
