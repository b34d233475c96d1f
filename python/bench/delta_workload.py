#!/usr/bin/env python3
"""An RL-like weight-update workload for delta refit: how many bf16 weight elements change bit-wise
per optimizer step. A small transformers causal LM (qwen3 or llama, built from a config, no
downloads) trains with AdamW at an RL learning rate on a seeded Markov-chain token stream; after
each step every bf16 tensor is compared bit-wise with the previous version.

    python python/bench/delta_workload.py --family qwen3 --steps 10 --lr 1e-6
    python python/bench/delta_workload.py --master bf16 --json out.json --save-dir versions/

--master fp32 (default) keeps fp32 master weights in the optimizer and sends their bf16 cast, as
Megatron and FSDP mixed precision do; --master bf16 lets AdamW update bf16 parameters in place.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator

import numpy as np
import torch

KINDS = (("embed_tokens", "embed"), ("lm_head", "lm_head"), ("q_proj", "attn_q"), ("k_proj", "attn_k"),
         ("v_proj", "attn_v"), ("o_proj", "attn_o"), ("gate_proj", "mlp_gate"), ("up_proj", "mlp_up"),
         ("down_proj", "mlp_down"), ("norm", "norm"))


def tensor_kind(name: str) -> str:
    return next((kind for pattern, kind in KINDS if pattern in name), "other")


def build_model(family: str, seed: int, hidden: int = 256, layers: int = 4, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 512, vocab: int = 4096):
    import transformers

    config_class = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    # Untied lm_head, as in the 7B+ models RL trains; head_dim explicit (Qwen3Config defaults to 128).
    config = config_class(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=hidden // heads, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                         dtype=torch.float32)


class MarkovData:
    """Token sequences from a fixed sparse Markov chain (each token has `fanout` successors with
    Dirichlet weights): learnable, deterministic per (seed, step), and a fresh batch every step,
    as rollouts are in RL."""

    def __init__(self, vocab: int, seed: int, fanout: int = 16):
        rng = np.random.default_rng([seed, 1])
        self.vocab, self.seed = vocab, seed
        self.successors = rng.integers(0, vocab, size=(vocab, fanout))
        self.cumulative = np.cumsum(rng.dirichlet(np.full(fanout, 0.5), size=vocab), axis=1)

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, 2, step])
        tokens = np.empty((batch, seq), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab, size=batch)
        for t in range(1, seq):
            rows = self.cumulative[tokens[:, t - 1]]
            pick = (rng.random((batch, 1)) > rows).sum(axis=1).clip(max=rows.shape[1] - 1)
            tokens[:, t] = self.successors[tokens[:, t - 1], pick]
        return torch.from_numpy(tokens)


def bf16_state(model) -> dict[str, torch.Tensor]:
    # What the inference engine would receive: the bf16 cast of every parameter, on the CPU.
    return {name: p.detach().to("cpu", torch.bfloat16, copy=True) for name, p in model.state_dict().items()}


def generate_versions(family: str = "qwen3", steps: int = 10, lr: float = 1e-6, seed: int = 0,
                      weight_decay: float = 0.0, master: str = "fp32", batch: int = 8, seq: int = 128,
                      clip: float = 1.0, device: str = "cpu", stats: dict | None = None,
                      **model_kwargs) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yields (0, initial weights), then (k, weights after optimizer step k) for k = 1..steps, each a
    state dict of CPU bf16 tensors. `stats`, if given, gets the last step's "loss"."""
    if master not in ("fp32", "bf16"):
        raise ValueError(f"master must be fp32 or bf16, not {master!r}")
    model = build_model(family, seed, **model_kwargs).to(device)
    if master == "bf16":
        model = model.to(torch.bfloat16)  # AdamW then keeps its moments and updates in bf16 too
    model.train()
    data = MarkovData(model.config.vocab_size, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    yield 0, bf16_state(model)
    for step in range(1, steps + 1):
        tokens = data.batch(step, batch, seq).to(device)
        # bf16 compute over fp32 master weights, as mixed-precision trainers run it.
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                            enabled=master == "fp32"):
            loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if stats is not None:
            stats["loss"] = loss.item()
        yield step, bf16_state(model)


def changed_elements(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Flat indices of the elements whose bits differ (so 0.0 -> -0.0 counts, an identical NaN does not)."""
    assert before.shape == after.shape and before.dtype == after.dtype and before.element_size() == 2
    return torch.nonzero(before.reshape(-1).view(torch.int16) != after.reshape(-1).view(torch.int16)).reshape(-1)


def varint_bytes(values: torch.Tensor) -> int:
    """Total LEB128 length of non-negative int64s: 7 payload bits per byte, at least one byte (at most
    9 for 2**63 - 1; a 2**63 threshold would overflow int64, so thresholds stop at 2**56)."""
    values = values.to(torch.int64)
    return int(values.numel() + sum(int((values >= (1 << (7 * k))).sum()) for k in range(1, 9)))


def sparse_bytes(changed: torch.Tensor, numel: int, element_size: int = 2) -> int:
    """Bytes to send a tensor as (varint gap, value) pairs, the gap counted from the previous changed
    element (the first from index 0), or as raw bytes where that is smaller."""
    if changed.numel() == 0:
        return 0
    gaps = torch.diff(changed.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    return min(numel * element_size, changed.numel() * element_size + varint_bytes(gaps))


def compare(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict:
    """Changed share over the model and per tensor kind, and full vs sparse bytes, for one step."""
    kinds: dict[str, dict[str, int]] = {}
    changed_total = numel_total = full = sparse = 0
    for name, old in before.items():
        changed = changed_elements(old, after[name])
        kind = kinds.setdefault(tensor_kind(name), {"changed": 0, "numel": 0})
        kind["changed"] += changed.numel()
        kind["numel"] += old.numel()
        changed_total += changed.numel()
        numel_total += old.numel()
        full += old.numel() * old.element_size()
        sparse += sparse_bytes(changed, old.numel(), old.element_size())
    for kind in kinds.values():
        kind["share"] = kind["changed"] / kind["numel"]
    return {"changed": changed_total, "numel": numel_total, "share": changed_total / numel_total,
            "full_bytes": full, "sparse_bytes": sparse, "ratio": full / sparse if sparse else float("inf"),
            "kinds": kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("qwen3", "llama"), default="qwen3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--master", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", metavar="OUT", help="write every per-step figure here")
    parser.add_argument("--save-dir", metavar="DIR", help="save step_NNNN.safetensors per version")
    args = parser.parse_args()

    if args.save_dir:
        import os

        from safetensors.torch import save_file
        os.makedirs(args.save_dir, exist_ok=True)
    print(f"family={args.family} master={args.master} lr={args.lr:g} weight_decay={args.weight_decay:g} "
          f"seed={args.seed} steps={args.steps}")
    records, previous, stats = [], None, {}
    versions = generate_versions(args.family, args.steps, args.lr, args.seed, args.weight_decay, args.master,
                                 device=args.device, stats=stats)
    while True:
        start = time.perf_counter()
        step, state = next(versions, (None, None))
        step_s = time.perf_counter() - start
        if step is None:
            break
        if args.save_dir:
            save_file(state, os.path.join(args.save_dir, f"step_{step:04d}.safetensors"))
        if previous is not None:
            start = time.perf_counter()
            record = compare(previous, state)
            record.update(step=step, step_s=step_s, compare_s=time.perf_counter() - start,
                          loss=stats["loss"])
            records.append(record)
            kinds = " ".join(f"{k}={v['share']:.4f}" for k, v in sorted(record["kinds"].items()))
            print(f"step {step:3d} loss {record['loss']:.4f} {step_s:6.3f} s  changed {record['share']:.5f}  "
                  f"full/sparse {record['ratio']:7.2f}  {kinds}")
        previous = state
    if records:
        summary = {"share": statistics.median(r["share"] for r in records),
                   "ratio": statistics.median(r["ratio"] for r in records),
                   "step_s": statistics.median(r["step_s"] for r in records),
                   "kinds": {k: statistics.median(r["kinds"][k]["share"] for r in records)
                             for k in records[0]["kinds"]}}
        print(f"median over {len(records)} steps: changed {summary['share']:.5f}  full/sparse "
              f"{summary['ratio']:.2f}  step {summary['step_s']:.3f} s  "
              + " ".join(f"{k}={v:.4f}" for k, v in sorted(summary["kinds"].items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "params": records[0]["numel"] if records else 0,
                       "median": summary if records else None, "steps": records}, f, indent=1)


if __name__ == "__main__":
    main()
