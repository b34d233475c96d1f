// Building a destination's layout (layout.h) from the model and the destination's parallel
// sizes and ranks. Three parts, combined by build_layout:
//
//  * Sharded experts (the reference's `shard_expert_weights`, its compact VllmWeightLayout):
//    HF routed-expert tensors `<prefix>.mlp.experts.<e>.{gate,up,down}_proj.weight` map to the
//    vLLM 0.25 fused parameters `<prefix>.mlp.experts.routed_experts.{w13,w2}_weight`; a
//    destination gets only the experts it owns (EP), each narrowed to its TP rank (gate/up by
//    rows, dim 0; down by columns, dim 1). Beyond the reference, Mixtral's
//    `block_sparse_moe.experts.<e>.{w1,w3,w2}.weight` map the same way (w1 = gate, w3 = up,
//    w2 = down).
//  * Dense tensor parallelism (beyond the reference), as vLLM shards the model:
//      column-parallel, dim 0: q/k/v_proj (weight and bias), gate/up_proj (weight and bias) of
//        dense MLPs and shared experts, DeepSeek MLA q_proj/q_b_proj/kv_b_proj (by heads);
//      row-parallel, dim 1: o_proj, down_proj weights (their biases are replicated);
//      vocabulary-parallel, dim 0: embed_tokens and lm_head. vLLM pads the vocabulary to a
//        multiple of `vocab_padding` (64) and gives each rank ceil(padded / tp) rows; ranks past
//        the real vocabulary get the remainder (possibly zero rows) and the destination pads;
//      GQA with tp > num_key_value_heads: each KV head is replicated; rank r gets head
//        floor(r * num_kv_heads / tp) (vLLM needs tp % num_kv_heads == 0);
//      replicated (whole): norms (including qwen3 q_norm/k_norm and MLA's a-layernorms),
//        routers (mlp.gate, block_sparse_moe.gate, e_score_correction_bias,
//        shared_expert_gate), MLA q_a_proj and kv_a_proj_with_mqa.
//    Routed experts are not touched by dense TP: without shard_experts they go whole.
//  * FP8 scales (fp8.h) follow their weights: a sliced FP8 weight's "_scale_inv" gets the scale
//    blocks of its slice, a dropped weight's scale is dropped (add_fp8_scale_requests).
//  * Pipeline stages: the prefixes a stage lacks, as vLLM's get_pp_missing_layer_names gives
//    them ("model.layers.7.", "model.embed_tokens.", "model.norm.", "lm_head."), matched by
//    plain prefix.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/layout.h"
#include "refit/model.h"

namespace refit {

// ---- HF expert names ------------------------------------------------------------------------

enum class ExpertShard : uint8_t { kW1, kW3, kW2 };  // gate, up, down (vLLM shard ids)

struct HfExpertName {
  std::string prefix;  // "model.layers.3.mlp.experts"
  int64_t expert_id = 0;
  ExpertShard shard = ExpertShard::kW1;

  // "<prefix>.routed_experts.w13_weight" for w1/w3, "...w2_weight" for w2.
  std::string param_name() const;
  // The dim of the 2-D HF tensor that TP splits: 0 for gate/up, 1 for down.
  int32_t shard_dim() const { return shard == ExpertShard::kW2 ? 1 : 0; }
};

// Full-match parse (the reference's regex
// `^(?P<prefix>.+\.mlp\.experts)\.(?P<expert_id>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)\.weight$`,
// plus Mixtral's `.block_sparse_moe.experts.<e>.w1|w2|w3.weight`). Anything else, including
// biases, shared experts, fused gate_up_proj and ids past int64, is not an expert name.
std::optional<HfExpertName> parse_hf_expert_name(std::string_view name);

// ---- the reference's compact layout ----------------------------------------------------------

struct ExpertParamLayout {
  int tp_rank = 0;
  int tp_size = 1;
  // Global expert ids this destination owns, ascending; nullopt: all (no EP).
  std::optional<std::vector<int64_t>> local_expert_ids;
  bool operator==(const ExpertParamLayout&) const = default;
};

// The reference's VllmWeightLayout.
struct CompactLayout {
  std::map<std::string, ExpertParamLayout> expert_params;  // by vLLM parameter name
  std::vector<std::string> missing_weight_prefixes;
};

// The reference's select_hf_weight_for_vllm_target as a layout over `inventory`: names under a
// missing prefix are dropped; other non-expert names go whole; an expert whose parameter is not
// listed (another stage) or whose id is not owned is dropped; with tp_size > 1 an expert is
// narrowed along its shard dim. Throws Error(kLayout) "cannot shard <name> dimension <d> of
// size <n> across TP size <tp>" (naming `destination_rank`) when tp_size does not divide it.
Layout layout_from_compact(const CompactLayout& compact, const ModelInventory& inventory, int destination_rank);

// ---- expert ownership ------------------------------------------------------------------------

// vLLM's expert_map (global id -> local slot, -1 = elsewhere) to the owned global ids, ascending:
// [-1, 0, -1, 1] -> [1, 3]. Throws Error(kLayout) for entries < -1 or a slot used twice.
std::vector<int64_t> expert_ids_from_map(const std::vector<int64_t>& expert_map, int destination_rank);

// vLLM's default ("linear") placement: rank r of ep_size owns a contiguous block; the first
// num_experts % ep_size ranks get one more.
std::vector<int64_t> linear_expert_ids(int64_t num_experts, int ep_size, int ep_rank);

// ---- pipeline stages -------------------------------------------------------------------------

// Number of decoder layers: 1 + the largest N of "model.layers.N." in the inventory (0 if none).
int64_t decoder_layer_count(const ModelInventory& inventory);

// vLLM's get_pp_indices: layers split evenly; the L % pp leftover layers go one each to the
// stages before the last, counting back from the second-to-last (61 over 4: 15, 15, 16, 15),
// since the last stage also holds the final norm and lm_head.
// Returns [first, end) of stage `pp_rank`.
std::pair<int64_t, int64_t> pp_layer_range(int64_t num_layers, int pp_size, int pp_rank);

// The prefixes stage `pp_rank` lacks: other stages' layers, "model.embed_tokens." unless first
// (or last with tied embeddings, i.e. no lm_head), "model.norm." and "lm_head." unless last.
std::vector<std::string> pp_missing_prefixes(const ModelInventory& inventory, int pp_size, int pp_rank);

// ---- the entry point -------------------------------------------------------------------------

// Sizes the layout needs beyond tensor shapes (from config.json).
struct ModelDims {
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // 0: num_attention_heads
};
// Throws Error(kModel) naming the file and key.
ModelDims model_dims_from_hf_config(const std::string& path);

// How the destination is parallelized. Every field has a default that means "not split".
struct ModelParallel {
  int destination_rank = 0;  // names the destination in errors
  int tp_size = 1;
  int tp_rank = 0;
  int ep_size = 1;  // experts split over ep_size ranks by linear_expert_ids
  int ep_rank = 0;
  std::vector<int64_t> expert_map;    // if set, the destination's static vLLM expert_map; replaces ep_size/ep_rank
  std::optional<int> expert_tp_size;  // TP of routed experts; default: 1 with EP (as vLLM), else tp_size
  std::optional<int> expert_tp_rank;  // default: 0 with EP, else tp_rank
  int pp_size = 1;
  int pp_rank = 0;
  std::vector<std::string> missing_prefixes;  // added to the stage split's (e.g. vLLM's own list)
  bool shard_experts = false;  // select owned experts, TP-narrowed (the reference's shard_expert_weights)
  bool shard_dense = false;    // TP-narrow dense tensors
  int64_t vocab_padding = 64;  // vLLM's DEFAULT_VOCAB_PADDING_SIZE
};

// The destination's layout: dropped pipeline prefixes, sharded experts if shard_experts, dense
// TP if shard_dense; everything else whole. Throws Error(kLayout) naming the destination rank for
// invalid sizes/ranks, an expert map that does not fit the model, shard_dense without head
// counts, and sizes that do not divide (heads, KV heads, intermediate sizes).
Layout build_layout(const ModelInventory& inventory, const ModelDims& dims, const ModelParallel& parallel);
// Reads both from a config.json (file or directory).
Layout build_layout(const std::string& config_path, const ModelParallel& parallel);

// Gives every FP8 scale of `inventory` (fp8_scales_of) the request its weight's request needs
// (fp8_scale_request), so that a layout that slices FP8 weights holds or asks for exactly their
// scale blocks. build_layout, layout_from_compact and megatron_source_layouts end with it; a
// layout written by hand can call it. Throws Error(kLayout) naming `owner`, the weight and the
// scale block when a slice cuts through a block.
void add_fp8_scale_requests(Layout& layout, const ModelInventory& inventory, std::string_view owner);

// ---- the training side: source layouts -------------------------------------------------------
// A source's layout says what it holds (transfer_plan.h). These give every training rank's.

// Megatron-style parallelism: world = tp x dp x pp ranks, rank = tp_rank + tp * (dp_rank + dp *
// pp_rank) (Megatron's default order, tp fastest). Dense tensors split as build_layout splits them
// (column/row/vocabulary parallel; the vocabulary padded to a multiple of 128 x tp, as Megatron's
// make-vocab-size-divisible-by does); layers split over stages by pp_layer_range. Routed experts
// are split within a stage over its tp x dp ranks: expert-tp rank fastest, then the ep rank
// (contiguous blocks of experts, linear_expert_ids), the rest expert-data-parallel replicas. Ranks
// that differ only in dp_rank (and in the expert replica) hold identical slices: replicas.
struct TrainingParallel {
  int tp_size = 1;
  int pp_size = 1;
  int dp_size = 1;
  int ep_size = 1;
  std::optional<int> expert_tp_size;  // default: tp_size (Megatron's expert-tensor-parallel default)
};
// One layout per rank, by rank. Throws Error(kLayout) for sizes < 1, tp x dp not divisible by
// expert_tp x ep, ep not dividing the routed experts (as megatron-core asserts), tp above
// num_key_value_heads (Megatron's ranks then hold row blocks of the fused q/k/v that no layout
// names; checked against megatron-core, python/tests/test_megatron_layouts.py), or splits the
// model does not allow.
std::vector<Layout> megatron_source_layouts(const ModelInventory& inventory, const ModelDims& dims,
                                            const TrainingParallel& parallel);

// torch.distributed.tensor placements, one per device-mesh dim.
struct Placement {
  bool shard = false;  // Shard(dim); otherwise Replicate()
  int32_t dim = 0;
  static Placement replicate() { return {}; }
  static Placement shard_dim(int32_t dim) { return {true, dim}; }
};
// What the rank at `coordinate` of a mesh of `mesh_shape` holds of a tensor of `shape` placed
// with `placements`, as DTensor shards: each Shard(d), in mesh-dim order, splits the part held so
// far into mesh-size chunks of ceil(n / size) elements (the last ones smaller, possibly empty).
// Throws Error(kLayout) naming `tensor` for mismatched sizes or Shard of two different dims
// (a layout narrows one dim per tensor).
Request dtensor_request(std::string_view tensor, std::span<const int64_t> shape, std::span<const Placement> placements,
                        std::span<const int> mesh_shape, std::span<const int> coordinate);

// FSDP2 (fully_shard) over `world` ranks: every tensor Shard(0). The layout of `rank`.
Layout fsdp_source_layout(const ModelInventory& inventory, int world, int rank);

}  // namespace refit
