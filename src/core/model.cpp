#include "refit/model.h"

#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/fail.h"
#include "core/hf_config.h"
#include "refit/safetensors.h"

namespace refit {

namespace fs = std::filesystem;

uint64_t ModelInventory::total_bytes() const {
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.nbytes();
  return total;
}

uint64_t ModelInventory::fingerprint() const {
  // Length-prefixed fields, so that no two different inventories feed the same byte stream.
  XXH3_state_t* state = XXH3_createState();
  if (!state) fail(ErrorKind::kInternal, "XXH3_createState failed");
  XXH3_64bits_reset(state);
  auto put_u64 = [&](uint64_t v) { XXH3_64bits_update(state, &v, sizeof v); };
  put_u64(tensors.size());
  for (const auto& t : tensors) {
    put_u64(t.name.size());
    XXH3_64bits_update(state, t.name.data(), t.name.size());
    auto code = static_cast<uint8_t>(t.dtype);
    XXH3_64bits_update(state, &code, 1);
    put_u64(t.shape.size());
    for (int64_t d : t.shape) put_u64(static_cast<uint64_t>(d));
  }
  uint64_t hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return hash;
}

namespace {

// config.json access whose errors name the file and the key.
class Config {
 public:
  Config(std::string path, nlohmann::json json) : path_(std::move(path)), json_(std::move(json)) {}

  const std::string& path() const { return path_; }

  // Absent or null gives nullopt; anything but an integer >= min is an error.
  std::optional<int64_t> opt_int(const char* key, int64_t min = 1) const {
    const auto* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer() || v->get<int64_t>() < min)
      fail(ErrorKind::kModel, "config '{}': key '{}' must be an integer >= {}, got {}", path_, key, min, v->dump());
    return v->get<int64_t>();
  }
  int64_t get_int(const char* key, int64_t min = 1) const {
    auto v = opt_int(key, min);
    if (!v) fail(ErrorKind::kModel, "config '{}': missing key '{}'", path_, key);
    return *v;
  }
  int64_t int_or(const char* key, int64_t fallback, int64_t min = 1) const {
    return opt_int(key, min).value_or(fallback);
  }

  bool flag(const char* key, bool fallback) const {
    const auto* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean())
      fail(ErrorKind::kModel, "config '{}': key '{}' must be a boolean, got {}", path_, key, v->dump());
    return v->get<bool>();
  }
  std::optional<std::string> opt_string(const char* key) const {
    const auto* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_string())
      fail(ErrorKind::kModel, "config '{}': key '{}' must be a string, got {}", path_, key, v->dump());
    return v->get<std::string>();
  }
  std::set<int64_t> int_set(const char* key) const {
    std::set<int64_t> out;
    const auto* v = find(key);
    if (!v) return out;
    if (!v->is_array())
      fail(ErrorKind::kModel, "config '{}': key '{}' must be a list of integers, got {}", path_, key, v->dump());
    for (const auto& e : *v) {
      if (!e.is_number_integer())
        fail(ErrorKind::kModel, "config '{}': key '{}' must be a list of integers, got {}", path_, key, v->dump());
      out.insert(e.get<int64_t>());
    }
    return out;
  }

 private:
  const nlohmann::json* find(const char* key) const {
    auto it = json_.find(key);
    return it == json_.end() || it->is_null() ? nullptr : &*it;
  }
  std::string path_;
  nlohmann::json json_;
};

// Appends tensors in the order the HF module registers its parameters (named_parameters()).
struct Builder {
  DType dtype;
  std::vector<TensorInfo>& out;

  void add(std::string name, std::vector<int64_t> shape, std::optional<DType> dt = std::nullopt) {
    out.push_back({std::move(name), dt.value_or(dtype), std::move(shape)});
  }
  void linear(const std::string& prefix, int64_t out_features, int64_t in_features, bool bias = false) {
    add(prefix + ".weight", {out_features, in_features});
    if (bias) add(prefix + ".bias", {out_features});
  }
  void norm(const std::string& prefix, int64_t dim) { add(prefix + ".weight", {dim}); }
  // SwiGLU MLP with HF names gate_proj/up_proj/down_proj.
  void mlp(const std::string& prefix, int64_t hidden, int64_t inter, bool bias = false) {
    linear(prefix + ".gate_proj", inter, hidden, bias);
    linear(prefix + ".up_proj", inter, hidden, bias);
    linear(prefix + ".down_proj", hidden, inter, bias);
  }
};

// The sizes every family shares.
struct Dims {
  int64_t vocab, hidden, layers, heads, kv_heads, head_dim;
};

Dims read_dims(const Config& c) {
  Dims d{};
  d.vocab = c.get_int("vocab_size");
  d.hidden = c.get_int("hidden_size");
  d.layers = c.get_int("num_hidden_layers");
  d.heads = c.get_int("num_attention_heads");
  d.kv_heads = c.int_or("num_key_value_heads", d.heads);
  auto head_dim = c.opt_int("head_dim");
  if (!head_dim && d.hidden % d.heads != 0)
    fail(ErrorKind::kModel,
         "config '{}': hidden_size {} is not divisible by num_attention_heads {} and there is no head_dim", c.path(),
         d.hidden, d.heads);
  d.head_dim = head_dim.value_or(d.hidden / d.heads);
  return d;
}

// Grouped-query attention (llama, mistral, qwen2, qwen3 and their MoE variants).
void gqa_attention(Builder& b, const std::string& p, const Dims& d, bool qkv_bias, bool o_bias, bool qk_norm) {
  b.linear(p + "self_attn.q_proj", d.heads * d.head_dim, d.hidden, qkv_bias);
  b.linear(p + "self_attn.k_proj", d.kv_heads * d.head_dim, d.hidden, qkv_bias);
  b.linear(p + "self_attn.v_proj", d.kv_heads * d.head_dim, d.hidden, qkv_bias);
  b.linear(p + "self_attn.o_proj", d.hidden, d.heads * d.head_dim, o_bias);
  if (qk_norm) {  // qwen3: per-head RMSNorm over head_dim
    b.norm(p + "self_attn.q_norm", d.head_dim);
    b.norm(p + "self_attn.k_norm", d.head_dim);
  }
}

// embed_tokens, then each layer (its attention and MLP from `layer`, then its two norms),
// then the final norm and lm_head; the same skeleton for every supported family.
void decoder(Builder& b, const Config& c, const Dims& d,
             const std::function<void(const std::string&, int64_t)>& layer) {
  b.add("model.embed_tokens.weight", {d.vocab, d.hidden});
  for (int64_t i = 0; i < d.layers; ++i) {
    std::string p = fmt::format("model.layers.{}.", i);
    layer(p, i);
    b.norm(p + "input_layernorm", d.hidden);
    b.norm(p + "post_attention_layernorm", d.hidden);
  }
  b.norm("model.norm", d.hidden);
  if (!c.flag("tie_word_embeddings", false)) b.add("lm_head.weight", {d.vocab, d.hidden});
}

void dense_family(Builder& b, const Config& c, const std::string& type) {
  Dims d = read_dims(c);
  int64_t inter = c.get_int("intermediate_size");
  // qwen2 always has q/k/v biases; llama and qwen3 have them (and an o_proj bias) only with
  // attention_bias; mistral never.
  bool qwen2 = type == "qwen2";
  bool attn_bias = (type == "llama" || type == "qwen3") && c.flag("attention_bias", false);
  bool mlp_bias = type == "llama" && c.flag("mlp_bias", false);
  decoder(b, c, d, [&](const std::string& p, int64_t) {
    gqa_attention(b, p, d, qwen2 || attn_bias, attn_bias, type == "qwen3");
    b.mlp(p + "mlp", d.hidden, inter, mlp_bias);
  });
}

// qwen2_moe and qwen3_moe: a layer is sparse unless listed in mlp_only_layers or off the
// decoder_sparse_step grid; qwen2_moe adds a shared expert with a scalar sigmoid gate.
void qwen_moe_family(Builder& b, const Config& c, bool qwen2) {
  Dims d = read_dims(c);
  // transformers 5 writes the expert count as num_local_experts (4.x: num_experts).
  auto count = c.opt_int("num_experts", 0);
  if (!count) count = c.opt_int("num_local_experts", 0);
  if (!count) fail(ErrorKind::kModel, "config '{}': missing key 'num_experts' (or 'num_local_experts')", c.path());
  int64_t experts = *count;
  int64_t moe_inter = c.get_int("moe_intermediate_size");
  int64_t step = c.int_or("decoder_sparse_step", 1);
  auto mlp_only = c.int_set("mlp_only_layers");
  bool attn_bias = !qwen2 && c.flag("attention_bias", false);
  decoder(b, c, d, [&](const std::string& p, int64_t i) {
    gqa_attention(b, p, d, qwen2 || attn_bias, attn_bias, !qwen2);
    if (mlp_only.contains(i) || experts == 0 || (i + 1) % step != 0) {
      b.mlp(p + "mlp", d.hidden, c.get_int("intermediate_size"));
      return;
    }
    b.linear(p + "mlp.gate", experts, d.hidden);
    for (int64_t e = 0; e < experts; ++e) b.mlp(fmt::format("{}mlp.experts.{}", p, e), d.hidden, moe_inter);
    if (qwen2) {
      b.mlp(p + "mlp.shared_expert", d.hidden, c.get_int("shared_expert_intermediate_size"));
      b.linear(p + "mlp.shared_expert_gate", 1, d.hidden);
    }
  });
}

void mixtral_family(Builder& b, const Config& c) {
  Dims d = read_dims(c);
  int64_t experts = c.get_int("num_local_experts");
  int64_t inter = c.get_int("intermediate_size");
  decoder(b, c, d, [&](const std::string& p, int64_t) {
    gqa_attention(b, p, d, false, false, false);
    b.linear(p + "block_sparse_moe.gate", experts, d.hidden);
    for (int64_t e = 0; e < experts; ++e) {
      std::string ep = fmt::format("{}block_sparse_moe.experts.{}", p, e);
      b.linear(ep + ".w1", inter, d.hidden);  // gate
      b.linear(ep + ".w2", d.hidden, inter);  // down
      b.linear(ep + ".w3", inter, d.hidden);  // up
    }
  });
}

// DeepSeek-V3 (modeling_deepseek.py names): MLA attention, first_k_dense_replace dense layers,
// then MoE layers with routed experts, a sigmoid router with a correction bias and shared
// experts. Not included: the MTP layers (num_nextn_predict_layers, stored as model.layers.61 in
// the release) that a policy does not train; and the release's FP8 block quantization
// (quantization_config: fp8 weights plus weight_scale_inv), since RL trains and moves bf16.
void deepseek_v3_family(Builder& b, const Config& c) {
  Dims d = read_dims(c);
  auto q_lora = c.opt_int("q_lora_rank");
  int64_t kv_lora = c.get_int("kv_lora_rank");
  int64_t nope = c.get_int("qk_nope_head_dim", 0);
  int64_t rope = c.get_int("qk_rope_head_dim", 0);
  int64_t v_dim = c.get_int("v_head_dim");
  int64_t q_head = nope + rope;
  if (q_head == 0) fail(ErrorKind::kModel, "config '{}': qk_nope_head_dim + qk_rope_head_dim must be > 0", c.path());
  bool bias = c.flag("attention_bias", false);
  auto routed = c.opt_int("n_routed_experts", 0);
  auto shared = c.opt_int("n_shared_experts", 0);
  int64_t first_dense = c.int_or("first_k_dense_replace", 0, 0);
  int64_t freq = c.int_or("moe_layer_freq", 1);
  // The release keeps the router's correction bias in float32 (its inference code creates it
  // as float32 and checkpoints store it as F32), whatever torch_dtype says.
  bool score_bias = c.opt_string("topk_method").value_or("noaux_tc") == "noaux_tc";
  int64_t moe_inter = routed.value_or(0) > 0 ? c.get_int("moe_intermediate_size") : 0;

  decoder(b, c, d, [&](const std::string& p, int64_t i) {
    std::string a = p + "self_attn.";
    if (q_lora) {
      b.linear(a + "q_a_proj", *q_lora, d.hidden, bias);
      b.norm(a + "q_a_layernorm", *q_lora);
      b.linear(a + "q_b_proj", d.heads * q_head, *q_lora);
    } else {
      b.linear(a + "q_proj", d.heads * q_head, d.hidden);
    }
    b.linear(a + "kv_a_proj_with_mqa", kv_lora + rope, d.hidden, bias);
    b.norm(a + "kv_a_layernorm", kv_lora);
    b.linear(a + "kv_b_proj", d.heads * (nope + v_dim), kv_lora);
    b.linear(a + "o_proj", d.hidden, d.heads * v_dim, bias);

    if (routed.value_or(0) == 0 || i < first_dense || i % freq != 0) {
      b.mlp(p + "mlp", d.hidden, c.get_int("intermediate_size"));
      return;
    }
    for (int64_t e = 0; e < *routed; ++e) b.mlp(fmt::format("{}mlp.experts.{}", p, e), d.hidden, moe_inter);
    b.linear(p + "mlp.gate", *routed, d.hidden);
    if (score_bias) b.add(p + "mlp.gate.e_score_correction_bias", {*routed}, DType::kFloat32);
    if (shared.value_or(0) > 0) b.mlp(p + "mlp.shared_experts", d.hidden, moe_inter * *shared);
  });
}

// The name to give an inventory read from `p`: a directory's name, or a file's stem.
std::string name_of(const fs::path& p, bool is_dir) {
  fs::path clean = p.lexically_normal();
  if (clean.filename().empty()) clean = clean.parent_path();  // "dir/" -> "dir"
  return is_dir ? clean.filename().string() : clean.stem().string();
}

}  // namespace

ModelInventory inventory_from_hf_config(const std::string& path) {
  HfConfig config = read_hf_config(path);
  const std::string& file = config.origin;
  Config c(file, std::move(config.json));

  auto type = c.opt_string("model_type");
  if (!type) fail(ErrorKind::kModel, "config '{}': missing key 'model_type'", file);
  // Newer transformers write "dtype"; older ones "torch_dtype". HF's default is float32, but every
  // supported family ships bf16 and RL trains in bf16, so bf16 is the default here.
  auto dtype_text = c.opt_string("torch_dtype");
  const char* dtype_key = "torch_dtype";
  if (!dtype_text) {
    dtype_text = c.opt_string("dtype");
    dtype_key = "dtype";
  }
  DType dtype = DType::kBFloat16;
  if (dtype_text) {
    try {
      dtype = parse_dtype(*dtype_text);
    } catch (const Error& e) {
      fail(ErrorKind::kModel, "config '{}': key '{}': {}", file, dtype_key, e.what());
    }
  }

  ModelInventory inv;
  inv.name = *type;
  Builder b{dtype, inv.tensors};
  if (*type == "llama" || *type == "mistral" || *type == "qwen2" || *type == "qwen3") {
    dense_family(b, c, *type);
  } else if (*type == "qwen2_moe" || *type == "qwen3_moe") {
    qwen_moe_family(b, c, *type == "qwen2_moe");
  } else if (*type == "mixtral") {
    mixtral_family(b, c);
  } else if (*type == "deepseek_v3") {
    deepseek_v3_family(b, c);
  } else {
    fail(ErrorKind::kModel,
         "config '{}': unsupported model_type '{}' (supported: llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, "
         "mixtral, deepseek_v3)",
         file, *type);
  }
  return inv;
}

ModelInventory inventory_from_safetensors(const std::string& path) {
  std::error_code ec;
  auto status = fs::status(path, ec);
  if (!fs::exists(status)) fail(ErrorKind::kModel, "model path '{}' does not exist", path);
  bool is_dir = fs::is_directory(status);

  // Shards are named model-00001-of-00004.safetensors, so file-name order is shard order.
  std::vector<fs::path> files;
  if (is_dir) {
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      std::error_code file_ec;
      if (entry.is_regular_file(file_ec) && entry.path().extension() == ".safetensors") files.push_back(entry.path());
    }
    if (ec) fail(ErrorKind::kModel, "model directory '{}': cannot list: {}", path, ec.message());
    if (files.empty()) fail(ErrorKind::kModel, "model directory '{}' holds no *.safetensors files", path);
    std::sort(files.begin(), files.end(),
              [](const fs::path& a, const fs::path& b) { return a.filename() < b.filename(); });
  } else {
    files.push_back(path);
  }

  ModelInventory inv;
  inv.name = name_of(path, is_dir);
  std::set<std::string> seen;
  for (const auto& f : files) {
    SafetensorsFile file(f.string());
    for (const auto& t : file.tensors()) {
      if (!seen.insert(t.name).second)
        fail(ErrorKind::kModel, "safetensors '{}': tensor '{}' also appears in an earlier file of '{}'", f.string(),
             t.name, path);
      inv.tensors.push_back(t);
    }
  }
  return inv;
}

ModelInventory load_model_inventory(const std::string& path) {
  if (is_builtin_model(path)) return inventory_from_hf_config(path);
  std::error_code ec;
  auto status = fs::status(path, ec);
  if (!fs::exists(status)) fail(ErrorKind::kModel, "model path '{}' does not exist", path);
  if (fs::is_directory(status)) {
    if (fs::exists(fs::path(path) / "config.json", ec)) return inventory_from_hf_config(path);
    return inventory_from_safetensors(path);
  }
  auto ext = fs::path(path).extension();
  if (ext == ".json") return inventory_from_hf_config(path);
  if (ext == ".safetensors") return inventory_from_safetensors(path);
  fail(ErrorKind::kModel, "model path '{}' is neither a directory, a .json config nor a .safetensors file", path);
}

}  // namespace refit
