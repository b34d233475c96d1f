"""The delta-refit workload generator (python/bench/delta_workload.py): its versions, its bit-exact
change count, its sparse-size formula, and that an RL learning rate gives a sparse, non-empty delta."""

from __future__ import annotations

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "delta_workload.py")
_spec = importlib.util.spec_from_file_location("delta_workload", _PATH)
dw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dw)

TINY = dict(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, vocab=256, batch=2, seq=16)


def bf16_bits(values):
    return torch.tensor(values, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_versions_count_keys_and_dtype():
    versions = list(dw.generate_versions("llama", steps=3, lr=1e-3, seed=1, **TINY))
    assert [step for step, _ in versions] == [0, 1, 2, 3]
    names = set(versions[0][1])
    assert any("lm_head" in n for n in names) and any("q_proj" in n for n in names)
    for _, state in versions:
        assert set(state) == names
        assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in state.values())
    # At lr 1e-3 every step moves the weights; the versions are copies, not one aliased buffer.
    for (_, a), (_, b) in zip(versions, versions[1:]):
        assert dw.compare(a, b)["changed"] > 0


def test_versions_are_deterministic_per_seed():
    a = [s for _, s in dw.generate_versions("qwen3", steps=1, lr=1e-4, seed=7, **TINY)]
    b = [s for _, s in dw.generate_versions("qwen3", steps=1, lr=1e-4, seed=7, **TINY)]
    c = [s for _, s in dw.generate_versions("qwen3", steps=1, lr=1e-4, seed=8, **TINY)]
    assert all(dw.compare(x, y)["changed"] == 0 for x, y in zip(a, b))
    assert dw.compare(a[0], c[0])["changed"] > 0


def test_changed_elements_is_bitwise():
    generator = torch.Generator().manual_seed(0)
    before = torch.randn(1000, generator=generator).to(torch.bfloat16)
    flipped = [3, 64, 65, 999]
    bits = before.view(torch.int16).clone()
    bits[flipped] ^= 1  # lowest mantissa bit: a change of one ulp
    after = bits.view(torch.bfloat16).clone()
    # 0.0 -> -0.0 compares equal as numbers but differs in bits: changed.
    before[10], after[10] = 0.0, -0.0
    # The same NaN bits on both sides: unchanged (though NaN != NaN as numbers).
    before[20] = after[20] = bf16_bits([0x7FC0])[0]
    # NaNs with different payloads: changed.
    before[30], after[30] = bf16_bits([0x7FC0])[0], bf16_bits([0x7FC1])[0]
    expected = sorted(flipped + [10, 30])
    assert dw.changed_elements(before, after).tolist() == expected
    assert dw.changed_elements(before.reshape(10, 100), after.reshape(10, 100)).tolist() == expected
    assert dw.changed_elements(before, before.clone()).numel() == 0


def test_varint_and_sparse_bytes_by_hand():
    assert dw.varint_bytes(torch.tensor([0, 1, 127])) == 3
    assert dw.varint_bytes(torch.tensor([128, 16383])) == 4
    assert dw.varint_bytes(torch.tensor([16384, 2**21 - 1, 2**21])) == 3 + 3 + 4
    assert dw.varint_bytes(torch.tensor([2**56 - 1, 2**56, 2**63 - 1])) == 8 + 9 + 9
    # Changed at 3, 5, 200, 900: gaps 3, 2, 195, 700 -> 1 + 1 + 2 + 2 varint bytes, plus 4 values of 2 bytes.
    assert dw.sparse_bytes(torch.tensor([3, 5, 200, 900]), numel=1000) == 6 + 8
    # Dense change: the sparse form (8 + 4 bytes) is larger than raw (8 bytes), so raw.
    assert dw.sparse_bytes(torch.tensor([0, 1, 2, 3]), numel=4) == 8
    assert dw.sparse_bytes(torch.tensor([], dtype=torch.int64), numel=4) == 0


def test_compare_sums_per_kind():
    before = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
              "model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    after = {name: t.clone() for name, t in before.items()}
    after["model.layers.0.self_attn.q_proj.weight"][0, :3] = 1.0
    result = dw.compare(before, after)
    assert (result["changed"], result["numel"]) == (3, 40)
    assert result["kinds"]["attn_q"]["changed"] == 3 and result["kinds"]["norm"]["changed"] == 0
    # q_proj: 3 values (6 bytes) + gaps 0, 1, 1 (3 bytes); norm: nothing.
    assert (result["full_bytes"], result["sparse_bytes"]) == (80, 9)


def test_rl_learning_rate_gives_sparse_nonempty_deltas():
    shares = []
    previous = None
    for _, state in dw.generate_versions("qwen3", steps=3, lr=1e-6, seed=0, master="fp32", batch=4, seq=64):
        if previous is not None:
            shares.append(dw.compare(previous, state)["share"])
        previous = state
    assert any(0.0 < share < 0.5 for share in shares), shares
