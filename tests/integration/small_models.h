// Models for the integration tests.
#pragma once

namespace refit::testing {

// A small MoE (about 9 MiB): GQA with 2 KV heads (replicated at TP 4), 8 experts, tensors that
// split over the 1 MiB buckets the tests use.
inline const char* kSmallMoe = R"({
  "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
  "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 3,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8000,
  "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false
})";

}  // namespace refit::testing
