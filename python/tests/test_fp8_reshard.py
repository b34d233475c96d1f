"""FP8 weights resharded with their block scales, with real torch float8 tensors.

A Qwen3-MoE-shaped model is quantized as DeepSeek-V3's and Qwen3's FP8 checkpoints are (128 x 128
blocks, ``weight_scale_inv`` = amax / 448). Two Megatron TP ranks hold their shards of every weight
and of its scales; two vLLM TP destinations each receive their slices from both, over UCX. Each
must hold exactly the full checkpoint's slices, scales included, and dequantize to the full
checkpoint's values.
"""
import json
import threading

import pytest

import refit

torch = pytest.importorskip("torch")

# Every dimension TP 2 splits is a multiple of 2 x 128.
CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1000,
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
BLOCK = 128


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def quantize(weight):
    """DeepSeek's per-block cast: q = e4m3(w * 448 / amax), scale_inv = amax / 448 per 128 x 128 block."""
    rows, cols = weight.shape
    padded_rows, padded_cols = -(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK
    padded = torch.zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded_rows // BLOCK, BLOCK, padded_cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    q = (blocks * (448.0 / amax)).view(padded_rows, padded_cols)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), (amax / 448.0).view(padded_rows // BLOCK, padded_cols // BLOCK).contiguous()


def dequantize(q, scale_inv):
    rows, cols = q.shape
    scales = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * scales


def fp8_checkpoint(inventory):
    generator = torch.Generator().manual_seed(11)
    out = {}
    for t in inventory.tensors:
        if t.name in out:
            continue  # a scale, made with its weight
        values = torch.randn(t.shape, generator=generator)
        if t.dtype == "float8_e4m3fn":
            out[t.name], out[t.name + "_scale_inv"] = quantize(values)
        else:
            out[t.name] = values.to(torch.bfloat16)
    return out


def part(tensor, request):
    """What a layout's request names of a full tensor."""
    if request[0] == "whole":
        return tensor
    _, dim, start, length = request
    return tensor.narrow(dim, start, length).contiguous()


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def refit_tp2(model_path, full, holds, needs, on_batch):
    """Two Megatron TP ranks (holds) send their shards of `full` to two vLLM TP destinations (needs)
    over UCX; on_batch(rank, batch) gets each destination's received batches."""
    inventory = refit.fp8_block_inventory(refit.load_model_inventory(model_path))
    session = refit.new_session_id()
    config = {"timeout_s": 30, "backend_init_params": {"tls": "posix,sysv,cma,self"}}
    sources = [refit.CheckpointEngine(1 << 16, config, session=session, holds=h, model=inventory) for h in holds]
    destinations = [refit.CheckpointEngine(1 << 16, config, session=session, layout=n, model=inventory)
                    for n in needs]
    metadata = [e.prepare() for e in sources + destinations]
    for rank, e in enumerate(sources):
        e.init_policy_process_group(rank, 2, 2, metadata)
    for rank, e in enumerate(destinations):
        e.init_rollout_process_group(rank, 2, 2, metadata)

    errors = []

    def send(rank):
        try:
            shards = [(name, part(t, holds[rank].request_for(name))) for name, t in full.items()
                      if holds[rank].request_for(name)[0] != "drop"]
            sources[rank].send_weights(shards)
        except Exception as e:  # noqa: BLE001 (asserted below)
            errors.append(e)

    def receive(rank):
        try:
            for batch in destinations[rank].receive_weight_batches(framework="torch"):
                on_batch(rank, batch)
        except Exception as e:  # noqa: BLE001 (asserted below)
            errors.append(e)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(2)]
    threads += [threading.Thread(target=receive, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for e in sources + destinations:
        e.finalize()


def test_fp8_shards_reach_tensor_parallel_destinations_with_their_scale_blocks(model_path):
    inventory = refit.fp8_block_inventory(refit.load_model_inventory(model_path))
    full = fp8_checkpoint(inventory)
    assert set(full) == {t.name for t in inventory.tensors}
    holds = refit.megatron_source_layouts(model_path, tp=2, fp8=True)
    needs = [refit.destination_layout(model_path, tp_size=2, tp_rank=r, shard_dense=True, shard_experts=True,
                                      fp8=True) for r in range(2)]
    got = [{}, {}]

    def keep(rank, batch):
        for name, tensor in batch:
            got[rank][name] = tensor.clone()

    refit_tp2(model_path, full, holds, needs, keep)
    sliced_scales = 0
    for rank, need in enumerate(needs):
        kept = {name for name in full if need.request_for(name)[0] != "drop"}
        assert set(got[rank]) == kept
        for name in kept:
            expected = part(full[name], need.request_for(name))
            assert same_bytes(got[rank][name], expected), f"destination {rank}: {name}"
            if name.endswith("_scale_inv"):
                weight = name[: -len("_scale_inv")]
                sliced_scales += need.request_for(name)[0] == "narrow"
                # The scales it got are the ones its weight slice needs: it dequantizes to the full values.
                assert torch.equal(dequantize(got[rank][weight], got[rank][name]),
                                   part(dequantize(full[weight], full[name]), need.request_for(weight)))
    assert sliced_scales > 20


def test_fp8_experts_land_in_vllms_fused_fp8_storage_with_their_scales(model_path):
    """The sharded-expert path the reference refuses for FP8 models (V40): each TP destination's
    refit.ExpertLoader writes the received FP8 expert slices into vLLM's fused w13/w2 storage and
    their block scales into w13_weight_scale_inv / w2_weight_scale_inv, bitwise the checkpoint's."""
    inventory = refit.fp8_block_inventory(refit.load_model_inventory(model_path))
    full = fp8_checkpoint(inventory)
    holds = refit.megatron_source_layouts(model_path, tp=2, fp8=True)
    needs = [refit.destination_layout(model_path, tp_size=2, tp_rank=r, shard_dense=True, shard_experts=True,
                                      fp8=True) for r in range(2)]
    experts, hidden, inter = CONFIG["num_experts"], CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    s = inter // 2  # one TP rank's rows: one 128-row block
    stores, loaders, handed_back = [], [], [[], []]
    for rank in range(2):
        store = {}
        for layer in range(CONFIG["num_hidden_layers"]):
            prefix = f"model.layers.{layer}.mlp.experts.routed_experts."
            store[prefix + "w13_weight"] = torch.zeros(experts, 2 * s, hidden, dtype=torch.float8_e4m3fn)
            store[prefix + "w2_weight"] = torch.zeros(experts, hidden, s, dtype=torch.float8_e4m3fn)
            store[prefix + "w13_weight_scale_inv"] = torch.full((experts, 2 * s // BLOCK, hidden // BLOCK), -1.0)
            store[prefix + "w2_weight_scale_inv"] = torch.full((experts, hidden // BLOCK, s // BLOCK), -1.0)
        stores.append(store)
        loaders.append(refit.ExpertLoader(inventory, [
            {"name": name, "tensor": tensor, "tp_rank": rank, "tp_size": 2,
             **({"quant_method": "fp8"} if tensor.dtype == torch.float8_e4m3fn else {})}
            for name, tensor in store.items()], destination_rank=rank))

    def load(rank, batch):
        handed_back[rank] += [name for name, _ in loaders[rank].load(batch)["remaining"]]

    refit_tp2(model_path, full, holds, needs, load)
    for rank in range(2):
        assert not any(".mlp.experts." in name for name in handed_back[rank])
        rows = slice(rank * s, (rank + 1) * s)
        block = slice(rank, rank + 1)  # its one block of the experts' I dimension
        for layer in range(CONFIG["num_hidden_layers"]):
            prefix = f"model.layers.{layer}.mlp.experts."
            store = {k.removeprefix(prefix + "routed_experts."): v for k, v in stores[rank].items()
                     if k.startswith(prefix)}
            for e in range(experts):
                w = {p: full[f"{prefix}{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
                sc = {p: full[f"{prefix}{e}.{p}.weight_scale_inv"] for p in w}
                where = f"destination {rank}, layer {layer}, expert {e}"
                assert same_bytes(store["w13_weight"][e, :s], w["gate_proj"][rows]), where
                assert same_bytes(store["w13_weight"][e, s:], w["up_proj"][rows]), where
                assert same_bytes(store["w2_weight"][e], w["down_proj"][:, rows].contiguous()), where
                assert torch.equal(store["w13_weight_scale_inv"][e, :1], sc["gate_proj"][block]), where
                assert torch.equal(store["w13_weight_scale_inv"][e, 1:], sc["up_proj"][block]), where
                assert torch.equal(store["w2_weight_scale_inv"][e], sc["down_proj"][:, block]), where


def test_a_tensor_parallel_size_that_cuts_scale_blocks_is_refused(model_path):
    # TP 4 gives each rank 64 of an expert's 256 rows: half a scale block.
    with pytest.raises(refit.LayoutError, match=r"cuts through scale block 0 \(elements \[0, 128\)\)"):
        refit.destination_layout(model_path, tp_size=4, tp_rank=1, shard_dense=True, shard_experts=True, fp8=True)
    # The same sizes are fine for the bf16 model.
    refit.destination_layout(model_path, tp_size=4, tp_rank=1, shard_dense=True, shard_experts=True)
