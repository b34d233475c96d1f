"""refit.megatron_source_layouts and refit.megatron_weights against real Megatron-Core models (megatron-core on the CPU, 4 gloo
ranks, the local layer spec; no Apex or TransformerEngine).

The full HF checkpoint (seeded, one generator per tensor) is split per rank as Megatron's checkpoint
converters do (q/k/v fused per query group, fc1 = [gate; up] per TP rank, the vocabulary padded to a
multiple of 128 x TP, experts in contiguous blocks per EP rank) and loaded with load_state_dict
(strict). The sharded models' logits must equal transformers' on the full checkpoint: the split is
Megatron's layout, not a guess. Forward passes cannot tell which TP rank holds which heads or MLP
columns (any consistent permutation computes the same), so what each rank holds is read from
Megatron's own sharded_state_dict() (each tensor's global offset, as its distributed checkpoints
store it) by refit.megatron_weights, and must be, tensor by tensor and byte for byte, what refit's
layout of that rank says.

Then the ranks of REFIT_CASES refit destinations through refit's engines (UCX over shared memory):
each rank is a source declaring its layout and sending what it holds, read from its parameters at
each send, and every destination (the whole model; a vLLM TP2 pair) must get its slice of the
checkpoint byte for byte, twice (the parameters change in place between refits). Planted bugs (a
rank sends its TP partner's tensors, declares its partner's layout, or sends stale tensors) must
fail the refit or the comparison, as expected: the check can fail.
"""

import datetime
import importlib.util
import json
import os
import re
import socket
import threading
import time
import zlib

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("megatron.core") is None:  # imported only in the ranks (it takes seconds)
    pytest.skip("megatron.core cannot be imported (pip install megatron-core)", allow_module_level=True)

import refit  # noqa: E402

WORLD = 4
# 8 query heads in 4 KV groups (2 for llama). Megatron pads the vocabulary to 384 rows at TP 1 and
# 512 at TP 2 and 4 (vLLM's multiple of 64 would not); at TP 4 rank 3 holds padding rows only.
_COMMON = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 8, "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 64, "torch_dtype": "float32"}
FAMILIES = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "intermediate_size": 128, "tie_word_embeddings": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "intermediate_size": 128, "tie_word_embeddings": False},
    "llama": {"architectures": ["LlamaForCausalLM"], "intermediate_size": 128, "num_key_value_heads": 2,
              "tie_word_embeddings": True},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 128, "moe_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "tie_word_embeddings": False},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "intermediate_size": 32, "num_local_experts": 4,
                "num_experts_per_tok": 2, "tie_word_embeddings": False},
    # Qwen3-MoE with dense MLP layers (0 and 3: one per PP 2 stage, beside a MoE layer) 4x the
    # experts' size: fc1's gate/up boundary differs per layer (a split at one size for every layer
    # names a dense layer's gate rows as up).
    "qwen3_moe_dense": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 128,
                        "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0, 3],
                        "tie_word_embeddings": False},
}
# (family, tp, pp, ep, expert_tp); dp = WORLD / (tp * pp); expert_tp None: both sides' default (tp).
CASES = [
    ("qwen3", 2, 2, 1, None), ("qwen3", 4, 1, 1, None), ("qwen3", 2, 1, 1, None), ("qwen3", 1, 2, 1, None),
    ("qwen2", 2, 2, 1, None),  # q/k/v biases
    ("llama", 2, 2, 1, None),  # tied embeddings: the last stage holds embed_tokens for its output layer
    ("llama", 4, 1, 1, None),  # TP 4 over 2 KV heads: see REFUSED
    ("qwen3_moe", 2, 1, 2, None), ("qwen3_moe", 2, 1, 4, 1), ("qwen3_moe", 2, 2, 2, 1), ("qwen3_moe", 1, 1, 2, 1),
    ("mixtral", 2, 2, 2, 1),
    ("qwen3_moe_dense", 2, 1, 2, None), ("qwen3_moe_dense", 2, 2, 2, 1),  # dense and MoE layers, fc1 per TP rank
]
# What the Megatron ranks hold but no layout can name, which refit must refuse (found by this test).
REFUSED = {
    # 8 query heads, 2 KV heads: Megatron splits its fused linear_qkv ([4 q heads, k, v] per group)
    # into 4 equal row blocks: rank 0 holds q heads 0-2 and no k/v, rank 1 q head 3 and k/v head 0
    # (ranks 2 and 3 likewise), which is no slice of the HF q/k/v tensors.
    ("llama", 4, 1, 1, None): "tp 4 exceeds num_key_value_heads 2",
}
TOKENS = torch.randint(0, _COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))


def _hf_config(family):
    return {"model_type": family, **_COMMON, **FAMILIES[family]}


def _moe_layers(c):
    """Megatron's moe_layer_freq as a list (1: MoE, 0: dense) by transformers' rule for Qwen-MoE
    (Megatron's integer moe_layer_freq N would put the MoE layers at i % N == 0, HF's
    decoder_sparse_step at (i + 1) % N == 0)."""
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers", []))
    return [int(i not in dense and (i + 1) % step == 0) for i in range(c["num_hidden_layers"])]


def _full_weights(config_path):
    """The full HF checkpoint, the same in every process: a generator per tensor name, unit-scale
    activations so that every weight moves the logits."""
    out = {}
    for t in refit.load_model_inventory(config_path).tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
        if len(t.shape) == 1:
            out[t.name] = 1 + 0.2 * torch.randn(t.shape, generator=g)  # norms
        elif t.name.endswith("embed_tokens.weight"):
            out[t.name] = torch.randn(t.shape, generator=g)
        else:
            out[t.name] = torch.randn(t.shape, generator=g) / t.shape[1] ** 0.5
    return out


def _names(family, layer):
    """HF names of a decoder layer's MLP parts (Mixtral: w1 = gate, w3 = up, w2 = down)."""
    p = f"model.layers.{layer}."
    if family == "mixtral":
        w = {"gate": "w1", "up": "w3", "down": "w2"}
        return {"router": p + "block_sparse_moe.gate.weight",
                "expert": lambda e, part: p + f"block_sparse_moe.experts.{e}.{w[part]}.weight"}
    return {"router": p + "mlp.gate.weight", "expert": lambda e, part: p + f"mlp.experts.{e}.{part}_proj.weight",
            "dense": lambda part: p + f"mlp.{part}_proj.weight"}


# ---- HF -> Megatron, one rank's state_dict, as Megatron-LM's checkpoint converters split it ----

def _qkv(full, c, layer, kind):
    """[q heads of group 0; k 0; v 0; q heads of group 1; ...]: Megatron's fused linear_qkv (weight
    or bias)."""
    p, groups = f"model.layers.{layer}.self_attn.", c["num_key_value_heads"]
    q, k, v = (full[f"{p}{n}_proj.{kind}"] for n in "qkv")
    return torch.cat([t.view(groups, -1, *t.shape[1:]) for t in (q, k, v)], dim=1).flatten(0, 1)


def _local_state(model, full, family, c, ps):
    """This rank's state_dict from the full checkpoint: TP, expert-TP and EP ranks from Megatron's
    parallel_state, each layer's global number from Megatron's layer_number."""
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, er = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    padded = -(-c["vocab_size"] // (128 * tp)) * 128 * tp  # Megatron-LM's make-vocab-size-divisible-by 128

    def vocab(name):
        t = torch.zeros(padded, c["hidden_size"])
        t[:c["vocab_size"]] = full[name]
        return t.chunk(tp)[r]

    out = {}
    for key, value in model.state_dict().items():
        if key.endswith("._extra_state"):
            out[key] = value
        elif key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[key] = vocab("lm_head.weight" if key == "output_layer.weight" and "lm_head.weight" in full
                             else "model.embed_tokens.weight")
        elif key == "decoder.final_layernorm.weight":
            out[key] = full["model.norm.weight"]
        else:
            j, rest = key.removeprefix("decoder.layers.").split(".", 1)
            layer = model.decoder.layers[int(j)].layer_number - 1  # Megatron's global layer number
            p, n = f"model.layers.{layer}.", _names(family, layer)
            if rest.startswith("mlp.experts.local_experts."):
                i, part = rest.removeprefix("mlp.experts.local_experts.").split(".", 1)
                e = ep_rank * len(model.decoder.layers[int(j)].mlp.experts.local_experts) + int(i)
                gate, up, down = (full[n["expert"](e, x)] for x in ("gate", "up", "down"))
                out[key] = (torch.cat([gate.chunk(etp)[er], up.chunk(etp)[er]]) if part == "linear_fc1.weight"
                            else down.chunk(etp, 1)[er])
                continue
            out[key] = {
                "input_layernorm.weight": lambda: full[p + "input_layernorm.weight"],
                "pre_mlp_layernorm.weight": lambda: full[p + "post_attention_layernorm.weight"],
                "self_attention.q_layernorm.weight": lambda: full[p + "self_attn.q_norm.weight"],
                "self_attention.k_layernorm.weight": lambda: full[p + "self_attn.k_norm.weight"],
                "self_attention.linear_qkv.weight": lambda: _qkv(full, c, layer, "weight").chunk(tp)[r],
                "self_attention.linear_qkv.bias": lambda: _qkv(full, c, layer, "bias").chunk(tp)[r],
                "self_attention.linear_proj.weight": lambda: full[p + "self_attn.o_proj.weight"].chunk(tp, 1)[r],
                "mlp.linear_fc1.weight": lambda: torch.cat([full[n["dense"]("gate")].chunk(tp)[r],
                                                            full[n["dense"]("up")].chunk(tp)[r]]),
                "mlp.linear_fc2.weight": lambda: full[n["dense"]("down")].chunk(tp, 1)[r],
                "mlp.router.weight": lambda: full[n["router"]],
            }[rest]()
    return out


def _compare(held, full, inventory, layout):
    """Where the rank's holdings (refit.megatron_weights: names from Megatron's own global offsets)
    and refit's layout of it differ, one line each. The checkpoint is random, so equal bytes also
    mean the same place in the tensor."""
    problems = []
    for t in inventory.tensors:
        want = layout.request_for(t.name)
        if t.name not in held:
            if want != ("drop",):
                problems.append(f"{t.name}: Megatron holds nothing, refit says {want}")
            continue
        tensor = held.pop(t.name)
        if want == ("drop",):
            problems.append(f"{t.name}: Megatron holds {list(tensor.shape)}, refit says drop")
            continue
        expected = full[t.name] if want == ("whole",) else full[t.name].narrow(*want[1:])
        if tensor.shape != expected.shape or not torch.equal(tensor, expected):
            problems.append(f"{t.name}: Megatron holds {list(tensor.shape)} that is not refit's {want} of the checkpoint")
    problems += [f"{name}: held by Megatron, not in refit's inventory" for name in held]
    return problems


# ---- refit from the ranks: Megatron's shards as sources -------------------------------------------

# dense TP x PP; tied embeddings (both stages hold embed_tokens); MoE with EP and replicas (dp 2);
# MoE with EP, PP and whole experts (expert TP 1); dense and MoE layers of different MLP sizes.
REFIT_CASES = [("qwen3", 2, 2, 1, None), ("llama", 2, 2, 1, None), ("qwen3_moe", 2, 1, 2, None),
               ("mixtral", 2, 2, 2, 1), ("qwen3_moe_dense", 2, 1, 2, None), ("qwen3_moe_dense", 2, 2, 2, 1)]
# Destination d runs in rank d's process: 0 takes the whole model, 1 and 2 are a vLLM TP2 pair.
DESTINATIONS = 3
REFIT_CONFIG = {"timeout_s": 30, "backend_init_params": {"tls": "posix,sysv,cma,self"}}
BUCKET = 1 << 16  # below a rank's holdings: several buckets per refit, tensors split over them
# Planted bugs, each in a group of its own on BUG_CASE, one refit; what every failure must match.
BUG_CASE = REFIT_CASES[0]
BUGS = {
    # Rank 0 sends rank 1's decoder-layer tensors (same shapes) as its own: nothing in the transfer
    # can see it, the comparisons of the destinations that read rank 0's slices must.
    "sends_partner_tensors":
        r"destination [01], refit 0: model\.layers\.[01]\.\S+: received .*, not the checkpoint's bytes",
    # Rank 0 declares layouts[1]: rank 0's slices have no holder, and every engine computes the plan.
    "declares_partner_layout":
        r"rank \d: init_\w+: LayoutError: .* but no source holds .*|destination \d: 0 of 1 refits",
    # Rank 2 (stage 1) sends at the second refit what it held before the parameters changed.
    "sends_stale_tensors":
        r"destination \d, refit 1: (model\.layers\.[23]\.\S+|model\.norm\.weight|lm_head\.weight): received .*",
}


def _destination_layouts(config_path, c):
    moe = "num_experts" in c or "num_local_experts" in c  # vLLM's EP: experts whole, by EP rank
    return [None] + [refit.destination_layout(config_path, tp_size=2, tp_rank=r, ep_size=2 if moe else 1,
                                              ep_rank=r if moe else 0, shard_experts=moe, shard_dense=True,
                                              destination_rank=1 + r) for r in range(2)]


def _sends(model, config_path):
    """(name, tensor) of what the rank holds, read now (refit.megatron_weights): views of its
    parameters, except q/k/v of a rank with several query groups, whose rows in the fused
    linear_qkv are not one block (the rows are gathered); and which tensors are such copies."""
    held = refit.megatron_weights(model, config_path)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = sorted(n for n, t in held.items() if t.untyped_storage().data_ptr() not in storages)
    return list(held.items()), copies


def _refit_group(rank, config_path, holds, destination_layouts, rounds):
    """One group (sources: the WORLD ranks; destination d in rank d's process); rounds is a list
    of (sends, expected(name, layout) -> tensor or None), one per refit. Returns this process's
    errors and its destination's problems per refit; every rank stops at the first failed refit."""
    import torch.distributed as dist

    session = [refit.new_session_id() if rank == 0 else None]
    dist.broadcast_object_list(session, src=0)
    layout = destination_layouts[rank] if rank < DESTINATIONS else None
    out = {"errors": [], "refits": []}
    engines = []
    try:
        source = refit.CheckpointEngine(BUCKET, REFIT_CONFIG, session=session[0], holds=holds, model=config_path)
        engines.append(source)
        destination = None
        if rank < DESTINATIONS:
            destination = refit.CheckpointEngine(BUCKET, REFIT_CONFIG, session=session[0], model=config_path,
                                                 layout=layout, framework="torch")
            engines.append(destination)
        mine = [source.prepare(), destination.prepare() if destination else None]
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, mine)
        metadata = [m[0] for m in everyone] + [everyone[d][1] for d in range(DESTINATIONS)]
        for engine, init in ((source, "init_policy_process_group"), (destination, "init_rollout_process_group")):
            try:
                if engine:
                    getattr(engine, init)(rank, WORLD, DESTINATIONS, metadata)
            except refit.RefitError as e:
                out["errors"].append(f"{init}: {type(e).__name__}: {e}")
        for sends, expected in rounds:
            if not _all_ok(out):
                break
            sends = sends()  # after the previous refit everywhere: the parameters of this one
            errors = []
            sender = threading.Thread(target=lambda: _send(source, sends, errors), daemon=True)
            sender.start()
            if destination:
                try:
                    out["refits"].append(_receive(destination, layout, expected))
                except refit.RefitError as e:
                    errors.append(f"receive: {type(e).__name__}: {e}")
            sender.join(2 * REFIT_CONFIG["timeout_s"])
            if sender.is_alive():
                errors.append("send_weights did not return")
            out["errors"] += errors
    finally:
        for e in engines:
            e.finalize()
            e.close()
    return out


def _all_ok(out):
    """Whether no rank has an error yet (a collective: every rank calls it at the same points)."""
    import torch.distributed as dist

    everyone = [None] * WORLD
    dist.all_gather_object(everyone, not out["errors"])
    return all(everyone)


def _send(source, sends, errors):
    try:
        source.send_weights(sends)
    except Exception as e:  # noqa: BLE001 (reported with the destinations' side)
        errors.append(f"send: {type(e).__name__}: {e}")


def _receive(destination, layout, expected):
    """One refit at a destination, each tensor compared as it arrives (views live for one batch)."""
    got, problems = set(), []
    for batch in destination.receive_weight_batches():
        for name, tensor in batch:
            want = expected(name, layout)
            if name in got or want is None:
                problems.append(f"{name}: received twice or not asked for")
            elif tensor.dtype != want.dtype or tensor.shape != want.shape or not torch.equal(tensor, want):
                problems.append(f"{name}: received {tensor.dtype} {tuple(tensor.shape)}, not the checkpoint's bytes")
            got.add(name)
    return {"received": sorted(got), "problems": problems}


def _expected(full, bumps):
    """What a destination must get of each tensor: its slice of the checkpoint, plus 1 `bumps`
    times (as the parameters were: x + 2 is not always (x + 1) + 1)."""
    def expected(name, layout):
        request = ("whole",) if layout is None else layout.request_for(name)
        if request == ("drop",):
            return None
        t = full[name]
        for _ in range(bumps):
            t = t + 1
        return t if request == ("whole",) else t.narrow(*request[1:])
    return expected


def _refit_case(model, case, c, config_path, layouts, rank, full):
    """Refits from this rank (a collective of the WORLD ranks): the case's group, and on BUG_CASE
    one group per planted bug. Every parameter is 1 more at each refit but the first."""
    import torch.distributed as dist

    destinations = _destination_layouts(config_path, c)
    sends = lambda: _sends(model, config_path)[0]  # noqa: E731

    def bumped(what=sends):  # every parameter of every rank changes in place, then `what` is sent
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        return what()

    inventory = refit.load_model_inventory(config_path)
    result = {"copies": _sends(model, config_path)[1],
              "wanted": sorted(t.name for t in inventory.tensors if rank < DESTINATIONS and
                               _expected(full, 0)(t.name, destinations[rank]) is not None),
              "refit": _refit_group(rank, config_path, layouts[rank], destinations,
                                    [(sends, _expected(full, 0)), (bumped, _expected(full, 1))])}
    if case != BUG_CASE:
        return result
    partner = [None] * WORLD
    dist.all_gather_object(partner, [(n, t.detach()) for n, t in sends()] if rank == 1 else None)
    partner = dict(partner[1])
    stale = [(n, t.detach().clone()) for n, t in sends()]
    result["bugs"] = {
        "sends_partner_tensors": _refit_group(
            rank, config_path, layouts[rank], destinations,
            [(lambda: [(n, partner[n] if rank == 0 and n.startswith("model.layers.") else t) for n, t in sends()],
              _expected(full, 1))]),
        "declares_partner_layout": _refit_group(rank, config_path, layouts[1 if rank == 0 else rank], destinations,
                                                [(sends, _expected(full, 1))]),
        "sends_stale_tensors": _refit_group(
            rank, config_path, layouts[rank], destinations,
            [(sends, _expected(full, 1)),
             (lambda: bumped(lambda: stale if rank == 2 else sends()), _expected(full, 2))]),
    }
    return result


# ---- the ranks ----------------------------------------------------------------------------------

def _run_case(root, case, rank):
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    family, tp, pp, ep, etp = case
    config_path = os.path.join(root, family, "config.json")
    c = _hf_config(family)
    experts = c.get("num_experts", c.get("num_local_experts"))
    # Dense layers among the MoE ones: a list (Megatron then keys each layer's tensors by its
    # global number instead of stacking the layers); all MoE: Megatron's default 1.
    pattern = _moe_layers(c) if experts and c["model_type"] == "qwen3_moe" else []
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                 distributed_timeout_minutes=5)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)  # no CUDA RNG: a no-op tracker
    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=c["intermediate_size"] if family == "mixtral"
               else c["moe_intermediate_size"], moe_router_topk=c["num_experts_per_tok"],
               moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
               moe_layer_freq=pattern if 0 in pattern else 1) if experts else {}
    config = TransformerConfig(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_key_value_heads"], kv_channels=c["head_dim"], ffn_hidden_size=c["intermediate_size"],
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=c["rms_norm_eps"],
        add_bias_linear=False, add_qkv_bias=family == "qwen2", qk_layernorm=family.startswith("qwen3"),
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, **moe)  # the unfused paths: plain PyTorch on the CPU
    if 0 in pattern:  # a layer spec per layer, dense or MoE
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    padded = -(-c["vocab_size"] // (128 * tp)) * 128 * tp
    model = GPTModel(config, spec, vocab_size=padded, max_sequence_length=c["max_position_embeddings"],
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=c["tie_word_embeddings"], position_embedding_type="rope",
                     rotary_base=int(c["rope_theta"])).eval()
    full = _full_weights(config_path)
    model.load_state_dict(_local_state(model, full, family, c, ps), strict=True)

    # One forward pass, the pipeline by hand: stage s sends its hidden states to stage s + 1.
    b, s = TOKENS.shape
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, b, c["hidden_size"])
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(TOKENS, torch.arange(s).expand(b, s), torch.ones(s, s).triu(1).bool()[None, None])
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            logits = None
        else:  # each TP rank has its vocabulary rows' logits
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out, group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)[..., :c["vocab_size"]]

    try:
        layouts = refit.megatron_source_layouts(config_path, tp=tp, pp=pp, dp=WORLD // (tp * pp), ep=ep,
                                                expert_tp=etp)
    except refit.LayoutError as e:  # what refit cannot describe it must refuse (REFUSED)
        return {"logits": logits, "problems": [], "refused": str(e)}
    problems = _compare(refit.megatron_weights(model, config_path), full, refit.load_model_inventory(config_path),
                        layouts[rank])
    result = {"logits": logits, "problems": problems, "refused": None}
    if case in REFIT_CASES:  # last: it changes the parameters
        result.update(_refit_case(model, case, c, config_path, layouts, rank, full))
    return result


def _rank(rank, port, root):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # megatron warns at import that Apex and TransformerEngine are missing
    # Megatron moves RoPE's frequencies and the tied output layer's weight to CUDA unconditionally.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None  # megatron-core 0.16.1 reads it unset without TransformerEngine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=5))
    try:
        results = {case: _run_case(root, case, rank) for case in CASES}
        torch.save(results, os.path.join(root, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """Every case on 4 ranks in one spawn (importing megatron.core takes seconds), and transformers'
    logits of each family's full checkpoint."""
    import torch.multiprocessing as mp

    root = str(tmp_path_factory.mktemp("megatron"))
    for family in FAMILIES:
        os.makedirs(os.path.join(root, family))
        with open(os.path.join(root, family, "config.json"), "w") as f:
            json.dump(_hf_config(family), f)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # 4 ranks on 2 cores: a thread each is seconds faster
        context = mp.start_processes(_rank, args=(_free_port(), root), nprocs=WORLD, join=False,
                                     start_method="spawn")
    reference = {family: _hf_logits(os.path.join(root, family)) for family in FAMILIES}  # while the ranks start
    deadline = time.monotonic() + 600
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail("the Megatron ranks did not finish in 600 s")
    ranks = [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    return reference, ranks


def _hf_logits(path):
    import transformers
    from safetensors.torch import save_file

    save_file(_full_weights(os.path.join(path, "config.json")), os.path.join(path, "model.safetensors"))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.values()), info  # transformers took every tensor of refit's inventory
    with torch.no_grad():
        return model(TOKENS).logits


def _ids(case):
    return "{}-tp{}-pp{}-ep{}-etp{}".format(*case)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_megatron_split_computes_the_model(megatron_runs, case):
    """The split is Megatron's: the ranks' logits are transformers' on the full checkpoint."""
    reference, ranks = megatron_runs
    family, _, pp, _, _ = case
    last_stage = [r for r in range(WORLD) if r // (WORLD // pp) == pp - 1]  # rank = tp_rank + tp * (dp + dp * pp)
    assert [r for r in range(WORLD) if ranks[r][case]["logits"] is not None] == last_stage
    for r in last_stage:
        torch.testing.assert_close(ranks[r][case]["logits"], reference[family], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"rank {r}: Megatron's logits are not transformers': {m}")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_megatron_ranks_hold_what_refit_says(megatron_runs, case):
    _, ranks = megatron_runs
    for r in range(WORLD):
        if case in REFUSED:
            assert ranks[r][case]["refused"] and REFUSED[case] in ranks[r][case]["refused"], ranks[r][case]
            continue
        assert ranks[r][case]["refused"] is None, ranks[r][case]["refused"]
        assert not ranks[r][case]["problems"], f"rank {r}:\n" + "\n".join(ranks[r][case]["problems"])


def _failures(groups, wanted, refits):
    """Everything wrong with one group's refits, from every rank's report: errors, and at each
    destination a refit missing, or a tensor that differs or did not arrive."""
    out = [f"rank {r}: {e}" for r, g in enumerate(groups) for e in g["errors"]]
    for d in range(DESTINATIONS):
        got = groups[d]["refits"]
        if len(got) != refits:
            out.append(f"destination {d}: {len(got)} of {refits} refits")
        for i, x in enumerate(got):
            out += [f"destination {d}, refit {i}: {p}" for p in x["problems"]]
            missing = sorted(set(wanted[d]) - set(x["received"]))
            out += [f"destination {d}, refit {i}: {n} did not arrive" for n in missing]
    return out


@pytest.mark.parametrize("case", REFIT_CASES, ids=_ids)
def test_megatron_ranks_refit_destinations_bitwise(megatron_runs, case):
    """Real shards through refit's engines: each destination gets, tensor by tensor, its slice of
    the checkpoint, and at the second refit the parameters' new values."""
    _, ranks = megatron_runs
    family, tp = case[:2]
    several_groups = _hf_config(family)["num_key_value_heads"] > tp
    for r in range(WORLD):  # what the ranks send is their parameters' memory, but gathered q/k/v rows
        copies = ranks[r][case]["copies"]
        assert all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in copies), copies
        assert bool(copies) == several_groups, copies
    wanted = [ranks[d][case]["wanted"] for d in range(DESTINATIONS)]
    failures = _failures([ranks[r][case]["refit"] for r in range(WORLD)], wanted, 2)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bugs_fail_the_refit_or_the_comparison(megatron_runs, bug):
    """The check above can fail: each bug fails it, and only as expected."""
    _, ranks = megatron_runs
    wanted = [ranks[d][BUG_CASE]["wanted"] for d in range(DESTINATIONS)]
    failures = _failures([ranks[r][BUG_CASE]["bugs"][bug] for r in range(WORLD)], wanted,
                         2 if bug == "sends_stale_tensors" else 1)
    assert failures, f"{bug}: the refit succeeded and every destination got the checkpoint"
    unexpected = [f for f in failures if not re.fullmatch(BUGS[bug], f)]
    assert not unexpected, "\n".join(unexpected)
