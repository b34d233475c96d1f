#include "refit/layout_builders.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "core/error_of.h"
#include "refit/error.h"
#include "refit/fp8.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string model_dir(const std::string& name) { return std::string(REFIT_DATA_DIR) + "/models/" + name; }

using testing::error_of;

const TensorInfo& find(const ModelInventory& inv, const std::string& name) {
  for (const auto& t : inv.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

// ---- HF expert names ------------------------------------------------------------------------

TEST(HfExpertName, MapsTheReferenceProjections) {
  auto gate = parse_hf_expert_name("model.layers.3.mlp.experts.17.gate_proj.weight");
  ASSERT_TRUE(gate);
  EXPECT_EQ(gate->prefix, "model.layers.3.mlp.experts");
  EXPECT_EQ(gate->expert_id, 17);
  EXPECT_EQ(gate->shard, ExpertShard::kW1);
  EXPECT_EQ(gate->shard_dim(), 0);
  EXPECT_EQ(gate->param_name(), "model.layers.3.mlp.experts.routed_experts.w13_weight");

  auto up = parse_hf_expert_name("model.layers.3.mlp.experts.0.up_proj.weight");
  ASSERT_TRUE(up);
  EXPECT_EQ(up->shard, ExpertShard::kW3);
  EXPECT_EQ(up->shard_dim(), 0);
  EXPECT_EQ(up->param_name(), "model.layers.3.mlp.experts.routed_experts.w13_weight");

  auto down = parse_hf_expert_name("model.layers.3.mlp.experts.255.down_proj.weight");
  ASSERT_TRUE(down);
  EXPECT_EQ(down->shard, ExpertShard::kW2);
  EXPECT_EQ(down->shard_dim(), 1);
  EXPECT_EQ(down->param_name(), "model.layers.3.mlp.experts.routed_experts.w2_weight");
}

TEST(HfExpertName, MapsMixtralNames) {
  auto w1 = parse_hf_expert_name("model.layers.0.block_sparse_moe.experts.7.w1.weight");
  auto w2 = parse_hf_expert_name("model.layers.0.block_sparse_moe.experts.7.w2.weight");
  auto w3 = parse_hf_expert_name("model.layers.0.block_sparse_moe.experts.7.w3.weight");
  ASSERT_TRUE(w1 && w2 && w3);
  EXPECT_EQ(w1->shard, ExpertShard::kW1);
  EXPECT_EQ(w2->shard, ExpertShard::kW2);
  EXPECT_EQ(w3->shard, ExpertShard::kW3);
  EXPECT_EQ(w1->expert_id, 7);
  EXPECT_EQ(w1->param_name(), "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight");
  EXPECT_EQ(w2->param_name(), "model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight");
}

TEST(HfExpertName, OtherNamesAreNotExperts) {
  for (const char* name : {
           "model.layers.3.mlp.experts.1.gate_proj.bias",         // bias
           "model.layers.3.mlp.shared_experts.gate_proj.weight",  // DeepSeek shared experts
           "model.layers.3.mlp.shared_expert.up_proj.weight",     // qwen2_moe shared expert
           "model.layers.3.mlp.experts.gate_up_proj",             // fused
           "model.layers.3.mlp.experts.gate_up_proj.weight",
           "model.layers.3.mlp.experts.1.gate_up_proj.weight",
           "model.layers.3.mlp.gate.weight",                       // router
           "model.layers.3.mlp.gate_proj.weight",                  // dense MLP
           "model.layers.3.mlp.experts.x1.gate_proj.weight",       // id not digits
           "model.layers.3.mlp.experts..gate_proj.weight",         // empty id
           "model.layers.3.mlp.experts.1.gate_proj.weight.extra",  // full match only
           ".mlp.experts.1.gate_proj.weight",                      // `.+` needs a character
           "mlp.experts.1.gate_proj.weight",
           "model.layers.3.mlp.experts.99999999999999999999.down_proj.weight",  // past int64
           "model.layers.0.block_sparse_moe.experts.7.w4.weight",
           "model.layers.0.block_sparse_moe.gate.weight",
           "model.layers.0.block_sparse_moe.experts.7.gate_proj.weight",
       })
    EXPECT_FALSE(parse_hf_expert_name(name)) << name;
  EXPECT_TRUE(parse_hf_expert_name("x.mlp.experts.0.gate_proj.weight"));
  EXPECT_EQ(parse_hf_expert_name("a.mlp.experts.b.mlp.experts.007.down_proj.weight")->prefix,
            "a.mlp.experts.b.mlp.experts");
  EXPECT_EQ(parse_hf_expert_name("a.mlp.experts.007.down_proj.weight")->expert_id, 7);
}

// ---- ownership and stages -------------------------------------------------------------------

TEST(ExpertOwnership, FromAStaticMap) {
  EXPECT_THAT(expert_ids_from_map({-1, 0, -1, 1}, 0), ElementsAre(1, 3));
  EXPECT_THAT(expert_ids_from_map({0, 1, 2, 3}, 0), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(expert_ids_from_map({-1, -1}, 0), ElementsAre());
  EXPECT_THAT(expert_ids_from_map({1, -1, 0}, 0), ElementsAre(0, 2));  // slots need not follow ids
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [] {
                         expert_ids_from_map({0, -2}, 4);
                       }),
              AllOf(HasSubstr("expert_map[1] is -2"), HasSubstr("destination rank 4")));
  EXPECT_THAT(error_of(ErrorKind::kLayout, [] { expert_ids_from_map({0, 0}, 4); }), HasSubstr("local slots"));
  EXPECT_THAT(error_of(ErrorKind::kLayout, [] { expert_ids_from_map({-1, 1}, 4); }), HasSubstr("local slots"));
}

TEST(ExpertOwnership, LinearPlacementAsVllm) {
  EXPECT_THAT(linear_expert_ids(16, 4, 1), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(linear_expert_ids(10, 4, 0), ElementsAre(0, 1, 2));
  EXPECT_THAT(linear_expert_ids(10, 4, 1), ElementsAre(3, 4, 5));
  EXPECT_THAT(linear_expert_ids(10, 4, 2), ElementsAre(6, 7));
  EXPECT_THAT(linear_expert_ids(10, 4, 3), ElementsAre(8, 9));
  error_of(ErrorKind::kLayout, [] { linear_expert_ids(10, 4, 4); });
}

TEST(Pipeline, LayerRangesFollowVllmGetPpIndices) {
  // vLLM: L // pp each; the L % pp leftovers go to the stages before the last.
  auto ranges = [](int64_t layers, int pp) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int r = 0; r < pp; ++r) out.push_back(pp_layer_range(layers, pp, r));
    return out;
  };
  using R = std::pair<int64_t, int64_t>;
  EXPECT_THAT(ranges(8, 2), ElementsAre(R{0, 4}, R{4, 8}));
  EXPECT_THAT(ranges(5, 2), ElementsAre(R{0, 3}, R{3, 5}));
  EXPECT_THAT(ranges(61, 4), ElementsAre(R{0, 15}, R{15, 30}, R{30, 46}, R{46, 61}));
  EXPECT_THAT(ranges(11, 4), ElementsAre(R{0, 3}, R{3, 6}, R{6, 9}, R{9, 11}));  // [3, 3, 3, 2]
  EXPECT_THAT(error_of(ErrorKind::kLayout, [] { pp_layer_range(3, 4, 0); }), HasSubstr("exceeds the 3 decoder layers"));
  error_of(ErrorKind::kLayout, [] { pp_layer_range(8, 2, 2); });
}

TEST(Pipeline, MissingPrefixesPerStage) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));  // 8 layers
  EXPECT_EQ(decoder_layer_count(inv), 8);
  EXPECT_THAT(pp_missing_prefixes(inv, 1, 0), ElementsAre());
  EXPECT_THAT(pp_missing_prefixes(inv, 2, 0), ElementsAre("model.layers.4.", "model.layers.5.", "model.layers.6.",
                                                          "model.layers.7.", "model.norm.", "lm_head."));
  EXPECT_THAT(pp_missing_prefixes(inv, 2, 1), ElementsAre("model.embed_tokens.", "model.layers.0.", "model.layers.1.",
                                                          "model.layers.2.", "model.layers.3."));
  EXPECT_THAT(pp_missing_prefixes(inv, 4, 1),
              ElementsAre("model.embed_tokens.", "model.layers.0.", "model.layers.1.", "model.layers.4.",
                          "model.layers.5.", "model.layers.6.", "model.layers.7.", "model.norm.", "lm_head."));
}

TEST(Pipeline, TiedEmbeddingsStayOnTheLastStage) {
  ModelInventory inv;
  inv.tensors = {{"model.embed_tokens.weight", DType::kBFloat16, {10, 4}},
                 {"model.layers.0.input_layernorm.weight", DType::kBFloat16, {4}},
                 {"model.layers.1.input_layernorm.weight", DType::kBFloat16, {4}},
                 {"model.norm.weight", DType::kBFloat16, {4}}};
  EXPECT_THAT(pp_missing_prefixes(inv, 2, 1), ElementsAre("model.layers.0."));
  EXPECT_THAT(pp_missing_prefixes(inv, 2, 0), ElementsAre("model.layers.1.", "model.norm."));
}

// 12 layers: stage 0 of 6 holds layers 0 and 1; "model.layers.10." and "model.layers.11." are
// missing but must not drop layer 1.
TEST(Pipeline, Layer1IsNotDroppedByLayer10sPrefix) {
  ModelInventory inv;
  for (int i = 0; i < 12; ++i)
    inv.tensors.push_back({fmt::format("model.layers.{}.mlp.down_proj.weight", i), DType::kBFloat16, {4, 4}});
  ModelParallel p;
  p.pp_size = 6;
  Layout l = build_layout(inv, {}, p);
  EXPECT_EQ(select(l, inv.tensors[1]).take, Take::kWhole);
  EXPECT_EQ(select(l, inv.tensors[10]).take, Take::kDrop);
  EXPECT_EQ(select(l, inv.tensors[11]).take, Take::kDrop);
  EXPECT_EQ(select(l, inv.tensors[2]).take, Take::kDrop);

  // And the reverse: a stage holding layers 10 and 11 lacks "model.layers.1.".
  p.pp_rank = 5;
  l = build_layout(inv, {}, p);
  EXPECT_EQ(select(l, inv.tensors[1]).take, Take::kDrop);
  EXPECT_EQ(select(l, inv.tensors[10]).take, Take::kWhole);
  EXPECT_EQ(select(l, inv.tensors[11]).take, Take::kWhole);
  validate_layout(l, inv, "destination rank 5");
}

TEST(Pipeline, KvScalesOfMissingLayersAreDropped) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));
  ModelParallel p;
  p.pp_size = 2;
  p.pp_rank = 1;
  Layout l = build_layout(inv, {}, p);
  auto scales = kv_scale_tensors(decoder_layer_count(inv), {});
  for (const auto& t : scales.tensors) {
    bool missing = t.name.starts_with("model.layers.0.") || t.name.starts_with("model.layers.1.") ||
                   t.name.starts_with("model.layers.2.") || t.name.starts_with("model.layers.3.");
    EXPECT_EQ(select(l, t).take, missing ? Take::kDrop : Take::kWhole) << t.name;
  }
}

// ---- the reference's compact layout ----------------------------------------------------------

TEST(CompactLayout, SelectsAsTheReference) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));  // experts [256, 1024] / [1024, 256]
  CompactLayout c;
  c.missing_weight_prefixes = {"model.layers.7."};
  // Layer 0: tp 2 rank 1, experts [1, 3]; layer 1: all experts, tp 1; other layers unlisted.
  c.expert_params["model.layers.0.mlp.experts.routed_experts.w13_weight"] = {1, 2, std::vector<int64_t>{1, 3}};
  c.expert_params["model.layers.0.mlp.experts.routed_experts.w2_weight"] = {1, 2, std::vector<int64_t>{1, 3}};
  c.expert_params["model.layers.1.mlp.experts.routed_experts.w13_weight"] = {0, 1, std::nullopt};
  c.expert_params["model.layers.1.mlp.experts.routed_experts.w2_weight"] = {0, 1, std::nullopt};
  Layout l = layout_from_compact(c, inv, 0);
  validate_layout(l, inv, "destination rank 0");

  auto sel = [&](const std::string& name) { return select(l, find(inv, name)); };
  Selection s = sel("model.layers.0.mlp.experts.1.gate_proj.weight");
  EXPECT_EQ(s.take, Take::kSlice);
  EXPECT_EQ(s.slice, (Slice{0, 128, 128}));
  EXPECT_EQ(s.info.shape, (std::vector<int64_t>{128, 1024}));
  EXPECT_EQ(sel("model.layers.0.mlp.experts.3.up_proj.weight").slice, (Slice{0, 128, 128}));
  s = sel("model.layers.0.mlp.experts.3.down_proj.weight");
  EXPECT_EQ(s.slice, (Slice{1, 128, 128}));
  EXPECT_EQ(s.info.shape, (std::vector<int64_t>{1024, 128}));
  EXPECT_EQ(sel("model.layers.0.mlp.experts.0.gate_proj.weight").take, Take::kDrop);  // not owned
  EXPECT_EQ(sel("model.layers.0.mlp.experts.2.down_proj.weight").take, Take::kDrop);
  EXPECT_EQ(sel("model.layers.1.mlp.experts.5.down_proj.weight").take, Take::kWhole);  // tp 1
  EXPECT_EQ(sel("model.layers.2.mlp.experts.5.down_proj.weight").take, Take::kDrop);   // unlisted parameter
  EXPECT_EQ(sel("model.layers.2.self_attn.q_proj.weight").take, Take::kWhole);         // not an expert
  EXPECT_EQ(sel("model.layers.2.mlp.gate.weight").take, Take::kWhole);
  EXPECT_EQ(sel("model.layers.7.self_attn.q_proj.weight").take, Take::kDrop);  // missing prefix
  EXPECT_EQ(sel("model.layers.7.mlp.experts.1.gate_proj.weight").take, Take::kDrop);
}

TEST(CompactLayout, NonDivisibleTpIsAnError) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));
  CompactLayout c;
  c.expert_params["model.layers.0.mlp.experts.routed_experts.w13_weight"] = {0, 3, std::nullopt};
  EXPECT_THAT(
      error_of(ErrorKind::kLayout, [&] { layout_from_compact(c, inv, 6); }),
      AllOf(HasSubstr("Cannot shard model.layers.0.mlp.experts.0.gate_proj.weight dimension 0 of size 256 across "
                      "TP size 3"),
            HasSubstr("destination rank 6")));
  c.expert_params.begin()->second = {3, 2, std::nullopt};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { layout_from_compact(c, inv, 6); }), HasSubstr("tp_rank 3"));
}

// ---- build_layout: experts -------------------------------------------------------------------

TEST(BuildLayout, ShardedExpertsTpOnly) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));
  ModelParallel p;
  p.tp_size = 4;
  p.tp_rank = 2;
  p.shard_experts = true;
  Layout l = build_layout(inv, {}, p);
  validate_layout(l, inv, "destination rank 0");
  EXPECT_EQ(select(l, find(inv, "model.layers.5.mlp.experts.9.up_proj.weight")).slice, (Slice{0, 128, 64}));
  EXPECT_EQ(select(l, find(inv, "model.layers.5.mlp.experts.9.down_proj.weight")).slice, (Slice{1, 128, 64}));
  // Dense tensors go whole without shard_dense.
  EXPECT_EQ(select(l, find(inv, "model.layers.5.self_attn.q_proj.weight")).take, Take::kWhole);
  auto sum = layout_bytes(l, inv);
  EXPECT_EQ(sum.dropped, 0u);
  EXPECT_EQ(sum.sliced, 8u * 16 * 3);
}

TEST(BuildLayout, ShardedExpertsWithEpUseNoExpertTpByDefault) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));
  ModelParallel p;
  p.tp_size = 4;
  p.tp_rank = 1;
  p.ep_size = 4;
  p.ep_rank = 1;
  p.shard_experts = true;
  Layout l = build_layout(inv, {}, p);
  for (int e = 0; e < 16; ++e) {
    auto name = fmt::format("model.layers.3.mlp.experts.{}.gate_proj.weight", e);
    EXPECT_EQ(select(l, find(inv, name)).take, e >= 4 && e < 8 ? Take::kWhole : Take::kDrop) << name;
  }
  // Both EP and intra-expert TP, when asked for: EP filters first, then TP narrows.
  p.expert_tp_size = 2;
  p.expert_tp_rank = 1;
  l = build_layout(inv, {}, p);
  EXPECT_EQ(select(l, find(inv, "model.layers.3.mlp.experts.5.gate_proj.weight")).slice, (Slice{0, 128, 128}));
  EXPECT_EQ(select(l, find(inv, "model.layers.3.mlp.experts.9.gate_proj.weight")).take, Take::kDrop);
}

TEST(BuildLayout, ShardedExpertsFromAStaticMap) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));
  ModelParallel p;
  p.shard_experts = true;
  p.expert_map.assign(16, -1);
  p.expert_map[1] = 0;
  p.expert_map[3] = 1;
  p.expert_map[14] = 2;
  Layout l = build_layout(inv, {}, p);
  for (int e = 0; e < 16; ++e) {
    auto name = fmt::format("model.layers.0.mlp.experts.{}.down_proj.weight", e);
    EXPECT_EQ(select(l, find(inv, name)).take, e == 1 || e == 3 || e == 14 ? Take::kWhole : Take::kDrop) << name;
  }
  p.expert_map.resize(8);
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { build_layout(inv, {}, p); }),
              AllOf(HasSubstr("expert_map has 8 entries"), HasSubstr("16 routed experts")));
}

TEST(BuildLayout, ShardedMixtralExperts) {
  auto inv = inventory_from_hf_config(model_dir("mixtral-8x7b"));  // 8 experts, I 14336, H 4096
  ModelParallel p;
  p.tp_size = 2;
  p.tp_rank = 1;
  p.ep_size = 1;
  p.shard_experts = true;
  Layout l = build_layout(inv, {}, p);
  validate_layout(l, inv, "destination rank 0");
  EXPECT_EQ(select(l, find(inv, "model.layers.31.block_sparse_moe.experts.7.w1.weight")).slice, (Slice{0, 7168, 7168}));
  EXPECT_EQ(select(l, find(inv, "model.layers.31.block_sparse_moe.experts.7.w3.weight")).slice, (Slice{0, 7168, 7168}));
  EXPECT_EQ(select(l, find(inv, "model.layers.31.block_sparse_moe.experts.7.w2.weight")).slice, (Slice{1, 7168, 7168}));
  EXPECT_EQ(select(l, find(inv, "model.layers.31.block_sparse_moe.gate.weight")).take, Take::kWhole);
}

TEST(BuildLayout, ShardExpertsOnADenseModelOnlyFiltersStages) {
  auto inv = inventory_from_hf_config(model_dir("llama-3.1-8b"));
  ModelParallel p;
  p.tp_size = 2;
  p.shard_experts = true;
  EXPECT_TRUE(build_layout(inv, {}, p).tensors.empty());
}

TEST(BuildLayout, InvalidSizesAndRanks) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));
  auto build = [&](auto edit) {
    ModelParallel p;
    p.destination_rank = 9;
    edit(p);
    return error_of(ErrorKind::kLayout, [&] { build_layout(inv, {8, 4}, p); });
  };
  EXPECT_THAT(build([](ModelParallel& p) { p.tp_size = 0; }),
              AllOf(HasSubstr("tp rank"), HasSubstr("destination rank 9")));
  EXPECT_THAT(build([](ModelParallel& p) { p.tp_size = 2, p.tp_rank = 2; }), HasSubstr("tp rank 2 is not in [0, 2)"));
  EXPECT_THAT(build([](ModelParallel& p) { p.tp_rank = -1; }), HasSubstr("tp rank -1"));
  EXPECT_THAT(build([](ModelParallel& p) { p.ep_size = 4, p.ep_rank = 4; }), HasSubstr("ep rank 4"));
  EXPECT_THAT(build([](ModelParallel& p) { p.pp_size = 2, p.pp_rank = 5; }), HasSubstr("pp rank 5"));
  EXPECT_THAT(build([](ModelParallel& p) { p.pp_size = 9; }), HasSubstr("exceeds the 8 decoder layers"));
  EXPECT_THAT(build([](ModelParallel& p) { p.shard_experts = true, p.expert_tp_size = 2, p.expert_tp_rank = 3; }),
              HasSubstr("expert tp rank 3"));
  EXPECT_THAT(build([](ModelParallel& p) { p.shard_experts = true, p.tp_size = 3; }),
              AllOf(HasSubstr("Cannot shard"), HasSubstr("dimension 0 of size 256 across TP size 3")));
  EXPECT_THAT(build([](ModelParallel& p) { p.vocab_padding = 0; }), HasSubstr("vocab_padding"));
  ModelParallel p;
  p.tp_size = 2;
  p.shard_dense = true;
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { build_layout(inv, {}, p); }), HasSubstr("num_attention_heads"));
}

// ---- build_layout: dense TP ------------------------------------------------------------------

TEST(ModelDims, FromConfig) {
  auto d = model_dims_from_hf_config(model_dir("qwen2.5-7b"));
  EXPECT_EQ(d.num_attention_heads, 28);
  EXPECT_EQ(d.num_key_value_heads, 4);
  EXPECT_EQ(error_of(ErrorKind::kModel, [] { model_dims_from_hf_config("/nonexistent/config.json"); }).empty(), false);
}

// Per tensor, how the tp ranks' requests relate to the full tensor.
struct Coverage {
  bool replicated = false;  // every rank whole
  int32_t dim = -1;
  int copies = 0;  // how many ranks hold each element along `dim` (1, or tp / kv for KV heads)
};

// Checks that the ranks' slices of `t` tile its sliced dimension `copies` times and returns it.
Coverage coverage(const TensorInfo& t, const std::vector<Layout>& layouts) {
  Coverage c;
  std::vector<Selection> sel;
  for (const auto& l : layouts) sel.push_back(select(l, t));
  if (std::all_of(sel.begin(), sel.end(), [](const Selection& s) { return s.take == Take::kWhole; })) {
    c.replicated = true;
    return c;
  }
  for (const auto& s : sel) {
    EXPECT_EQ(s.take, Take::kSlice) << t.name;
    if (s.take != Take::kSlice) return c;
    if (c.dim < 0) c.dim = s.slice.dim;
    EXPECT_EQ(s.slice.dim, c.dim) << t.name;
  }
  std::vector<int> count(t.shape[c.dim], 0);
  for (const auto& s : sel)
    for (int64_t i = s.slice.start; i < s.slice.start + s.slice.length; ++i) ++count[i];
  c.copies = count[0];
  for (size_t i = 0; i < count.size(); ++i) {
    EXPECT_EQ(count[i], c.copies) << t.name << " index " << i;
    if (count[i] != c.copies) break;
  }
  return c;
}

std::vector<Layout> tp_layouts(const ModelInventory& inv, const ModelDims& dims, int tp) {
  std::vector<Layout> out;
  for (int r = 0; r < tp; ++r) {
    ModelParallel p;
    p.tp_size = tp;
    p.tp_rank = r;
    p.destination_rank = r;
    p.shard_dense = true;
    out.push_back(build_layout(inv, dims, p));
    validate_layout(out.back(), inv, fmt::format("destination rank {}", r));
  }
  return out;
}

bool ends(const std::string& s, std::initializer_list<const char*> suffixes) {
  return std::any_of(suffixes.begin(), suffixes.end(), [&](const char* x) { return s.ends_with(x); });
}

// Every family in data/models, tp 2/4/8: column-parallel tensors tile dim 0 once, row-parallel
// ones dim 1, KV projections are replicated tp / kv times when tp > kv, the rest is replicated.
TEST(DenseTp, EveryModelTilesExactlyOnce) {
  for (const char* model : {"llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "refit-tiny-moe",
                            "refit-bench-2g", "deepseek-v3-mini", "deepseek-v3"}) {
    auto inv = inventory_from_hf_config(model_dir(model));
    auto dims = model_dims_from_hf_config(model_dir(model));
    for (int tp : {2, 4, 8}) {
      SCOPED_TRACE(fmt::format("{} tp={}", model, tp));
      if (dims.num_attention_heads % tp != 0) {  // qwen2.5-7b: 28 heads
        EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { tp_layouts(inv, dims, tp); }),
                    AllOf(HasSubstr("num_attention_heads 28 is not divisible by TP size 8"), HasSubstr("q_proj")));
        continue;
      }
      auto layouts = tp_layouts(inv, dims, tp);
      const int64_t kv = dims.num_key_value_heads;
      int checked = 0;
      for (const auto& t : inv.tensors) {
        if (parse_hf_expert_name(t.name)) {
          EXPECT_TRUE(coverage(t, layouts).replicated) << t.name;  // routed experts: not dense TP
          continue;
        }
        Coverage c = coverage(t, layouts);
        const auto& n = t.name;
        if (ends(n, {".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias"})) {
          EXPECT_EQ(c.dim, 0) << n;
          EXPECT_EQ(c.copies, tp > kv ? tp / kv : 1) << n;
        } else if (ends(n, {".q_proj.weight", ".q_proj.bias", ".q_b_proj.weight", ".kv_b_proj.weight",
                            ".gate_proj.weight", ".up_proj.weight", "embed_tokens.weight", "lm_head.weight"})) {
          EXPECT_EQ(c.dim, 0) << n;
          EXPECT_EQ(c.copies, 1) << n;
        } else if (ends(n, {".o_proj.weight", ".down_proj.weight"})) {
          EXPECT_EQ(c.dim, 1) << n;
          EXPECT_EQ(c.copies, 1) << n;
        } else {
          EXPECT_TRUE(c.replicated) << n;  // norms, routers, MLA a-projections, biases of row-parallel layers
        }
        if (++checked > 4000) break;  // deepseek-v3: the first layers show every kind
      }
    }
  }
}

TEST(DenseTp, GqaHeadsAreReplicatedByRank) {
  auto inv = inventory_from_hf_config(model_dir("refit-tiny-moe"));  // 8 heads, 4 KV heads of 128
  auto layouts = tp_layouts(inv, {8, 4}, 8);
  const auto& k = find(inv, "model.layers.0.self_attn.k_proj.weight");  // [512, 1024]
  for (int r = 0; r < 8; ++r) {
    int64_t head = r * 4 / 8;
    EXPECT_EQ(select(layouts[r], k).slice, (Slice{0, head * 128, 128})) << r;
  }
  // tp == kv: one head each, no replication.
  layouts = tp_layouts(inv, {8, 4}, 4);
  EXPECT_EQ(select(layouts[3], k).slice, (Slice{0, 384, 128}));
  // tp not a multiple of kv when tp > kv.
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [&] {
                         tp_layouts(inv, {8, 3}, 8);
                       }),
              AllOf(HasSubstr("k_proj"), HasSubstr("not a multiple of num_key_value_heads 3")));
}

TEST(DenseTp, SpecificTensorsOfEachFamily) {
  {
    auto inv = inventory_from_hf_config(model_dir("qwen2.5-7b"));  // q/k/v biases
    auto l = tp_layouts(inv, model_dims_from_hf_config(model_dir("qwen2.5-7b")), 4)[1];
    EXPECT_EQ(select(l, find(inv, "model.layers.0.self_attn.q_proj.bias")).slice, (Slice{0, 896, 896}));
    EXPECT_EQ(select(l, find(inv, "model.layers.0.self_attn.k_proj.bias")).slice, (Slice{0, 128, 128}));
    EXPECT_EQ(select(l, find(inv, "model.layers.0.mlp.down_proj.weight")).slice, (Slice{1, 4736, 4736}));
  }
  {
    auto inv = inventory_from_hf_config(model_dir("qwen3-8b"));
    auto l = tp_layouts(inv, model_dims_from_hf_config(model_dir("qwen3-8b")), 2)[0];
    EXPECT_EQ(select(l, find(inv, "model.layers.0.self_attn.q_norm.weight")).take, Take::kWhole);
    EXPECT_EQ(select(l, find(inv, "model.layers.0.self_attn.k_norm.weight")).take, Take::kWhole);
    EXPECT_EQ(select(l, find(inv, "model.layers.0.input_layernorm.weight")).take, Take::kWhole);
    EXPECT_EQ(select(l, find(inv, "model.norm.weight")).take, Take::kWhole);
    EXPECT_EQ(select(l, find(inv, "lm_head.weight")).slice, (Slice{0, 0, 75968}));
  }
  {
    auto inv = inventory_from_hf_config(model_dir("deepseek-v3-mini"));
    auto l = tp_layouts(inv, model_dims_from_hf_config(model_dir("deepseek-v3-mini")), 4)[3];
    auto take = [&](const std::string& n) { return select(l, find(inv, n)).take; };
    EXPECT_EQ(take("model.layers.1.self_attn.q_a_proj.weight"), Take::kWhole);
    EXPECT_EQ(take("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"), Take::kWhole);
    EXPECT_EQ(take("model.layers.1.self_attn.q_a_layernorm.weight"), Take::kWhole);
    EXPECT_EQ(take("model.layers.1.self_attn.kv_a_layernorm.weight"), Take::kWhole);
    EXPECT_EQ(take("model.layers.1.mlp.gate.weight"), Take::kWhole);
    EXPECT_EQ(take("model.layers.1.mlp.gate.e_score_correction_bias"), Take::kWhole);
    const auto& q_b = find(inv, "model.layers.1.self_attn.q_b_proj.weight");
    EXPECT_EQ(select(l, q_b).slice, (Slice{0, q_b.shape[0] / 4 * 3, q_b.shape[0] / 4}));
    EXPECT_EQ(select(l, find(inv, "model.layers.1.self_attn.o_proj.weight")).slice.dim, 1);
    EXPECT_EQ(select(l, find(inv, "model.layers.1.mlp.shared_experts.gate_proj.weight")).slice, (Slice{0, 192, 64}));
    EXPECT_EQ(select(l, find(inv, "model.layers.1.mlp.shared_experts.down_proj.weight")).slice, (Slice{1, 192, 64}));
    EXPECT_EQ(take("model.layers.1.mlp.experts.3.gate_proj.weight"), Take::kWhole);
  }
}

// A vocabulary that does not divide: vLLM pads to a multiple of 64 and splits evenly; the
// last ranks get what is left.
TEST(DenseTp, VocabularyRemainder) {
  ModelInventory inv;
  inv.tensors = {{"model.embed_tokens.weight", DType::kBFloat16, {1000, 8}},
                 {"lm_head.weight", DType::kBFloat16, {1000, 8}}};
  auto rows = [&](int tp, int64_t padding) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int r = 0; r < tp; ++r) {
      ModelParallel p;
      p.tp_size = tp;
      p.tp_rank = r;
      p.shard_dense = true;
      p.vocab_padding = padding;
      Layout l = build_layout(inv, {tp, tp}, p);
      Selection s = select(l, inv.tensors.back());  // lm_head
      EXPECT_EQ(s.slice, select(l, inv.tensors.front()).slice);
      out.push_back({s.slice.start, s.info.shape[0]});
    }
    return out;
  };
  using R = std::pair<int64_t, int64_t>;
  EXPECT_THAT(rows(3, 64), ElementsAre(R{0, 342}, R{342, 342}, R{684, 316}));  // padded 1024
  EXPECT_THAT(rows(3, 1), ElementsAre(R{0, 334}, R{334, 334}, R{668, 332}));
  EXPECT_THAT(rows(8, 64), ElementsAre(R{0, 128}, R{128, 128}, R{256, 128}, R{384, 128}, R{512, 128}, R{640, 128},
                                       R{768, 128}, R{896, 104}));
  inv.tensors = {{"lm_head.weight", DType::kBFloat16, {100, 8}}};  // padded 128: 16 per rank
  auto r = rows(8, 64);
  EXPECT_EQ(r[5], (R{80, 16}));
  EXPECT_EQ(r[6], (R{96, 4}));
  EXPECT_EQ(r[7], (R{100, 0}));  // nothing left: a zero-row slice
}

TEST(DenseTp, NonDivisibleIntermediateIsAnError) {
  ModelInventory inv;
  inv.tensors = {{"model.layers.0.mlp.gate_proj.weight", DType::kBFloat16, {30, 8}}};
  ModelParallel p;
  p.tp_size = 4;
  p.shard_dense = true;
  p.destination_rank = 2;
  EXPECT_THAT(
      error_of(ErrorKind::kLayout,
               [&] {
                 build_layout(inv, {4, 4}, p);
               }),
      AllOf(HasSubstr("Cannot shard model.layers.0.mlp.gate_proj.weight dimension 0 of size 30 across TP size 4"),
            HasSubstr("destination rank 2")));
}

TEST(BuildLayout, EverythingTogetherValidatesAndRoundTrips) {
  auto inv = inventory_from_hf_config(model_dir("deepseek-v3-mini"));
  ModelParallel p;
  p.tp_size = 4;
  p.tp_rank = 1;
  p.ep_size = 4;
  p.ep_rank = 2;
  p.pp_size = 2;
  p.pp_rank = 1;
  p.shard_experts = true;
  p.shard_dense = true;
  Layout l = build_layout(model_dir("deepseek-v3-mini"), p);
  validate_layout(l, inv, "destination rank 1");
  EXPECT_EQ(decode_layout(encode_layout(l)), l);
  auto sum = layout_bytes(l, inv);
  EXPECT_GT(sum.dropped, 0u);
  EXPECT_GT(sum.sliced, 0u);
  EXPECT_LT(sum.bytes, inv.total_bytes() / 4);
  EXPECT_EQ(select(l, find(inv, "model.layers.6.mlp.experts.9.gate_proj.weight")).take,
            Take::kWhole);  // ep 2 owns 8..11
  EXPECT_EQ(select(l, find(inv, "model.layers.6.mlp.experts.4.gate_proj.weight")).take, Take::kDrop);
  EXPECT_EQ(select(l, find(inv, "model.layers.1.mlp.experts.9.gate_proj.weight")).take, Take::kDrop);  // stage 0
  EXPECT_EQ(select(l, find(inv, "model.layers.6.self_attn.kv_b_proj.weight")).take, Take::kSlice);
}

}  // namespace
}  // namespace refit
