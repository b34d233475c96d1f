// Small models for resharding tests (transfer plan, engine): what resharding must get right, in
// models small enough to move every byte of in a test.
#pragma once

#include <unistd.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "refit/fp8.h"
#include "refit/layout_builders.h"
#include "refit/model.h"

namespace refit::testing {

// Small models with what resharding must get right: GQA (2 KV heads), a vocabulary that is not a
// multiple of the padding, tied embeddings, routed experts; and MLA with shared experts.
inline const char* kQwenMoe = R"({
  "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
  "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 1003,
  "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "rms_norm_eps": 1e-6, "tie_word_embeddings": true
})";
inline const char* kDeepseek = R"({
  "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16",
  "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
  "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 8, "n_shared_experts": 1,
  "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
  "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "vocab_size": 777,
  "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "num_nextn_predict_layers": 0,
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false
})";

// The same families with every dimension that TP 2 splits a multiple of 2 x 128, so that their
// FP8 forms (fp8_block_inventory: 128 x 128 scale blocks) reshard at TP 2.
inline const char* kQwenMoeAligned = R"({
  "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
  "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1003,
  "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false
})";
inline const char* kDeepseekAligned = R"({
  "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16",
  "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 3,
  "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 4, "n_shared_experts": 1,
  "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 128, "q_lora_rank": 256,
  "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 777,
  "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "num_nextn_predict_layers": 0,
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false
})";

struct Model {
  ModelInventory inventory;
  ModelDims dims;
};

inline Model model_from(const char* json, const std::string& name) {
  const auto path = std::filesystem::temp_directory_path() / (name + "-" + std::to_string(getpid()) + ".json");
  std::ofstream(path) << json;
  Model m{inventory_from_hf_config(path.string()), model_dims_from_hf_config(path.string())};
  std::filesystem::remove(path);
  return m;
}

inline const Model& qwen_moe() {
  static const Model m = model_from(kQwenMoe, "qwen-moe");
  return m;
}
inline const Model& deepseek() {
  static const Model m = model_from(kDeepseek, "deepseek");
  return m;
}

// FP8 checkpoint forms (fp8.h) of the aligned models.
inline const Model& qwen_moe_fp8() {
  static const Model m = [] {
    Model bf16 = model_from(kQwenMoeAligned, "qwen-moe-aligned");
    return Model{fp8_block_inventory(bf16.inventory), bf16.dims};
  }();
  return m;
}
inline const Model& deepseek_fp8() {
  static const Model m = [] {
    Model bf16 = model_from(kDeepseekAligned, "deepseek-aligned");
    return Model{fp8_block_inventory(bf16.inventory), bf16.dims};
  }();
  return m;
}

// The whole model's bytes: byte b of tensor i is a hash of (i, b), so a misplaced byte shows.
inline std::vector<std::vector<std::byte>> patterned(const ModelInventory& inv) {
  std::vector<std::vector<std::byte>> out;
  for (uint32_t i = 0; i < inv.tensors.size(); ++i) {
    std::vector<std::byte> bytes(inv.tensors[i].nbytes());
    for (uint64_t b = 0; b < bytes.size(); ++b) bytes[b] = std::byte((i * 2654435761u + b * 40503u) >> 7);
    out.push_back(std::move(bytes));
  }
  return out;
}

struct Side {
  std::string name;
  std::vector<Layout> layouts;
};

// Destinations as vLLM shards them: tp x pp ranks, experts by EP over the TP ranks or TP-narrowed.
inline Side vllm_side(const Model& m, int tp, int pp, bool ep, bool shard_dense) {
  Side side{fmt::format("vLLM tp{} pp{}{}{}", tp, pp, ep ? " ep" : "", shard_dense ? "" : " (dense whole)"), {}};
  for (int r = 0; r < tp * pp; ++r) {
    ModelParallel p;
    p.destination_rank = r;
    p.tp_size = tp;
    p.tp_rank = r % tp;
    p.pp_size = pp;
    p.pp_rank = r / tp;
    p.ep_size = ep ? tp : 1;
    p.ep_rank = ep ? r % tp : 0;
    p.shard_experts = true;
    p.shard_dense = shard_dense;
    side.layouts.push_back(build_layout(m.inventory, m.dims, p));
  }
  return side;
}

}  // namespace refit::testing
