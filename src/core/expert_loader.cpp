#include "refit/expert_loader.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "core/fail.h"
#include "refit/fp8.h"

namespace refit {
namespace {

constexpr std::string_view kScaleSuffix = "_scale_inv";

// A fused parameter's name without the "_scale_inv" of its block scales.
std::string_view weight_of(std::string_view name) {
  return name.ends_with(kScaleSuffix) ? name.substr(0, name.size() - kScaleSuffix.size()) : name;
}
bool is_w13(std::string_view name) { return weight_of(name).ends_with(".w13_weight"); }
bool is_w2(std::string_view name) { return weight_of(name).ends_with(".w2_weight"); }
bool is_scale(std::string_view name) { return name.ends_with(kScaleSuffix); }
bool is_fp8(DType dtype) { return dtype == DType::kFloat8E4M3FN || dtype == DType::kFloat8E5M2; }

// Rows of `width` bytes from src (pitch spitch) to dst (pitch dpitch); one memcpy when both
// sides are dense.
void copy2d(std::byte* dst, uint64_t dpitch, const std::byte* src, uint64_t spitch, uint64_t width, uint64_t height) {
  if (width == 0 || height == 0) return;
  if (width == dpitch && width == spitch) {
    std::memcpy(dst, src, width * height);
    return;
  }
  for (uint64_t i = 0; i < height; ++i) std::memcpy(dst + i * dpitch, src + i * spitch, width);
}

}  // namespace

CompactLayout expert_layout_from_storage(std::span<const ExpertStorage> storage, int destination_rank) {
  const int dest = destination_rank;
  CompactLayout out;
  for (const auto& p : storage) {
    const std::string& name = p.name;
    if (is_scale(name)) continue;  // block scales follow their weights (layout_from_compact)
    if (!is_w13(name) && !is_w2(name))
      fail(ErrorKind::kLayout,
           "destination rank {}: expert storage '{}' is not a fused expert parameter (.w13_weight or .w2_weight)", dest,
           name);
    if (p.transposed)  // V31
      fail(ErrorKind::kUnsupported,
           "Sharded expert refit requires canonical expert-weight orientation, but {} is transposed (destination rank "
           "{}).",
           name, dest);
    if (!p.loader_inspectable)  // V32
      fail(ErrorKind::kLayout, "Could not inspect the vLLM expert weight loader for {} (destination rank {}).", name,
           dest);
    if (p.shape.size() != 3 || (is_w13(name) && p.shape[1] % 2 != 0) ||
        std::any_of(p.shape.begin(), p.shape.end(), [](int64_t d) { return d < 0; }))  // V33
      fail(ErrorKind::kLayout, "Unsupported vLLM expert storage for {}: shape={} (destination rank {}); expected {}.",
           name, shape_string(p.shape), dest, is_w13(name) ? "[E_local, 2*I/tp, H]" : "[E_local, H, I/tp]");
    // V34, but for block-scaled FP8 experts (float8_e4m3fn with their "_scale_inv" storage, checked
    // by the loader): their bytes and scales are copied like unquantized ones.
    const bool fp8 = p.quant_method == "fp8" && p.dtype == DType::kFloat8E4M3FN;
    if ((!p.quant_method.empty() && !fp8) || (p.moe_backend != "TRITON" && p.moe_backend != "BATCHED_TRITON"))
      fail(ErrorKind::kUnsupported,
           "Sharded expert refit requires canonical unquantized Triton expert weights, but {} uses {}/{} "
           "(destination rank {}). Set policy.generation.vllm_kwargs.moe_backend=triton.",
           name, p.quant_method.empty() ? "unquantized" : p.quant_method, p.moe_backend, dest);
    ExpertParamLayout e;
    if (p.use_ep) {
      if (p.eplb)  // V35
        fail(ErrorKind::kUnsupported,
             "Sharded refit does not support dynamic vLLM expert load balancing (EPLB), which moves experts between "
             "ranks; "
             "{} on destination rank {} has it enabled.",
             name, dest);
      if (!p.expert_map)  // V36
        fail(ErrorKind::kLayout, "vLLM reports EP for {} without an expert ownership map (destination rank {}).", name,
             dest);
      const auto map_size = static_cast<int64_t>(p.expert_map->size());
      const int64_t logical = p.num_logical_experts > 0 ? p.num_logical_experts : map_size;
      const int64_t global = p.global_num_experts > 0 ? p.global_num_experts : logical;
      if (logical != global)  // V37
        fail(ErrorKind::kUnsupported,
             "Sharded refit does not support redundant vLLM experts: {} has {} logical and {} physical experts "
             "(destination rank {}).",
             name, logical, global, dest);
      if (logical > map_size)
        fail(ErrorKind::kLayout, "destination rank {}: expert map of {} has {} entries for {} logical experts", dest,
             name, map_size, logical);
      std::vector<int64_t> ids;
      for (int64_t g = 0; g < logical; ++g)
        if ((*p.expert_map)[g] >= 0) ids.push_back(g);
      e.local_expert_ids = std::move(ids);
    }
    if (p.tp_size < 1 || p.tp_rank < 0 || p.tp_rank >= p.tp_size)
      fail(ErrorKind::kLayout, "destination rank {}: expert storage {} has tp_rank {} outside [0, tp_size {})", dest,
           name, p.tp_rank, p.tp_size);
    e.tp_rank = p.tp_rank;
    e.tp_size = p.tp_size;
    if (!out.expert_params.emplace(name, std::move(e)).second)
      fail(ErrorKind::kLayout, "destination rank {}: expert storage {} is listed twice", dest, name);
  }
  // V38: the source maps HF names to ".routed_experts." parameters only; others would never be
  // written and would keep serving stale experts.
  std::vector<std::string> odd;
  for (const auto& [name, e] : out.expert_params)
    if (name.find(".routed_experts.") == std::string::npos) odd.push_back(name);
  if (!odd.empty()) {
    odd.resize(std::min<size_t>(odd.size(), 3));
    fail(ErrorKind::kLayout,
         "vLLM expert parameters are not under the expected '.routed_experts.' submodule (saw {}) on destination rank "
         "{}; "
         "refit would silently skip them, leaving the engine serving stale experts.",
         fmt::join(odd, ", "), dest);
  }
  return out;
}

ExpertLoader::ExpertLoader(const ModelInventory& inventory, std::vector<ExpertStorage> storage, int destination_rank)
    : destination_rank_(destination_rank) {
  expert_layout_from_storage(storage, destination_rank);
  // FP8 experts come with their block scales: a weight without its scale storage would load with
  // stale scales, and a scale storage needs its FP8 weight (the loader places both alike).
  auto find = [&](std::string_view name) {
    return std::find_if(storage.begin(), storage.end(), [&](const ExpertStorage& x) { return x.name == name; });
  };
  for (const auto& s : storage) {
    if (is_scale(s.name)) {
      auto w = find(weight_of(s.name));
      if (w == storage.end() || !is_fp8(w->dtype) || !(is_w13(s.name) || is_w2(s.name)))
        fail(ErrorKind::kLayout, "destination rank {}: expert scale storage {} has no FP8 expert weight {}",
             destination_rank, s.name, weight_of(s.name));
      // The block scales of each slot's weights: for w13 of its gate half, then of its up half.
      const bool w13 = is_w13(s.name);
      std::vector<int64_t> expected;
      if (w->shape.size() == 3) {
        const int64_t rows = w13 ? w->shape[1] / 2 : w->shape[1];
        expected = fp8_scale_shape(TensorInfo{w->name, w->dtype, {rows, w->shape[2]}}, Fp8Scaling::kBlock128);
        expected.insert(expected.begin(), w->shape[0]);
        if (w13) expected[1] *= 2;
      }
      if (s.dtype != DType::kFloat32 || s.shape != expected)
        fail(ErrorKind::kLayout,
             "destination rank {}: expert scale storage {} is {} {}; the 128 x 128 block scales of {} {} are float32 "
             "{}",
             destination_rank, s.name, dtype_name(s.dtype), shape_string(s.shape), w->name, shape_string(w->shape),
             shape_string(expected));
      continue;
    }
    if (is_fp8(s.dtype) && find(s.name + std::string(kScaleSuffix)) == storage.end())
      fail(ErrorKind::kUnsupported,
           "destination rank {}: FP8 expert storage {} needs its block-scale storage {}{} (per-tensor or other "
           "scales are not supported on the sharded expert path)",
           destination_rank, s.name, s.name, kScaleSuffix);
  }
  for (auto& s : storage)
    if (is_scale(s.name)) {  // the weight's TP and EP, whatever the scale's entry says
      const ExpertStorage& w = *find(weight_of(s.name));
      s.tp_rank = w.tp_rank;
      s.tp_size = w.tp_size;
      s.use_ep = w.use_ep;
      s.expert_map = w.expert_map;
    }
  for (auto& s : storage) {
    if (s.data == nullptr && TensorInfo{s.name, s.dtype, s.shape}.numel() > 0)
      fail(ErrorKind::kInvalidArgument, "destination rank {}: expert storage {} has no data pointer", destination_rank,
           s.name);
    Param p;
    if (s.use_ep) p.slot_of = *s.expert_map;
    p.storage = std::move(s);
    std::string name = p.storage.name;
    params_.emplace(std::move(name), std::move(p));
  }
  for (const auto& t : inventory.tensors)
    if (parse_hf_expert_name(t.name)) full_shapes_.emplace(t.name, t.shape);
}

ExpertLoadResult ExpertLoader::load(std::span<const TensorView> batch) {
  const int dest = destination_rank_;
  struct Item {
    int64_t slot;
    const std::byte* src;
  };
  struct Group {
    Param* param;
    ExpertShard shard;
    std::vector<int64_t> src_shape;  // [rows, cols] of every item (all equal: same parameter)
    std::vector<Item> items;
  };
  std::map<std::pair<std::string_view, ExpertShard>, Group> groups;
  ExpertLoadResult result;

  // Check everything before writing anything.
  for (const TensorView& v : batch) {
    if (!v.info) fail(ErrorKind::kInvalidArgument, "destination rank {}: a tensor view of the batch has no info", dest);
    const TensorInfo& t = *v.info;
    // An expert weight's block scales ("<weight>_scale_inv") go where the weight goes, in scale blocks.
    auto expert = parse_hf_expert_name(weight_of(t.name));
    if (!expert) {
      result.remaining.push_back(v);
      continue;
    }
    const std::string param_name = expert->param_name() + (is_scale(t.name) ? std::string(kScaleSuffix) : "");
    auto pit = params_.find(param_name);
    if (pit == params_.end())
      fail(ErrorKind::kLayout,
           "destination rank {} received expert tensor '{}' for parameter '{}', which it does not hold", dest, t.name,
           param_name);
    Param& param = pit->second;
    const ExpertStorage& s = param.storage;
    if (v.memory != MemoryKind::kHost)
      fail(ErrorKind::kUnsupported, "destination rank {}: direct expert copy of '{}' supports host memory only", dest,
           t.name);
    if (t.dtype != s.dtype)
      fail(ErrorKind::kLayout, "destination rank {}: expert tensor '{}' is {} but {} holds {}", dest, t.name,
           dtype_name(t.dtype), s.name, dtype_name(s.dtype));
    if (t.shape.size() != 2)  // V42
      fail(ErrorKind::kLayout,
           "Sharded expert {} requires a 3-D vLLM parameter and 2-D source tensor, got {}-D and {}-D (destination rank "
           "{}).",
           t.name, s.shape.size(), t.shape.size(), dest);
    // The weight's TP slice; its block scales: the scales of that slice (fp8_scale_shape, the
    // layout's own rule).
    const std::string_view weight = weight_of(t.name);
    auto fit = full_shapes_.find(weight);
    if (fit == full_shapes_.end())
      fail(ErrorKind::kLayout, "destination rank {}: expert tensor '{}' is not in the model", dest, weight);
    std::vector<int64_t> expected = fit->second;
    const int32_t dim = expert->shard_dim();
    if (expected.size() != 2 || expected[dim] % s.tp_size != 0)
      fail(ErrorKind::kLayout, "Cannot shard {} dimension {} of full shape {} across TP size {} (destination rank {}).",
           weight, dim, shape_string(expected), s.tp_size, dest);
    expected[dim] /= s.tp_size;
    if (is_scale(t.name))
      expected = fp8_scale_shape(TensorInfo{std::string(weight), t.dtype, expected}, Fp8Scaling::kBlock128);
    if (t.shape != expected)  // V43
      fail(ErrorKind::kLayout,
           "Received sharded expert {} with shape {}, expected {} from full shape {} and TP size {} (destination rank "
           "{}).",
           t.name, shape_string(t.shape), shape_string(expected), shape_string(fit->second), s.tp_size, dest);

    int64_t slot = expert->expert_id;
    if (!param.slot_of.empty())
      slot = expert->expert_id < static_cast<int64_t>(param.slot_of.size()) ? param.slot_of[expert->expert_id] : -1;
    if (slot < 0)
      fail(ErrorKind::kLayout,
           "destination rank {} received expert tensor '{}' but does not own expert {} (its expert map)", dest, t.name,
           expert->expert_id);
    if (slot >= s.shape[0])
      fail(ErrorKind::kLayout, "destination rank {}: expert tensor '{}' maps to slot {} but {} has {} slots", dest,
           t.name, slot, s.name, s.shape[0]);
    const bool w13 = is_w13(s.name);
    if (w13 == (expert->shard == ExpertShard::kW2))
      fail(ErrorKind::kLayout, "destination rank {}: expert tensor '{}' does not belong in {}", dest, t.name, s.name);
    const int64_t rows_room = w13 ? s.shape[1] / 2 : s.shape[1];
    if (t.shape[0] > rows_room || t.shape[1] > s.shape[2])
      fail(ErrorKind::kLayout, "destination rank {}: expert tensor '{}' of shape {} does not fit {} of shape {}", dest,
           t.name, shape_string(t.shape), s.name, shape_string(s.shape));
    if (v.data == nullptr && t.nbytes() > 0)
      fail(ErrorKind::kInvalidArgument, "destination rank {}: expert tensor '{}' has no data pointer", dest, t.name);

    Group& g = groups[{pit->first, expert->shard}];
    g.param = &param;
    g.shard = expert->shard;
    g.src_shape = t.shape;
    g.items.push_back({slot, v.data});
  }
  for (auto& [key, g] : groups) {
    std::sort(g.items.begin(), g.items.end(), [](const Item& a, const Item& b) { return a.slot < b.slot; });
    for (size_t i = 1; i < g.items.size(); ++i)
      if (g.items[i].slot == g.items[i - 1].slot)
        fail(ErrorKind::kLayout, "destination rank {}: slot {} of {} ({}) is written twice in one batch", dest,
             g.items[i].slot, key.first,
             g.shard == ExpertShard::kW1   ? "gate"
             : g.shard == ExpertShard::kW3 ? "up"
                                           : "down");
  }

  for (auto& [key, g] : groups) {
    const ExpertStorage& s = g.param->storage;
    const uint64_t es = dtype_size(s.dtype);
    const uint64_t dst_row = static_cast<uint64_t>(s.shape[2]) * es;
    const uint64_t slot_stride = static_cast<uint64_t>(s.shape[1]) * dst_row;
    const uint64_t offset = g.shard == ExpertShard::kW3 ? static_cast<uint64_t>(s.shape[1] / 2) * dst_row : 0;
    const uint64_t rows = static_cast<uint64_t>(g.src_shape[0]);
    const uint64_t src_row = static_cast<uint64_t>(g.src_shape[1]) * es;
    const uint64_t src_slot = rows * src_row;
    // A run: consecutive slots whose sources lie back to back, written as one 2-D copy when the
    // slot's rows are dense in storage (no padding along H).
    for (size_t i = 0; i < g.items.size();) {
      size_t j = i + 1;
      if (src_row == dst_row)
        while (j < g.items.size() && g.items[j].slot == g.items[j - 1].slot + 1 &&
               g.items[j].src == g.items[j - 1].src + src_slot)
          ++j;
      std::byte* dst = s.data + static_cast<uint64_t>(g.items[i].slot) * slot_stride + offset;
      if (src_row == dst_row) {
        copy2d(dst, slot_stride, g.items[i].src, src_slot, src_slot, j - i);
      } else {
        copy2d(dst, dst_row, g.items[i].src, src_row, src_row, rows);
      }
      ++result.copies;
      result.experts += j - i;
      i = j;
    }
  }
  return result;
}

}  // namespace refit
