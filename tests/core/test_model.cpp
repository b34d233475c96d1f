#include "refit/layout_builders.h"
#include "refit/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "core/error_of.h"
#include "refit/error.h"
#include "refit/safetensors.h"

namespace refit {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string model_dir(const std::string& name) { return std::string(REFIT_DATA_DIR) + "/models/" + name; }
ModelInventory load(const std::string& name) { return inventory_from_hf_config(model_dir(name)); }

uint64_t params(const ModelInventory& inv) {
  uint64_t n = 0;
  for (const auto& t : inv.tensors) n += t.numel();
  return n;
}

const TensorInfo* find(const ModelInventory& inv, const std::string& name) {
  for (const auto& t : inv.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

std::vector<int64_t> shape_of(const ModelInventory& inv, const std::string& name) {
  const auto* t = find(inv, name);
  EXPECT_NE(t, nullptr) << name;
  return t ? t->shape : std::vector<int64_t>{};
}

std::vector<std::string> names_with_prefix(const ModelInventory& inv, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& t : inv.tensors)
    if (t.name.starts_with(prefix)) out.push_back(t.name.substr(prefix.size()));
  return out;
}

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / fmt_name(info->test_suite_name(), info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(file(name)) << text;
    return file(name);
  }

 private:
  static std::string fmt_name(const char* suite, const char* test) {
    return std::string("refit_model_") + suite + "_" + test + "_" + std::to_string(::getpid());
  }
  fs::path path_;
};

// Expects `fn` to throw Error(kind) whose message holds every one of `parts`.
template <typename Fn>
void expect_error(Fn fn, ErrorKind kind, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
  }
}

// Published parameter counts (the safetensors total of each release, in elements).

TEST(ModelConfig, Llama31_8B) {
  auto inv = load("llama-3.1-8b");
  EXPECT_EQ(inv.name, "llama");
  EXPECT_EQ(inv.tensors.size(), 3u + 32 * 9);
  EXPECT_EQ(params(inv), 8'030'261'248u);
  EXPECT_EQ(inv.total_bytes(), 2 * 8'030'261'248u);
  for (const auto& t : inv.tensors) EXPECT_EQ(t.dtype, DType::kBFloat16) << t.name;
  EXPECT_EQ(inv.tensors.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(inv.tensors.front().shape, (std::vector<int64_t>{128256, 4096}));
  EXPECT_EQ(inv.tensors[inv.tensors.size() - 2].name, "model.norm.weight");
  EXPECT_EQ(inv.tensors.back().name, "lm_head.weight");
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.k_proj.weight"), (std::vector<int64_t>{1024, 4096}));
  EXPECT_EQ(shape_of(inv, "model.layers.31.mlp.down_proj.weight"), (std::vector<int64_t>{4096, 14336}));
  // named_parameters() order inside a layer.
  EXPECT_EQ(
      names_with_prefix(inv, "model.layers.0."),
      (std::vector<std::string>{"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"}));
}

TEST(ModelConfig, Qwen25_7B_HasQkvBiases) {
  auto inv = load("qwen2.5-7b");
  EXPECT_EQ(inv.tensors.size(), 3u + 28 * 12);
  EXPECT_EQ(params(inv), 7'615'616'512u);
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.q_proj.bias"), (std::vector<int64_t>{3584}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.k_proj.bias"), (std::vector<int64_t>{512}));
  EXPECT_EQ(shape_of(inv, "model.layers.27.self_attn.v_proj.bias"), (std::vector<int64_t>{512}));
  EXPECT_EQ(find(inv, "model.layers.0.self_attn.o_proj.bias"), nullptr);
  EXPECT_EQ(names_with_prefix(inv, "model.layers.3.self_attn.").front(), "q_proj.weight");
  EXPECT_EQ(names_with_prefix(inv, "model.layers.3.self_attn.")[1], "q_proj.bias");
}

TEST(ModelConfig, Qwen3_8B_HasQkNorm) {
  auto inv = load("qwen3-8b");
  EXPECT_EQ(inv.tensors.size(), 3u + 36 * 11);
  EXPECT_EQ(params(inv), 8'190'735'360u);
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.q_norm.weight"), (std::vector<int64_t>{128}));
  EXPECT_EQ(shape_of(inv, "model.layers.35.self_attn.k_norm.weight"), (std::vector<int64_t>{128}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.k_proj.weight"), (std::vector<int64_t>{1024, 4096}));
  EXPECT_EQ(find(inv, "model.layers.0.self_attn.q_proj.bias"), nullptr);
}

TEST(ModelConfig, Qwen3_30B_A3B) {
  auto inv = load("qwen3-30b-a3b");
  EXPECT_EQ(inv.name, "qwen3_moe");
  EXPECT_EQ(inv.tensors.size(), 3u + 48 * (6 + 1 + 128 * 3 + 2));
  EXPECT_EQ(params(inv), 30'532'122'624u);
  EXPECT_EQ(shape_of(inv, "model.layers.0.mlp.gate.weight"), (std::vector<int64_t>{128, 2048}));
  EXPECT_EQ(shape_of(inv, "model.layers.47.mlp.experts.127.down_proj.weight"), (std::vector<int64_t>{2048, 768}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.q_proj.weight"), (std::vector<int64_t>{4096, 2048}));
  EXPECT_EQ(find(inv, "model.layers.0.mlp.gate_proj.weight"), nullptr);
  auto layer = names_with_prefix(inv, "model.layers.5.mlp.");
  EXPECT_EQ(layer[0], "gate.weight");
  EXPECT_EQ(layer[1], "experts.0.gate_proj.weight");
  EXPECT_EQ(layer.back(), "experts.127.down_proj.weight");
}

TEST(ModelConfig, Mixtral8x7B) {
  auto inv = load("mixtral-8x7b");
  EXPECT_EQ(inv.tensors.size(), 3u + 32 * (4 + 1 + 8 * 3 + 2));
  EXPECT_EQ(params(inv), 46'702'792'704u);
  EXPECT_EQ(shape_of(inv, "model.layers.0.block_sparse_moe.gate.weight"), (std::vector<int64_t>{8, 4096}));
  EXPECT_EQ(shape_of(inv, "model.layers.31.block_sparse_moe.experts.7.w1.weight"), (std::vector<int64_t>{14336, 4096}));
  EXPECT_EQ(shape_of(inv, "model.layers.31.block_sparse_moe.experts.7.w2.weight"), (std::vector<int64_t>{4096, 14336}));
  EXPECT_EQ(shape_of(inv, "model.layers.31.block_sparse_moe.experts.7.w3.weight"), (std::vector<int64_t>{14336, 4096}));
}

TEST(ModelConfig, DeepSeekV3) {
  auto inv = load("deepseek-v3");
  // 671B main model; the MTP layer (model.layers.61, num_nextn_predict_layers) is left out.
  EXPECT_EQ(params(inv), 671'026'419'200u);
  EXPECT_EQ(inv.tensors.size(), 45'395u);
  EXPECT_EQ(find(inv, "model.layers.61.self_attn.kv_b_proj.weight"), nullptr);
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.q_a_proj.weight"), (std::vector<int64_t>{1536, 7168}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.q_a_layernorm.weight"), (std::vector<int64_t>{1536}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.q_b_proj.weight"), (std::vector<int64_t>{128 * 192, 1536}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (std::vector<int64_t>{576, 7168}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.kv_a_layernorm.weight"), (std::vector<int64_t>{512}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.kv_b_proj.weight"), (std::vector<int64_t>{32768, 512}));
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.o_proj.weight"), (std::vector<int64_t>{7168, 16384}));
  EXPECT_EQ(find(inv, "model.layers.0.self_attn.q_proj.weight"), nullptr);
  // Layers 0-2 dense, 3-60 MoE.
  EXPECT_EQ(shape_of(inv, "model.layers.2.mlp.gate_proj.weight"), (std::vector<int64_t>{18432, 7168}));
  EXPECT_EQ(find(inv, "model.layers.2.mlp.gate.weight"), nullptr);
  EXPECT_EQ(find(inv, "model.layers.3.mlp.gate_proj.weight"), nullptr);
  EXPECT_EQ(shape_of(inv, "model.layers.3.mlp.experts.255.up_proj.weight"), (std::vector<int64_t>{2048, 7168}));
  EXPECT_EQ(shape_of(inv, "model.layers.60.mlp.gate.weight"), (std::vector<int64_t>{256, 7168}));
  EXPECT_EQ(shape_of(inv, "model.layers.60.mlp.shared_experts.down_proj.weight"), (std::vector<int64_t>{7168, 2048}));
  const auto* bias = find(inv, "model.layers.60.mlp.gate.e_score_correction_bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_EQ(bias->shape, (std::vector<int64_t>{256}));
  EXPECT_EQ(bias->dtype, DType::kFloat32);
  EXPECT_EQ(find(inv, "model.layers.60.mlp.gate_proj.weight"), nullptr);
}

// The built-in default model is the shipped data/models/refit-tiny-moe, tensor for tensor.
TEST(ModelConfig, BuiltinDefaultModelIsTheShippedTinyMoe) {
  const auto builtin = load_model_inventory(kDefaultModel);
  const auto shipped = load("refit-tiny-moe");
  EXPECT_EQ(builtin.fingerprint(), shipped.fingerprint());
  EXPECT_EQ(builtin.tensors.size(), 459u);
  EXPECT_EQ(model_dims_from_hf_config(kDefaultModel).num_attention_heads, 8);
  EXPECT_NE(testing::error_of(ErrorKind::kModel, [] { load_model_inventory("builtin:no-such-model"); })
                .find("builtin:no-such-model"),
            std::string::npos);
}

// The scaled models refit ships (sizes listed in data/models/README.md).
TEST(ModelConfig, ShippedScaledModels) {
  auto tiny = load("refit-tiny-moe");  // the default model: 300-400 MiB
  EXPECT_EQ(tiny.name, "qwen3_moe");
  EXPECT_EQ(tiny.tensors.size(), 459u);
  EXPECT_EQ(tiny.total_bytes(), 383'031'296u);
  EXPECT_GE(tiny.total_bytes(), 300ull << 20);
  EXPECT_LE(tiny.total_bytes(), 400ull << 20);
  auto bench = load("refit-bench-2g");  // 2.0-2.5 GiB
  EXPECT_EQ(bench.tensors.size(), 1683u);
  EXPECT_EQ(bench.total_bytes(), 2'387'750'912u);
  EXPECT_GE(bench.total_bytes(), 2ull << 30);
  EXPECT_LE(bench.total_bytes(), (5ull << 30) / 2);
  auto ds = load("deepseek-v3-mini");
  EXPECT_EQ(ds.name, "deepseek_v3");
  EXPECT_EQ(ds.tensors.size(), 449u);
  EXPECT_EQ(ds.total_bytes(), 375'138'752u);
  EXPECT_NE(find(ds, "model.layers.7.mlp.gate.e_score_correction_bias"), nullptr);
  EXPECT_NE(find(ds, "model.layers.0.mlp.down_proj.weight"), nullptr);
}

// Family details not covered by the shipped configs: mistral, qwen2_moe, tied embeddings,
// mlp_only_layers / decoder_sparse_step, deepseek without q_lora_rank.
TEST(ModelConfig, Mistral) {
  TempDir dir;
  dir.write("config.json", R"({"model_type": "mistral", "vocab_size": 32768, "hidden_size": 5120,
    "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "torch_dtype": "float16"})");
  auto inv = inventory_from_hf_config(dir.str());
  EXPECT_EQ(inv.tensors.size(), 3u + 2 * 9);
  EXPECT_EQ(shape_of(inv, "model.layers.1.self_attn.q_proj.weight"), (std::vector<int64_t>{4096, 5120}));
  EXPECT_EQ(shape_of(inv, "model.layers.1.self_attn.o_proj.weight"), (std::vector<int64_t>{5120, 4096}));
  EXPECT_EQ(inv.tensors[0].dtype, DType::kFloat16);
}

TEST(ModelConfig, Qwen2MoeSharedExpertAndTiedEmbeddings) {
  TempDir dir;
  dir.write("config.json", R"({"model_type": "qwen2_moe", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 256, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128,
    "num_experts": 4, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "decoder_sparse_step": 2, "mlp_only_layers": [3], "tie_word_embeddings": true})");
  auto inv = inventory_from_hf_config(dir.file("config.json"));
  EXPECT_EQ(inv.tensors.back().name, "model.norm.weight");  // tied: no lm_head
  // (i + 1) % 2 == 0 makes layers 1 and 3 sparse, but layer 3 is in mlp_only_layers.
  EXPECT_EQ(shape_of(inv, "model.layers.0.mlp.gate_proj.weight"), (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(shape_of(inv, "model.layers.3.mlp.gate_proj.weight"), (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(names_with_prefix(inv, "model.layers.1.mlp.").size(), 1u + 4 * 3 + 3 + 1);
  EXPECT_EQ(shape_of(inv, "model.layers.1.mlp.shared_expert.up_proj.weight"), (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(shape_of(inv, "model.layers.1.mlp.shared_expert_gate.weight"), (std::vector<int64_t>{1, 64}));
  EXPECT_EQ(shape_of(inv, "model.layers.1.mlp.experts.3.down_proj.weight"), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(shape_of(inv, "model.layers.1.self_attn.q_proj.bias"), (std::vector<int64_t>{64}));
  EXPECT_EQ(find(inv, "model.layers.1.self_attn.q_norm.weight"), nullptr);
}

TEST(ModelConfig, DeepSeekWithoutQLora) {
  TempDir dir;
  dir.write("config.json", R"({"model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "q_lora_rank": null, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 4, "n_shared_experts": 2, "first_k_dense_replace": 1})");
  auto inv = inventory_from_hf_config(dir.str());
  EXPECT_EQ(shape_of(inv, "model.layers.0.self_attn.q_proj.weight"), (std::vector<int64_t>{4 * 24, 64}));
  EXPECT_EQ(find(inv, "model.layers.0.self_attn.q_a_proj.weight"), nullptr);
  EXPECT_EQ(shape_of(inv, "model.layers.1.self_attn.kv_b_proj.weight"), (std::vector<int64_t>{4 * 32, 32}));
  EXPECT_EQ(shape_of(inv, "model.layers.1.mlp.shared_experts.gate_proj.weight"), (std::vector<int64_t>{32, 64}));
  auto mlp = names_with_prefix(inv, "model.layers.1.mlp.");
  EXPECT_EQ(mlp[0], "experts.0.gate_proj.weight");
  EXPECT_EQ(mlp[12], "gate.weight");
  EXPECT_EQ(mlp[13], "gate.e_score_correction_bias");
}

TEST(ModelInventory, FingerprintStableAndSensitive) {
  auto a = load("refit-tiny-moe");
  auto b = load("refit-tiny-moe");
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  // Peers on different builds compare this value: a change here breaks their compatibility.
  EXPECT_EQ(a.fingerprint(), 0x276208268f51afa0u);
  EXPECT_NE(a.fingerprint(), load("qwen3-30b-a3b").fingerprint());

  auto renamed = a;
  renamed.tensors[5].name += "x";
  EXPECT_NE(renamed.fingerprint(), a.fingerprint());
  auto retyped = a;
  retyped.tensors[5].dtype = DType::kFloat16;
  EXPECT_NE(retyped.fingerprint(), a.fingerprint());
  auto reshaped = a;
  std::swap(reshaped.tensors[0].shape[0], reshaped.tensors[0].shape[1]);  // [32000, 1024]
  EXPECT_NE(reshaped.fingerprint(), a.fingerprint());
  auto reordered = a;
  std::swap(reordered.tensors[1], reordered.tensors[2]);
  EXPECT_NE(reordered.fingerprint(), a.fingerprint());
  auto shorter = a;
  shorter.tensors.pop_back();
  EXPECT_NE(shorter.fingerprint(), a.fingerprint());
  // Moving a character between name and shape boundaries must change the hash too.
  ModelInventory x{"x", {{"ab", DType::kUInt8, {1}}, {"c", DType::kUInt8, {1}}}};
  ModelInventory y{"y", {{"a", DType::kUInt8, {1}}, {"bc", DType::kUInt8, {1}}}};
  EXPECT_NE(x.fingerprint(), y.fingerprint());
  EXPECT_EQ(ModelInventory{}.fingerprint(), ModelInventory{}.fingerprint());
}

TEST(ModelConfig, Errors) {
  TempDir dir;
  expect_error([&] { inventory_from_hf_config(dir.file("nope.json")); }, ErrorKind::kModel, {dir.file("nope.json")});
  expect_error([&] { inventory_from_hf_config(dir.str()); }, ErrorKind::kModel, {"config.json"});

  auto bad = dir.write("bad.json", "{\"model_type\": \"llama\",");
  expect_error([&] { inventory_from_hf_config(bad); }, ErrorKind::kModel, {bad, "bad JSON"});

  auto array = dir.write("array.json", "[1, 2]");
  expect_error([&] { inventory_from_hf_config(array); }, ErrorKind::kModel, {array, "not a JSON object"});

  auto no_type = dir.write("no_type.json", R"({"vocab_size": 10})");
  expect_error([&] { inventory_from_hf_config(no_type); }, ErrorKind::kModel, {no_type, "'model_type'"});

  auto unsupported = dir.write("gpt2.json", R"({"model_type": "gpt2"})");
  expect_error([&] { inventory_from_hf_config(unsupported); }, ErrorKind::kModel,
               {unsupported, "'gpt2'", "llama", "qwen3_moe", "deepseek_v3"});

  auto missing = dir.write("missing.json", R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    "num_attention_heads": 2, "intermediate_size": 16})");
  expect_error([&] { inventory_from_hf_config(missing); }, ErrorKind::kModel,
               {missing, "missing key 'num_hidden_layers'"});

  auto ill = dir.write("ill.json", R"({"model_type": "qwen3", "vocab_size": "10", "hidden_size": 8})");
  expect_error([&] { inventory_from_hf_config(ill); }, ErrorKind::kModel, {ill, "'vocab_size'", "integer"});

  auto negative = dir.write("neg.json", R"({"model_type": "qwen3", "vocab_size": 10, "hidden_size": -8})");
  expect_error([&] { inventory_from_hf_config(negative); }, ErrorKind::kModel, {negative, "'hidden_size'"});

  auto dtype = dir.write("dtype.json", R"({"model_type": "llama", "torch_dtype": "complex64"})");
  expect_error([&] { inventory_from_hf_config(dtype); }, ErrorKind::kModel, {dtype, "'torch_dtype'", "complex64"});

  auto flag = dir.write("flag.json", R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16, "tie_word_embeddings": "yes"})");
  expect_error([&] { inventory_from_hf_config(flag); }, ErrorKind::kModel, {flag, "'tie_word_embeddings'", "boolean"});

  auto list = dir.write("list.json", R"({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 2, "moe_intermediate_size": 4,
    "mlp_only_layers": 3})");
  expect_error([&] { inventory_from_hf_config(list); }, ErrorKind::kModel, {list, "'mlp_only_layers'"});
}

TEST(ModelConfig, NewerDtypeKeyAndDefault) {
  TempDir dir;
  std::string base = R"("model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 16)";
  auto none = dir.write("none.json", "{" + base + "}");
  EXPECT_EQ(inventory_from_hf_config(none).tensors[0].dtype, DType::kBFloat16);
  auto newer = dir.write("newer.json", "{" + base + R"(, "dtype": "float32"})");
  EXPECT_EQ(inventory_from_hf_config(newer).tensors[0].dtype, DType::kFloat32);
}

// Writes every tensor of `inv` (zero-filled) into `n` shards named like HF's.
void write_shards(const ModelInventory& inv, const std::string& dir, size_t n) {
  size_t per = (inv.tensors.size() + n - 1) / n;
  for (size_t s = 0; s < n; ++s) {
    std::vector<SafetensorsEntry> entries;
    std::vector<std::byte> zeros(1 << 16);
    for (size_t i = s * per; i < std::min(inv.tensors.size(), (s + 1) * per); ++i)
      entries.push_back({inv.tensors[i], std::span(zeros).first(inv.tensors[i].nbytes())});
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, n);
    write_safetensors(dir + "/" + name, entries);
  }
}

TEST(ModelInventory, FromSafetensorsDirectory) {
  TempDir dir;
  ModelInventory small = inventory_from_hf_config(
      dir.write("small.json", R"({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "num_experts": 4, "moe_intermediate_size": 8})"));
  write_shards(small, dir.str(), 3);
  dir.write("README.md", "not a shard");

  auto inv = inventory_from_safetensors(dir.str());
  EXPECT_EQ(inv.name, fs::path(dir.str()).filename().string());
  EXPECT_EQ(inv.tensors, small.tensors);  // shards in file-name order, tensors in file order
  EXPECT_EQ(inv.fingerprint(), small.fingerprint());
  EXPECT_EQ(inventory_from_safetensors(dir.str() + "/").name, inv.name);

  auto one = inventory_from_safetensors(dir.file("model-00002-of-00003.safetensors"));
  EXPECT_EQ(one.name, "model-00002-of-00003");
  EXPECT_EQ(one.tensors.front(), small.tensors[(small.tensors.size() + 2) / 3]);

  // load_model_inventory: a directory of shards, a single shard, and a config beside them.
  EXPECT_EQ(load_model_inventory(dir.str()).tensors, small.tensors);
  EXPECT_EQ(load_model_inventory(dir.file("model-00001-of-00003.safetensors")).tensors.size(),
            (small.tensors.size() + 2) / 3);
  std::ofstream(dir.file("config.json")) << R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16})";
  EXPECT_EQ(load_model_inventory(dir.str()).name, "llama");
}

TEST(ModelInventory, FromSafetensorsErrors) {
  TempDir dir;
  expect_error([&] { inventory_from_safetensors(dir.str()); }, ErrorKind::kModel, {dir.str(), "no *.safetensors"});
  expect_error([&] { inventory_from_safetensors(dir.file("missing")); }, ErrorKind::kModel, {"does not exist"});
  // The same tensor in two shards.
  std::vector<std::byte> buf(4);
  SafetensorsEntry e{{"w", DType::kFloat32, {1}}, buf};
  write_safetensors(dir.file("a.safetensors"), {&e, 1});
  write_safetensors(dir.file("b.safetensors"), {&e, 1});
  expect_error([&] { inventory_from_safetensors(dir.str()); }, ErrorKind::kModel, {"'w'", "b.safetensors"});
}

TEST(ModelInventory, LoadDispatch) {
  auto by_dir = load_model_inventory(model_dir("qwen3-8b"));
  auto by_file = load_model_inventory(model_dir("qwen3-8b") + "/config.json");
  EXPECT_EQ(by_dir.tensors, by_file.tensors);
  EXPECT_EQ(by_dir.name, "qwen3");

  expect_error([&] { load_model_inventory("/nonexistent/refit/model"); }, ErrorKind::kModel,
               {"model path '/nonexistent/refit/model' does not exist"});
  TempDir dir;
  auto txt = dir.write("weights.bin", "x");
  expect_error([&] { load_model_inventory(txt); }, ErrorKind::kModel, {txt});
  expect_error([&] { load_model_inventory(dir.str()); }, ErrorKind::kModel, {dir.str()});
}

}  // namespace
}  // namespace refit
