// Model inventories: the list of tensors (HF names, shapes, dtypes) that a refit moves.
// An inventory comes from a Hugging Face config.json (the tensors that model would have) or
// from safetensors files (the tensors those files hold).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "refit/tensor.h"

namespace refit {

// The default model of `refit bench` and `refit plan`: a scaled-down Qwen3-MoE (365 MiB of bf16,
// 459 tensors) whose config.json is compiled into the library, so that an installed refit needs
// no data folder. Every function below that takes a path also takes "builtin:<name>".
inline constexpr const char* kDefaultModel = "builtin:refit-tiny-moe";

struct ModelInventory {
  std::string name;                 // model_type or the directory name
  std::vector<TensorInfo> tensors;  // in the order a policy would stream them

  uint64_t total_bytes() const;
  // A hash of every (name, dtype, shape) in order; peers compare it before any transfer.
  uint64_t fingerprint() const;
};

// Reads a config.json (path to the file, or to a directory holding it). Supports the dense
// families llama, qwen2, qwen3, mistral and the MoE families qwen3_moe, qwen2_moe, mixtral,
// deepseek_v3 (MLA attention, shared experts, first dense layers). Throws Error(kModel) naming
// the file and key for a missing file, bad JSON, missing key or an unsupported model_type.
ModelInventory inventory_from_hf_config(const std::string& path);

// Reads every *.safetensors file of a directory (or one file). Throws Error(kModel).
ModelInventory inventory_from_safetensors(const std::string& path);

// Either of the above, by looking at what `path` is.
ModelInventory load_model_inventory(const std::string& path);

}  // namespace refit
