"""shard_expert_weights in the Python package: a destination declares its layout (as the
reference's destinations report get_target_weight_layout()), and its source sends only those
slices; without a layout the destination refuses, rather than silently receiving every expert."""

from __future__ import annotations

import numpy as np
import pytest

import refit
from refit.testing import SyntheticSource

from helpers import TINY_MOE, Pair, config

MiB = 1 << 20


def receive(layout) -> tuple:
    source = SyntheticSource(TINY_MOE)
    source.stage(1)
    pair = Pair(MiB, config(shard_expert_weights=True), layout=layout)
    got = {}
    try:
        pair.refit(source.weights(1), load=lambda batch: got.update({n: np.array(t) for n, t in batch}))
    finally:
        pair.close()
    return dict(source.weights(1)), got


def test_without_a_layout_a_destination_refuses_sharded_experts():
    with pytest.raises(refit.ConfigError, match="shard_expert_weights is true, but destination rank 0 declared no layout"):
        Pair(MiB, config(shard_expert_weights=True))


def test_tensor_parallel_destination_gets_its_slice_of_every_expert():
    full, got = receive(refit.destination_layout(TINY_MOE, tp_size=2, tp_rank=1, shard_experts=True))
    assert set(got) == set(full)
    experts = [n for n in full if ".mlp.experts." in n]
    assert experts
    for name, tensor in full.items():
        if name in experts and ("gate_proj" in name or "up_proj" in name):
            expected = tensor[tensor.shape[0] // 2:]  # column parallel: rank 1's half of the rows
        elif name in experts:
            expected = tensor[:, tensor.shape[1] // 2:]  # down_proj, row parallel
        else:
            expected = tensor  # dense tensors whole (shard_dense is off)
        assert got[name].shape == expected.shape, name
        assert np.array_equal(got[name].view(np.uint8), np.ascontiguousarray(expected).view(np.uint8)), name


def test_expert_parallel_destination_gets_only_the_experts_it_owns():
    full, got = receive(refit.destination_layout(TINY_MOE, ep_size=2, ep_rank=1, shard_experts=True))
    owned = [n for n in got if ".mlp.experts." in n]
    assert owned and all(int(n.split(".mlp.experts.")[1].split(".")[0]) >= 8 for n in owned)
    assert len(owned) == len([n for n in full if ".mlp.experts." in n]) // 2
    for name in got:
        assert np.array_equal(got[name].view(np.uint8), np.ascontiguousarray(full[name]).view(np.uint8)), name


def test_the_references_compact_layout():
    model = refit.load_model_inventory(TINY_MOE)
    # No expert parameter listed (this stage has none) and lm_head elsewhere.
    layout = refit.layout_from_compact({}, ["lm_head."], model, 0)
    full, got = receive(layout)
    assert "lm_head.weight" in full and "lm_head.weight" not in got
    assert not [n for n in got if ".mlp.experts." in n]
    assert {n for n in full if ".mlp.experts." not in n and not n.startswith("lm_head.")} == set(got)
    with pytest.raises(refit.LayoutError, match="expert_params"):
        refit.layout_from_compact({"model.layers.0.mlp.experts.w2_weight": (0, 1)}, [], model, 0)
