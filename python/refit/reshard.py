"""Resharding from where the weights live: a source declares what it holds (its shards) instead of
gathering full tensors, and every destination reads its slices from the sources that have them.

With torch DTensors (FSDP2, tensor parallelism by DeviceMesh placements) nothing is written by
hand: ``holdings_of(model.state_dict())`` reads each tensor's placements, and
``CheckpointEngine.send_weights`` sends each DTensor's local shard::

    holds = refit.holdings_of(model.state_dict())
    engine = refit.CheckpointEngine(bucket, config, holds=holds, model="path/to/config.json", ...)
    ...
    engine.send_weights(model.state_dict().items())      # local shards, no full_tensor()

For Megatron-style training, ``refit.megatron_source_layouts(config_path, tp=, pp=, dp=, ep=)``
gives every rank's holdings and ``refit.megatron_weights(model, config_path)`` what a Megatron-core
rank sends, named as the checkpoint names it; ``refit.plan_transfers`` shows the plan before
anything moves.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Tuple

from . import _refit
from ._refit import Layout


def is_dtensor(value: Any) -> bool:
    """A torch.distributed.tensor.DTensor (duck-typed, so torch is imported only by its users)."""
    return hasattr(value, "placements") and hasattr(value, "device_mesh") and hasattr(value, "to_local")


def _placement(name: str, placement: Any) -> tuple:
    if hasattr(placement, "is_shard") and placement.is_shard():
        return ("shard", int(placement.dim))
    if hasattr(placement, "is_replicate") and placement.is_replicate():
        return ("replicate",)
    raise _refit.LayoutError(
        f"tensor '{name}': placement {placement!r} cannot be refit as is (a Partial tensor must be reduced first)")


def dtensor_request(name: str, tensor: Any) -> tuple:
    """What this rank holds of DTensor ``tensor``: ('whole',) or ('narrow', dim, start, length)."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise _refit.LayoutError(f"tensor '{name}': this rank is not in the tensor's device mesh")
    return _refit.dtensor_request(name, list(tensor.shape), [_placement(name, p) for p in tensor.placements],
                                  list(mesh.mesh.shape), list(coordinate))


def holdings_of(state_dict: Mapping[str, Any]) -> Layout:
    """This rank's holdings (a source layout) from a state dict: a DTensor holds what its
    placements give this rank; any other tensor is held whole. Raises LayoutError for a placement
    refit cannot express (Partial; Shard of two different dims of one tensor)."""
    entries = {}
    for name, value in state_dict.items():
        if is_dtensor(value):
            request = dtensor_request(name, value)
            if request != ("whole",):
                entries[name] = request
    return Layout(entries)


def local_tensors(weights: Iterable[Tuple[str, Any]]) -> Iterator[Tuple[str, Any]]:
    """(name, tensor) pairs with every DTensor replaced by its local shard (no gather)."""
    for item in weights:
        # Anything but a (name, DTensor) pair goes on unchanged: the engine names a malformed item.
        if isinstance(item, tuple) and len(item) == 2 and is_dtensor(item[1]):
            yield item[0], item[1].to_local()
        else:
            yield item


def megatron_weights(model: Any, config_path: str) -> Dict[str, Any]:
    """What this Megatron-core rank holds of a Hugging Face checkpoint, named as the checkpoint
    names it: {name: tensor}, each tensor this rank's part of it, a view of the model's own
    parameters. Read from Megatron's ``sharded_state_dict()`` (each tensor's global offset, as its
    distributed checkpoints store it): the fused ``linear_qkv`` split into q, k and v (the rows of
    a rank that holds several query groups are not one block of them and are gathered into a copy),
    ``linear_fc1`` into gate and up, experts by their global number, the vocabulary without
    Megatron's padding rows. Send it with the holdings of the same rank:

        engine = refit.CheckpointEngine(..., holds=refit.megatron_source_layouts(config, tp=, pp=, ...)[rank],
                                        model=config)
        engine.send_weights(refit.megatron_weights(model, config).items())

    Checked against real megatron-core 0.16.1 ranks (GPT models of the local layer spec: Llama,
    Qwen2, Qwen3, Qwen3-MoE, also with dense layers, Mixtral at TP, PP, EP and expert TP). A
    parameter it cannot name raises LayoutError naming it; call it again after the parameters are
    replaced (it holds views)."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    with open(config_path) as f:
        c = json.load(f)
    # Sizes from the checkpoint's own tensors (refit's inventory), not from the config's
    # conventions: a model's dense and expert MLPs may differ in size.
    shapes = {t.name: tuple(t.shape) for t in _refit.load_model_inventory(config_path).tensors}
    vocab = shapes["model.embed_tokens.weight"][0]
    groups = c.get("num_key_value_heads") or c["num_attention_heads"]
    per_group = c["num_attention_heads"] // groups
    if "model.layers.0.self_attn.k_proj.weight" not in shapes:
        raise _refit.LayoutError(f"{config_path}: no model.layers.0.self_attn.k_proj.weight (multi-latent attention?): "
                                 f"refit names GPT layers of Llama, Qwen2/3, Qwen3-MoE and Mixtral")
    head = shapes["model.layers.0.self_attn.k_proj.weight"][0] // groups
    # Each row of Megatron's fused linear_qkv, [q heads of group 0; k 0; v 0; q heads of group 1; ...]:
    # which of q, k, v it belongs to and its row there.
    fused_part = torch.cat([torch.full((groups, per_group * head), 0), torch.full((groups, head), 1),
                            torch.full((groups, head), 2)], dim=1).flatten()
    fused_row = torch.cat([torch.arange(groups * per_group * head).view(groups, -1),
                           torch.arange(groups * head).view(groups, -1), torch.arange(groups * head).view(groups, -1)],
                          dim=1).flatten()
    mlp = _megatron_mlp_names(c.get("model_type", ""))
    out: Dict[str, Any] = {}

    def put(key: str, name: str, tensor: Any) -> None:
        if name not in shapes:
            raise _refit.LayoutError(f"Megatron parameter '{key}' maps to '{name}', which {config_path} has no tensor "
                                     f"of (model_type '{c.get('model_type')}')")
        if name in out:
            raise _refit.LayoutError(f"Megatron parameters give '{name}' twice (the second from '{key}')")
        out[name] = tensor

    sharded = model.sharded_state_dict()
    apply_factories(sharded)  # fc1 -> its gate and up halves, each at its own global offset
    for sh in nested_values(sharded):
        if not isinstance(sh, ShardedTensor):
            continue  # _extra_state objects
        pre, key, data = sh.prepend_axis_num, sh.key, sh.data
        offset = sh.global_offset[pre:]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            start = min(offset[0], vocab)  # rows past the vocabulary are padding
            put(key, "lm_head.weight" if key == "output_layer.weight" else "model.embed_tokens.weight",
                data[:vocab - start])
            continue
        if key == "decoder.final_layernorm.weight":
            put(key, "model.norm.weight", data)
            continue
        # Layers of one kind are stacked ("decoder.layers.X", the layer the first prepended axis);
        # where they differ (dense and MoE layers: moe_layer_freq a list or above 1) each is keyed
        # by its global number ("decoder.layers.N.X") and only the expert axis is prepended.
        numbered = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
        if numbered:
            layer, rest, prepended = int(numbered[1]), numbered[2], sh.global_offset[:pre]
        else:
            layer, rest, prepended = sh.global_offset[0], key.removeprefix("decoder.layers."), sh.global_offset[1:pre]
        p = f"model.layers.{layer}."
        expert = prepended[0] if rest.startswith("mlp.experts.") else None
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            rows = slice(offset[0], offset[0] + data.shape[0])
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                mine = (fused_part[rows] == i).nonzero().flatten()
                if len(mine):
                    hf = fused_row[rows][mine]
                    if not torch.equal(hf, torch.arange(int(hf[0]), int(hf[0]) + len(hf))):
                        raise _refit.LayoutError(f"Megatron parameter '{key}': this rank's rows of {proj} are not one "
                                                 f"range of it (tp above num_key_value_heads?)")
                    one_block = int(mine[-1]) + 1 - int(mine[0]) == len(mine)
                    put(key, p + f"self_attn.{proj}.{rest.rsplit('.', 1)[1]}",
                        data[int(mine[0]):int(mine[-1]) + 1] if one_block else data[mine])
        elif rest in ("mlp.linear_fc1.weight", "mlp.experts.experts.linear_fc1.weight"):  # [gate; up]
            gate = p + mlp(expert, "gate")
            put(key, gate if gate not in shapes or offset[0] < shapes[gate][0] else p + mlp(expert, "up"), data)
        elif rest in ("mlp.linear_fc2.weight", "mlp.experts.experts.linear_fc2.weight"):
            put(key, p + mlp(expert, "down"), data)
        elif rest == "mlp.router.weight":
            put(key, p + mlp(None, "router"), data)
        elif rest in _MEGATRON_LAYER_NAMES:
            put(key, p + _MEGATRON_LAYER_NAMES[rest], data)
        else:
            raise _refit.LayoutError(f"Megatron parameter '{key}': no checkpoint name for it (refit names GPT "
                                     f"layers of Llama, Qwen2/3, Qwen3-MoE and Mixtral)")
    return out


def _megatron_mlp_names(model_type: str) -> Callable[[Any, str], str]:
    """A decoder layer's MLP names after "model.layers.N.": (expert or None, gate|up|down|router)."""
    if model_type == "mixtral":  # w1 = gate, w3 = up, w2 = down
        w = {"gate": "w1", "up": "w3", "down": "w2"}
        return lambda e, part: ("block_sparse_moe.gate.weight" if part == "router"
                                else f"block_sparse_moe.experts.{e}.{w[part]}.weight")
    return lambda e, part: ("mlp.gate.weight" if part == "router" else f"mlp.{part}_proj.weight" if e is None
                            else f"mlp.experts.{e}.{part}_proj.weight")


_MEGATRON_LAYER_NAMES = {  # a decoder layer's tensors Megatron keeps as they are, after "model.layers.N."
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
