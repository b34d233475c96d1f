"""refit.ExpertLoader: received sharded routed experts copied straight into a destination's fused
expert storage (w13 [E_local, 2*I/tp, H], w2 [E_local, H, I/tp]), as the reference's
VllmShardedExpertRefitMixin does, checked bitwise against the source; malformed input is refused
with an error naming the tensor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import refit
from refit.testing import SyntheticSource

from helpers import TINY_MOE, Pair, config

MiB = 1 << 20
LAYERS = 2  # the first two decoder layers (and what comes before them) are sent
E, H, I = 16, 1024, 256  # refit-tiny-moe: experts, hidden size, moe_intermediate_size


def expert(layer: int, e: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"


def fused(layer: int, which: str) -> str:
    return f"model.layers.{layer}.mlp.experts.routed_experts.{which}_weight"


def make_storage(tp_size: int, tp_rank: int, expert_map):
    local = E if expert_map is None else sum(1 for s in expert_map if s >= 0)
    s = I // tp_size
    storage, arrays = [], {}
    for layer in range(LAYERS):
        for which, shape in (("w13", (local, 2 * s, H)), ("w2", (local, H, s))):
            array = np.full(shape, -7.0, dtype=ml_dtypes.bfloat16)
            arrays[fused(layer, which)] = array
            entry = {"name": fused(layer, which), "tensor": array, "tp_rank": tp_rank, "tp_size": tp_size}
            if expert_map is not None:
                entry.update(use_ep=True, expert_map=list(expert_map))
            storage.append(entry)
    return storage, arrays


def refit_into_storage(layout, storage):
    """One refit of the first LAYERS layers to a destination with `layout`; every batch goes through
    an ExpertLoader over `storage`. Returns the source's tensors, the names handed back, the stats."""
    model = refit.load_model_inventory(TINY_MOE)
    limit = next(i for i, t in enumerate(model.tensors) if t.name.startswith(f"model.layers.{LAYERS}."))
    source = SyntheticSource(TINY_MOE, limit=limit)
    source.stage(1)
    loader = refit.ExpertLoader(model, storage, destination_rank=0)
    pair = Pair(4 * MiB, config(shard_expert_weights=True), layout=layout)
    remaining, experts = [], 0
    try:
        def load(batch):
            nonlocal experts
            result = loader.load(batch)
            remaining.extend(name for name, _ in result["remaining"])
            experts += result["experts"]

        pair.refit(source.weights(1), load=load)
    finally:
        pair.close()
    return dict(source.weights(1)), remaining, experts


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


@pytest.mark.parametrize("tp_size,tp_rank,ep_size,ep_rank", [(2, 1, 1, 0), (1, 0, 2, 1)])
def test_received_experts_land_in_the_fused_storage_bitwise(tp_size, tp_rank, ep_size, ep_rank):
    expert_map = None
    if ep_size > 1:  # linear placement: rank r owns experts [r*E/ep, (r+1)*E/ep)
        per = E // ep_size
        expert_map = [g - ep_rank * per if ep_rank * per <= g < (ep_rank + 1) * per else -1 for g in range(E)]
    # The layers past LAYERS (and what follows them) are not sent: the destination lacks them.
    missing = [f"model.layers.{i}." for i in range(LAYERS, 8)] + ["model.norm.", "lm_head."]
    layout = refit.destination_layout(TINY_MOE, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank,
                                      shard_experts=True, missing_prefixes=missing)
    storage, arrays = make_storage(tp_size, tp_rank, expert_map)
    full, remaining, experts = refit_into_storage(layout, storage)

    owned = [g for g in range(E) if expert_map is None or expert_map[g] >= 0]
    assert experts == LAYERS * len(owned) * 3
    assert remaining == [n for n in full if ".mlp.experts." not in n]  # the rest, in order
    s = I // tp_size
    rows = slice(tp_rank * s, (tp_rank + 1) * s)
    for layer in range(LAYERS):
        w13, w2 = arrays[fused(layer, "w13")], arrays[fused(layer, "w2")]
        for g in owned:
            slot = g if expert_map is None else expert_map[g]
            assert np.array_equal(bits(w13[slot, :s]), bits(full[expert(layer, g, "gate_proj")][rows])), (layer, g)
            assert np.array_equal(bits(w13[slot, s:]), bits(full[expert(layer, g, "up_proj")][rows])), (layer, g)
            assert np.array_equal(bits(w2[slot]), bits(full[expert(layer, g, "down_proj")][:, rows])), (layer, g)


def test_malformed_input_is_refused_naming_the_tensor():
    model = refit.load_model_inventory(TINY_MOE)
    storage, arrays = make_storage(2, 0, None)
    loader = refit.ExpertLoader(model, storage, destination_rank=3)
    name = expert(0, 5, "gate_proj")
    # A full gate (unsliced) for a tp-2 destination.
    with pytest.raises(refit.LayoutError, match=rf"{name} with shape \[256, 1024\], expected \[128, 1024\].*"
                                                r"destination rank 3"):
        loader.load([(name, np.zeros((I, H), dtype=ml_dtypes.bfloat16))])
    # Another dtype than the storage's.
    with pytest.raises(refit.LayoutError, match=rf"'{name}' is float32 but .*w13_weight holds bfloat16"):
        loader.load([(name, np.zeros((I // 2, H), dtype=np.float32))])
    # Nothing of a refused batch is written, even its good tensors.
    good = np.ones((I // 2, H), dtype=ml_dtypes.bfloat16)
    with pytest.raises(refit.LayoutError, match=expert(0, 99, "up_proj")):
        loader.load([(name, good), (expert(0, 99, "up_proj"), good)])
    assert (bits(arrays[fused(0, "w13")]) == bits(np.array(-7.0, dtype=ml_dtypes.bfloat16))).all()
    # Not (name, tensor) pairs.
    with pytest.raises(refit.InvalidArgumentError, match="pairs"):
        loader.load(["model.norm.weight"])
    # Storage refit cannot write into, or that does not say what it is.
    with pytest.raises(refit.InvalidArgumentError, match=f"expert storage '{fused(0, 'w13')}'"):
        refit.ExpertLoader(model, [{"name": fused(0, "w13"), "tensor": arrays[fused(0, "w13")][:, ::2]}])
    readonly = arrays[fused(0, "w2")].copy()
    readonly.flags.writeable = False
    with pytest.raises(refit.InvalidArgumentError, match=f"expert storage '{fused(0, 'w2')}'"):
        refit.ExpertLoader(model, [{"name": fused(0, "w2"), "tensor": readonly}])
    with pytest.raises(refit.InvalidArgumentError, match="unknown key 'tp'"):
        refit.ExpertLoader(model, [{"name": fused(0, "w2"), "tensor": arrays[fused(0, "w2")], "tp": 2}])
    with pytest.raises(refit.UnsupportedError, match="EPLB"):
        refit.ExpertLoader(model, [dict(storage[0], use_ep=True, expert_map=list(range(E)), eplb=True)])
