#include "refit/layout_builders.h"

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "core/fail.h"
#include "core/hf_config.h"
#include "core/layout_resolver.h"
#include "core/prefix_set.h"
#include "refit/fp8.h"

namespace refit {
namespace {

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Splits "a.b.c" at its last '.': {"a.b", "c"}; {"", s} if there is none.
std::pair<std::string_view, std::string_view> split_last(std::string_view s) {
  auto dot = s.rfind('.');
  if (dot == std::string_view::npos) return {{}, s};
  return {s.substr(0, dot), s.substr(dot + 1)};
}

void check_rank(const char* what, int size, int rank, int destination_rank) {
  if (size < 1 || rank < 0 || rank >= size)
    fail(ErrorKind::kLayout, "destination rank {}: {} rank {} is not in [0, {}) (size must be >= 1)", destination_rank,
         what, rank, size);
}

// Adds a narrow entry, unless it covers the whole tensor (then the fallback already sends it).
void put_slice(Layout& layout, const TensorInfo& t, int32_t dim, int64_t start, int64_t length) {
  if (start == 0 && length == t.shape[dim]) return;
  layout.tensors[t.name] = Request::narrow(dim, start, length);
}

int64_t dim_size(const TensorInfo& t, int32_t dim, int destination_rank) {
  if (dim >= static_cast<int32_t>(t.shape.size()))
    fail(ErrorKind::kLayout, "destination rank {}: cannot shard tensor '{}' of shape {} along dimension {}",
         destination_rank, t.name, shape_string(t.shape), dim);
  return t.shape[dim];
}

// Even TP split of `dim` (the reference's V39 message).
void put_even(Layout& layout, const TensorInfo& t, int32_t dim, int tp_size, int tp_rank, int destination_rank) {
  int64_t n = dim_size(t, dim, destination_rank);
  if (n % tp_size != 0)
    fail(ErrorKind::kLayout, "Cannot shard {} dimension {} of size {} across TP size {} (destination rank {}).", t.name,
         dim, n, tp_size, destination_rank);
  int64_t part = n / tp_size;
  put_slice(layout, t, dim, tp_rank * part, part);
}

enum class Dense { kWhole, kColumn, kRow, kHeadsColumn, kHeadsRow, kKvHeads, kVocab };

Dense classify_dense(std::string_view name) {
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return Dense::kVocab;
  auto ends = [&](std::initializer_list<std::string_view> suffixes) {
    return std::any_of(suffixes.begin(), suffixes.end(), [&](std::string_view s) { return name.ends_with(s); });
  };
  if (ends({".self_attn.q_proj.weight", ".self_attn.q_proj.bias", ".self_attn.q_b_proj.weight",
            ".self_attn.kv_b_proj.weight"}))
    return Dense::kHeadsColumn;
  if (ends(
          {".self_attn.k_proj.weight", ".self_attn.k_proj.bias", ".self_attn.v_proj.weight", ".self_attn.v_proj.bias"}))
    return Dense::kKvHeads;
  if (ends({".self_attn.o_proj.weight"})) return Dense::kHeadsRow;
  if (ends({".gate_proj.weight", ".gate_proj.bias", ".up_proj.weight", ".up_proj.bias"})) return Dense::kColumn;
  if (ends({".down_proj.weight"})) return Dense::kRow;
  return Dense::kWhole;  // norms, routers, MLA a-projections, row-parallel biases
}

void put_dense(Layout& layout, const TensorInfo& t, const ModelDims& dims, const ModelParallel& p) {
  const int tp = p.tp_size, r = p.tp_rank, dest = p.destination_rank;
  auto need_heads_divisible = [&] {
    if (dims.num_attention_heads % tp != 0)
      fail(ErrorKind::kLayout,
           "Cannot shard {} by attention heads: num_attention_heads {} is not divisible by TP size {} (destination "
           "rank {}).",
           t.name, dims.num_attention_heads, tp, dest);
  };
  switch (classify_dense(t.name)) {
    case Dense::kWhole:
      return;
    case Dense::kColumn:
      return put_even(layout, t, 0, tp, r, dest);
    case Dense::kRow:
      return put_even(layout, t, 1, tp, r, dest);
    case Dense::kHeadsColumn:
      need_heads_divisible();
      return put_even(layout, t, 0, tp, r, dest);
    case Dense::kHeadsRow:
      need_heads_divisible();
      return put_even(layout, t, 1, tp, r, dest);
    case Dense::kKvHeads: {
      const int64_t kv = dims.num_key_value_heads > 0 ? dims.num_key_value_heads : dims.num_attention_heads;
      if (tp <= kv) {
        if (kv % tp != 0)
          fail(ErrorKind::kLayout,
               "Cannot shard {} by KV heads: num_key_value_heads {} is not divisible by TP size {} (destination rank "
               "{}).",
               t.name, kv, tp, dest);
        return put_even(layout, t, 0, tp, r, dest);
      }
      // More ranks than KV heads: each head is replicated on tp / kv ranks.
      if (tp % kv != 0)
        fail(ErrorKind::kLayout,
             "Cannot replicate the KV heads of {}: TP size {} is not a multiple of "
             "num_key_value_heads {} (destination rank {}).",
             t.name, tp, kv, dest);
      int64_t n = dim_size(t, 0, dest);
      if (n % kv != 0)
        fail(ErrorKind::kLayout, "Cannot shard {} dimension 0 of size {} into {} KV heads (destination rank {}).",
             t.name, n, kv, dest);
      int64_t head = static_cast<int64_t>(r) * kv / tp;
      return put_slice(layout, t, 0, head * (n / kv), n / kv);
    }
    case Dense::kVocab: {
      int64_t v = dim_size(t, 0, dest);
      int64_t padded = (v + p.vocab_padding - 1) / p.vocab_padding * p.vocab_padding;
      int64_t per = (padded + tp - 1) / tp;
      int64_t start = std::min<int64_t>(per * r, v);
      return put_slice(layout, t, 0, start, std::min(per, v - start));
    }
  }
}

}  // namespace

std::string HfExpertName::param_name() const {
  return prefix + (shard == ExpertShard::kW2 ? ".routed_experts.w2_weight" : ".routed_experts.w13_weight");
}

std::optional<HfExpertName> parse_hf_expert_name(std::string_view name) {
  if (!name.ends_with(".weight")) return std::nullopt;
  auto [rest, projection] = split_last(name.substr(0, name.size() - 7));
  auto [prefix, id] = split_last(rest);
  if (!all_digits(id)) return std::nullopt;

  HfExpertName out;
  // `.+` before the suffix: at least one character ahead of it.
  auto has_suffix = [&](std::string_view s) { return prefix.size() > s.size() && prefix.ends_with(s); };
  if (has_suffix(".mlp.experts")) {
    if (projection == "gate_proj")
      out.shard = ExpertShard::kW1;
    else if (projection == "up_proj")
      out.shard = ExpertShard::kW3;
    else if (projection == "down_proj")
      out.shard = ExpertShard::kW2;
    else
      return std::nullopt;
  } else if (has_suffix(".block_sparse_moe.experts")) {
    if (projection == "w1")
      out.shard = ExpertShard::kW1;
    else if (projection == "w3")
      out.shard = ExpertShard::kW3;
    else if (projection == "w2")
      out.shard = ExpertShard::kW2;
    else
      return std::nullopt;
  } else {
    return std::nullopt;
  }
  auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), out.expert_id);
  if (ec != std::errc() || end != id.data() + id.size()) return std::nullopt;  // past int64
  out.prefix = std::string(prefix);
  return out;
}

namespace {

// layout_from_compact and build_layout before their FP8 scales are added (which name the owner).
Layout compact_without_scales(const CompactLayout& compact, const ModelInventory& inventory, int destination_rank) {
  for (const auto& [param, e] : compact.expert_params) {
    if (e.tp_size < 1 || e.tp_rank < 0 || e.tp_rank >= e.tp_size)
      fail(ErrorKind::kLayout, "destination rank {}: expert parameter '{}' has tp_rank {} outside [0, tp_size {})",
           destination_rank, param, e.tp_rank, e.tp_size);
  }
  Layout layout;
  layout.drop_prefixes = compact.missing_weight_prefixes;
  const PrefixSet dropped(layout.drop_prefixes);
  for (const auto& t : inventory.tensors) {
    if (dropped.matches(t.name)) continue;
    auto expert = parse_hf_expert_name(t.name);
    if (!expert) continue;
    auto it = compact.expert_params.find(expert->param_name());
    if (it == compact.expert_params.end()) {  // held by another stage
      layout.tensors[t.name] = Request::drop();
      continue;
    }
    const ExpertParamLayout& e = it->second;
    if (e.local_expert_ids && std::find(e.local_expert_ids->begin(), e.local_expert_ids->end(), expert->expert_id) ==
                                  e.local_expert_ids->end()) {
      layout.tensors[t.name] = Request::drop();
      continue;
    }
    if (e.tp_size == 1) continue;
    put_even(layout, t, expert->shard_dim(), e.tp_size, e.tp_rank, destination_rank);
  }
  return layout;
}

}  // namespace

Layout layout_from_compact(const CompactLayout& compact, const ModelInventory& inventory, int destination_rank) {
  Layout layout = compact_without_scales(compact, inventory, destination_rank);
  add_fp8_scale_requests(layout, inventory, fmt::format("destination rank {}", destination_rank));
  return layout;
}

std::vector<int64_t> expert_ids_from_map(const std::vector<int64_t>& expert_map, int destination_rank) {
  std::vector<int64_t> ids;
  std::vector<int64_t> slots;
  for (size_t g = 0; g < expert_map.size(); ++g) {
    if (expert_map[g] < -1)
      fail(ErrorKind::kLayout, "destination rank {}: expert_map[{}] is {} (expected a local slot or -1)",
           destination_rank, g, expert_map[g]);
    if (expert_map[g] >= 0) {
      ids.push_back(static_cast<int64_t>(g));
      slots.push_back(expert_map[g]);
    }
  }
  // vLLM's static maps number the local slots 0..n-1.
  std::sort(slots.begin(), slots.end());
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i] != static_cast<int64_t>(i))
      fail(ErrorKind::kLayout,
           "destination rank {}: expert_map local slots must be 0..{} each once, got slot {} at position {}",
           destination_rank, slots.size() - 1, slots[i], i);
  return ids;
}

namespace {

// Routed experts per MoE layer: one more than the highest expert id a tensor name carries.
int64_t routed_expert_count(const ModelInventory& inventory) {
  int64_t count = 0;
  for (const auto& t : inventory.tensors)
    if (auto e = parse_hf_expert_name(t.name)) count = std::max(count, e->expert_id + 1);
  return count;
}

}  // namespace

std::vector<int64_t> linear_expert_ids(int64_t num_experts, int ep_size, int ep_rank) {
  if (ep_size < 1 || ep_rank < 0 || ep_rank >= ep_size || num_experts < 0)
    fail(ErrorKind::kLayout, "expert placement: ep_rank {} not in [0, ep_size {}) or {} experts", ep_rank, ep_size,
         num_experts);
  int64_t base = num_experts / ep_size, extra = num_experts % ep_size;
  int64_t count = base + (ep_rank < extra ? 1 : 0);
  int64_t start = ep_rank * base + std::min<int64_t>(ep_rank, extra);
  std::vector<int64_t> ids(count);
  for (int64_t i = 0; i < count; ++i) ids[i] = start + i;
  return ids;
}

int64_t decoder_layer_count(const ModelInventory& inventory) {
  constexpr std::string_view kLayers = "model.layers.";
  int64_t count = 0;
  for (const auto& t : inventory.tensors) {
    std::string_view n = t.name;
    if (!n.starts_with(kLayers)) continue;
    n.remove_prefix(kLayers.size());
    auto dot = n.find('.');
    if (dot == std::string_view::npos || !all_digits(n.substr(0, dot))) continue;
    int64_t i = 0;
    auto [end, ec] = std::from_chars(n.data(), n.data() + dot, i);
    if (ec == std::errc()) count = std::max(count, i + 1);
  }
  return count;
}

std::pair<int64_t, int64_t> pp_layer_range(int64_t num_layers, int pp_size, int pp_rank) {
  if (pp_size < 1 || pp_rank < 0 || pp_rank >= pp_size)
    fail(ErrorKind::kLayout, "pipeline: pp_rank {} is not in [0, pp_size {})", pp_rank, pp_size);
  if (num_layers < pp_size)
    fail(ErrorKind::kLayout, "pipeline: pp_size {} exceeds the {} decoder layers", pp_size, num_layers);
  std::vector<int64_t> parts(pp_size, num_layers / pp_size);
  for (int64_t i = 2; i < num_layers % pp_size + 2; ++i) parts[pp_size - i] += 1;
  int64_t first = 0;
  for (int i = 0; i < pp_rank; ++i) first += parts[i];
  return {first, first + parts[pp_rank]};
}

std::vector<std::string> pp_missing_prefixes(const ModelInventory& inventory, int pp_size, int pp_rank) {
  if (pp_size == 1 && pp_rank == 0) return {};
  int64_t layers = decoder_layer_count(inventory);
  auto [first, end] = pp_layer_range(layers, pp_size, pp_rank);
  bool is_first = pp_rank == 0, is_last = pp_rank == pp_size - 1;
  auto has = [&](std::string_view name) {
    return std::any_of(inventory.tensors.begin(), inventory.tensors.end(),
                       [&](const TensorInfo& t) { return t.name == name; });
  };
  bool tied = !has("lm_head.weight");
  std::vector<std::string> out;
  // With tied embeddings the last stage's lm_head reads embed_tokens.
  if (!is_first && !(is_last && tied) && has("model.embed_tokens.weight")) out.push_back("model.embed_tokens.");
  for (int64_t i = 0; i < layers; ++i)
    if (i < first || i >= end) out.push_back(fmt::format("model.layers.{}.", i));
  if (!is_last) {
    if (has("model.norm.weight")) out.push_back("model.norm.");
    if (!tied) out.push_back("lm_head.");
  }
  return out;
}

ModelDims model_dims_from_hf_config(const std::string& path) {
  const HfConfig config = read_hf_config(path);
  const std::string& file = config.origin;
  const nlohmann::json& json = config.json;
  auto get = [&](const char* key, bool required) -> int64_t {
    auto it = json.find(key);
    if (it == json.end() || it->is_null()) {
      if (required) fail(ErrorKind::kModel, "config '{}': missing key '{}'", file, key);
      return 0;
    }
    if (!it->is_number_integer() || it->get<int64_t>() < 1)
      fail(ErrorKind::kModel, "config '{}': key '{}' must be an integer >= 1, got {}", file, key, it->dump());
    return it->get<int64_t>();
  };
  ModelDims d;
  d.num_attention_heads = get("num_attention_heads", true);
  d.num_key_value_heads = get("num_key_value_heads", false);
  return d;
}

namespace {

Layout build_without_scales(const ModelInventory& inventory, const ModelDims& dims, const ModelParallel& p) {
  const int dest = p.destination_rank;
  check_rank("tp", p.tp_size, p.tp_rank, dest);
  check_rank("ep", p.ep_size, p.ep_rank, dest);
  check_rank("pp", p.pp_size, p.pp_rank, dest);
  if (p.vocab_padding < 1) fail(ErrorKind::kLayout, "destination rank {}: vocab_padding must be >= 1", dest);
  if (p.shard_dense && p.tp_size > 1 && dims.num_attention_heads < 1)
    fail(ErrorKind::kLayout,
         "destination rank {}: shard_dense needs num_attention_heads (ModelDims) to split attention", dest);

  if (p.pp_size > 1 && decoder_layer_count(inventory) < p.pp_size)
    fail(ErrorKind::kLayout, "destination rank {}: pp_size {} exceeds the {} decoder layers of model '{}'", dest,
         p.pp_size, decoder_layer_count(inventory), inventory.name);
  std::vector<std::string> prefixes = pp_missing_prefixes(inventory, p.pp_size, p.pp_rank);
  for (const auto& extra : p.missing_prefixes)
    if (std::find(prefixes.begin(), prefixes.end(), extra) == prefixes.end()) prefixes.push_back(extra);

  Layout layout;
  const PrefixSet dropped(prefixes);
  if (p.shard_experts) {
    const int64_t num_experts = routed_expert_count(inventory);

    const bool ep = !p.expert_map.empty() || p.ep_size > 1;
    std::optional<std::vector<int64_t>> owned;
    if (!p.expert_map.empty()) {
      if (static_cast<int64_t>(p.expert_map.size()) != num_experts)
        fail(ErrorKind::kLayout, "destination rank {}: expert_map has {} entries but model '{}' has {} routed experts",
             dest, p.expert_map.size(), inventory.name, num_experts);
      owned = expert_ids_from_map(p.expert_map, dest);
    } else if (ep) {
      owned = linear_expert_ids(num_experts, p.ep_size, p.ep_rank);
    }
    ExpertParamLayout e;
    e.tp_size = p.expert_tp_size.value_or(ep ? 1 : p.tp_size);
    e.tp_rank = p.expert_tp_rank.value_or(ep ? 0 : p.tp_rank);
    check_rank("expert tp", e.tp_size, e.tp_rank, dest);
    e.local_expert_ids = std::move(owned);

    CompactLayout compact;
    compact.missing_weight_prefixes = prefixes;
    for (const auto& t : inventory.tensors) {
      if (dropped.matches(t.name)) continue;
      if (auto name = parse_hf_expert_name(t.name)) compact.expert_params.emplace(name->param_name(), e);
    }
    layout = compact_without_scales(compact, inventory, dest);
  } else {
    layout.drop_prefixes = prefixes;
  }

  if (p.shard_dense && p.tp_size > 1) {
    for (const auto& t : inventory.tensors) {
      if (dropped.matches(t.name) || parse_hf_expert_name(t.name)) continue;
      put_dense(layout, t, dims, p);
    }
  }
  return layout;
}

}  // namespace

Layout build_layout(const ModelInventory& inventory, const ModelDims& dims, const ModelParallel& parallel) {
  Layout layout = build_without_scales(inventory, dims, parallel);
  add_fp8_scale_requests(layout, inventory, fmt::format("destination rank {}", parallel.destination_rank));
  return layout;
}

namespace {

// add_fp8_scale_requests with a resolver shared by every layout of one model: the layout is
// resolved once (request_for per scale would scan every dropped prefix twice per scale, for each
// of hundreds of Megatron ranks).
void add_scales(Layout& layout, const LayoutResolver& resolver, const ModelInventory& inventory,
                std::string_view owner) {
  if (resolver.fp8_scales().empty()) return;
  std::vector<Request> requests;
  resolver.resolve(layout, LayoutRole::kSource, owner, requests);
  for (const auto& link : resolver.fp8_scales()) {
    const Request need = fp8_scale_request(inventory, link, requests[link.weight], owner);
    if (requests[link.scale] != need) layout.tensors[inventory.tensors[link.scale].name] = need;
  }
}

}  // namespace

void add_fp8_scale_requests(Layout& layout, const ModelInventory& inventory, std::string_view owner) {
  add_scales(layout, LayoutResolver(inventory), inventory, owner);
}

Layout build_layout(const std::string& config_path, const ModelParallel& parallel) {
  return build_layout(inventory_from_hf_config(config_path), model_dims_from_hf_config(config_path), parallel);
}

std::vector<Layout> megatron_source_layouts(const ModelInventory& inventory, const ModelDims& dims,
                                            const TrainingParallel& p) {
  const int etp = p.expert_tp_size.value_or(p.tp_size);
  if (p.tp_size < 1 || p.pp_size < 1 || p.dp_size < 1 || p.ep_size < 1 || etp < 1)
    fail(ErrorKind::kLayout, "training parallelism: tp {}, pp {}, dp {}, ep {}, expert tp {} must all be >= 1",
         p.tp_size, p.pp_size, p.dp_size, p.ep_size, etp);
  const int stage_ranks = p.tp_size * p.dp_size;
  if (stage_ranks % (etp * p.ep_size) != 0)
    fail(ErrorKind::kLayout,
         "training parallelism: the tp x dp = {} ranks of a stage cannot be split into expert tp {} x ep {} groups",
         stage_ranks, etp, p.ep_size);
  // With more TP ranks than KV heads Megatron (megatron-core 0.16.1) gives each rank an equal row
  // block of its fused q/k/v, which is no slice of the HF q/k/v tensors (vLLM instead replicates KV
  // heads, as build_layout does): refused rather than described wrongly.
  const int64_t kv_heads = dims.num_key_value_heads > 0 ? dims.num_key_value_heads : dims.num_attention_heads;
  const bool has_kv_projections =
      std::any_of(inventory.tensors.begin(), inventory.tensors.end(),
                  [](const TensorInfo& t) { return t.name.ends_with(".self_attn.k_proj.weight"); });
  if (p.tp_size > 1 && has_kv_projections && kv_heads > 0 && p.tp_size > kv_heads)
    fail(ErrorKind::kLayout,
         "training parallelism: tp {} exceeds num_key_value_heads {}: Megatron then gives each rank an equal row "
         "block of its fused q/k/v, which is no slice of the q/k/v tensors a layout can name; use tp <= {}",
         p.tp_size, kv_heads, kv_heads);
  // megatron-core's MoE layer asserts this; a placement it cannot build is refused, not described.
  const int64_t num_experts = routed_expert_count(inventory);
  if (num_experts > 0 && num_experts % p.ep_size != 0)
    fail(ErrorKind::kLayout,
         "training parallelism: ep {} does not divide the {} routed experts of model '{}' (megatron-core requires "
         "it: each ep rank holds as many)",
         p.ep_size, num_experts, inventory.name);
  std::vector<Layout> out;
  const LayoutResolver resolver(inventory);  // one for every rank
  const int world = stage_ranks * p.pp_size;
  out.reserve(world);
  for (int rank = 0; rank < world; ++rank) {
    const int local = rank % stage_ranks;
    ModelParallel m;
    m.destination_rank = rank;
    m.tp_size = p.tp_size;
    m.tp_rank = rank % p.tp_size;
    m.pp_size = p.pp_size;
    m.pp_rank = rank / stage_ranks;
    m.ep_size = p.ep_size;
    m.ep_rank = (local / etp) % p.ep_size;
    m.expert_tp_size = etp;
    m.expert_tp_rank = local % etp;
    m.shard_experts = true;
    m.shard_dense = p.tp_size > 1;
    m.vocab_padding = 128 * static_cast<int64_t>(p.tp_size);
    out.push_back(build_without_scales(inventory, dims, m));
    add_scales(out.back(), resolver, inventory, fmt::format("source rank {}", rank));
  }
  return out;
}

Request dtensor_request(std::string_view tensor, std::span<const int64_t> shape, std::span<const Placement> placements,
                        std::span<const int> mesh_shape, std::span<const int> coordinate) {
  if (placements.size() != mesh_shape.size() || coordinate.size() != mesh_shape.size())
    fail(ErrorKind::kLayout, "tensor '{}': {} placements and a {}-D coordinate for a {}-D device mesh", tensor,
         placements.size(), coordinate.size(), mesh_shape.size());
  std::optional<Slice> held;
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    if (mesh_shape[m] < 1 || coordinate[m] < 0 || coordinate[m] >= mesh_shape[m])
      fail(ErrorKind::kLayout, "tensor '{}': mesh coordinate {} is outside mesh dim {} of size {}", tensor,
           coordinate[m], m, mesh_shape[m]);
    if (!placements[m].shard) continue;
    const int32_t dim = placements[m].dim;
    if (dim < 0 || dim >= static_cast<int32_t>(shape.size()))
      fail(ErrorKind::kLayout, "tensor '{}' of {} dims cannot be Shard({})", tensor, shape.size(), dim);
    if (held && held->dim != dim)
      fail(ErrorKind::kLayout,
           "tensor '{}' is sharded along dims {} and {}: a layout narrows one dim per tensor (shard it along one)",
           tensor, held->dim, dim);
    const Slice current = held.value_or(Slice{dim, 0, shape[dim]});
    const int64_t chunk = (current.length + mesh_shape[m] - 1) / mesh_shape[m];
    const int64_t start = std::min(current.length, chunk * coordinate[m]);
    held = Slice{dim, current.start + start, std::min(chunk, current.length - start)};
  }
  if (!held || (held->start == 0 && held->length == shape[held->dim])) return Request::whole();
  return Request::narrow(held->dim, held->start, held->length);
}

Layout fsdp_source_layout(const ModelInventory& inventory, int world, int rank) {
  if (world < 1 || rank < 0 || rank >= world)
    fail(ErrorKind::kLayout, "FSDP: rank {} is not in [0, world {})", rank, world);
  const Placement shard0 = Placement::shard_dim(0);
  const int mesh[] = {world}, at[] = {rank};
  Layout layout;
  for (const auto& t : inventory.tensors) {
    if (t.shape.empty()) continue;  // a scalar is replicated
    Request r = dtensor_request(t.name, t.shape, {&shard0, 1}, mesh, at);
    if (r.take != Take::kWhole) layout.tensors[t.name] = r;
  }
  return layout;
}

}  // namespace refit
