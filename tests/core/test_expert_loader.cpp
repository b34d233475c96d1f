#include "refit/expert_loader.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <set>

#include "core/error_of.h"
#include "refit/error.h"
#include "refit/fp8.h"
#include "refit/layout.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::error_of;

constexpr int64_t kH = 6, kI = 8, kE = 4, kLayers = 2;
const char* const kProj[] = {"gate_proj", "up_proj", "down_proj"};

std::string expert_name(int layer, int e, int proj) {
  return fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", layer, e, kProj[proj]);
}
std::string w13(int layer) { return fmt::format("model.layers.{}.mlp.experts.routed_experts.w13_weight", layer); }
std::string w2(int layer) { return fmt::format("model.layers.{}.mlp.experts.routed_experts.w2_weight", layer); }

// A small float32 MoE in HF order, with every element's value unique, so misplaced bytes show.
struct Model {
  ModelInventory inv;
  std::map<std::string, std::vector<float>> data;

  Model() {
    inv.name = "tiny";
    for (int l = 0; l < kLayers; ++l) {
      add(fmt::format("model.layers.{}.input_layernorm.weight", l), {kH});
      for (int e = 0; e < kE; ++e)
        for (int p = 0; p < 3; ++p)
          add(expert_name(l, e, p), p == 2 ? std::vector<int64_t>{kH, kI} : std::vector<int64_t>{kI, kH});
    }
  }
  void add(std::string name, std::vector<int64_t> shape) {
    TensorInfo t{name, DType::kFloat32, shape};
    std::vector<float> v(t.numel());
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(inv.tensors.size() * 1000 + i);
    data[name] = std::move(v);
    inv.tensors.push_back(std::move(t));
  }
  float at(const std::string& name, int64_t row, int64_t col) const {
    const auto& t =
        *std::find_if(inv.tensors.begin(), inv.tensors.end(), [&](const TensorInfo& x) { return x.name == name; });
    return data.at(name)[row * t.shape[1] + col];
  }
};

// What a source packs for a layout: the selected tensors back to back in one buffer.
struct Bucket {
  std::vector<std::byte> bytes;
  std::deque<TensorInfo> infos;
  std::vector<TensorView> views;
};

Bucket pack(const Model& m, const Layout& layout, const std::vector<std::string>& order = {}) {
  Bucket b;
  std::vector<const TensorInfo*> tensors;
  for (const auto& t : m.inv.tensors) tensors.push_back(&t);
  if (!order.empty()) {
    tensors.clear();
    for (const auto& n : order)
      tensors.push_back(
          &*std::find_if(m.inv.tensors.begin(), m.inv.tensors.end(), [&](const TensorInfo& t) { return t.name == n; }));
  }
  std::vector<std::pair<Selection, const TensorInfo*>> sel;
  uint64_t total = 0;
  for (const auto* t : tensors) {
    Selection s = select(layout, *t);
    if (s.take == Take::kDrop) continue;
    total += s.info.nbytes();
    sel.push_back({s, t});
  }
  b.bytes.resize(total);
  uint64_t offset = 0;
  for (auto& [s, t] : sel) {
    const auto* src = reinterpret_cast<const std::byte*>(m.data.at(t->name).data());
    if (s.take == Take::kSlice)
      copy_slice(src, *t, s.slice, b.bytes.data() + offset);
    else
      std::memcpy(b.bytes.data() + offset, src, t->nbytes());
    b.infos.push_back(s.info);
    b.views.push_back({&b.infos.back(), b.bytes.data() + offset});
    offset += s.info.nbytes();
  }
  return b;
}

constexpr float kUntouched = -7.0f;

// One destination: its expert storage for every layer, filled with kUntouched.
struct Destination {
  int64_t slots, rows, cols;  // w13 is [slots, rows, cols]; w2 is [slots, cols_w2, rows_w2]
  std::vector<std::vector<float>> w13_data, w2_data;
  std::vector<ExpertStorage> storage;

  // tp of the experts, and an optional EP map. `pad` adds rows/cols to the storage.
  Destination(int tp, int tp_rank, std::optional<std::vector<int64_t>> map, int64_t pad = 0) {
    int64_t owned = kE;
    if (map) owned = std::count_if(map->begin(), map->end(), [](int64_t s) { return s >= 0; });
    const int64_t s = kI / tp + pad, h = kH + pad;
    for (int l = 0; l < kLayers; ++l) {
      w13_data.emplace_back(owned * 2 * s * h, kUntouched);
      w2_data.emplace_back(owned * h * s, kUntouched);
    }
    for (int l = 0; l < kLayers; ++l) {
      for (int which = 0; which < 2; ++which) {
        ExpertStorage st;
        st.name = which == 0 ? w13(l) : w2(l);
        st.dtype = DType::kFloat32;
        st.shape = which == 0 ? std::vector<int64_t>{owned, 2 * s, h} : std::vector<int64_t>{owned, h, s};
        st.data = reinterpret_cast<std::byte*>(which == 0 ? w13_data[l].data() : w2_data[l].data());
        st.tp_rank = tp_rank;
        st.tp_size = tp;
        st.use_ep = map.has_value();
        st.expert_map = map;
        storage.push_back(std::move(st));
      }
    }
  }
  float w13_at(int l, int64_t slot, int64_t r, int64_t c) const {
    const auto& sh = storage[2 * l].shape;
    return w13_data[l][(slot * sh[1] + r) * sh[2] + c];
  }
  float w2_at(int l, int64_t slot, int64_t r, int64_t c) const {
    const auto& sh = storage[2 * l + 1].shape;
    return w2_data[l][(slot * sh[1] + r) * sh[2] + c];
  }
};

// The reference's layout round trip: storage -> compact layout -> layout bytes -> source.
Layout destination_layout(const Destination& d, const ModelInventory& inv) {
  CompactLayout c = expert_layout_from_storage(d.storage, 0);
  return decode_layout(encode_layout(layout_from_compact(c, inv, 0)));
}

// vLLM's full-weight TP loading (RoutedExperts._load_w13 / _load_w2) of every owned expert,
// checked against what the direct copy wrote; every other element must be untouched.
void expect_matches_full_tp_loading(const Model& m, const Destination& d, int tp, int tp_rank,
                                    const std::optional<std::vector<int64_t>>& map) {
  const int64_t s = kI / tp;
  for (int l = 0; l < kLayers; ++l) {
    const auto& sh13 = d.storage[2 * l].shape;
    const auto& sh2 = d.storage[2 * l + 1].shape;
    std::set<int64_t> written_slots;
    for (int g = 0; g < kE; ++g) {
      int64_t slot = map ? (*map)[g] : g;
      if (slot < 0) continue;
      written_slots.insert(slot);
      const int64_t half = sh13[1] / 2;
      for (int64_t r = 0; r < sh13[1]; ++r)
        for (int64_t c = 0; c < sh13[2]; ++c) {
          float expected = kUntouched;
          if (r < s && c < kH) expected = m.at(expert_name(l, g, 0), tp_rank * s + r, c);
          if (r >= half && r < half + s && c < kH) expected = m.at(expert_name(l, g, 1), tp_rank * s + r - half, c);
          ASSERT_EQ(d.w13_at(l, slot, r, c), expected)
              << "layer " << l << " expert " << g << " w13[" << r << "," << c << "]";
        }
      for (int64_t r = 0; r < sh2[1]; ++r)
        for (int64_t c = 0; c < sh2[2]; ++c) {
          float expected = r < kH && c < s ? m.at(expert_name(l, g, 2), r, tp_rank * s + c) : kUntouched;
          ASSERT_EQ(d.w2_at(l, slot, r, c), expected)
              << "layer " << l << " expert " << g << " w2[" << r << "," << c << "]";
        }
    }
    for (int64_t slot = 0; slot < sh13[0]; ++slot)
      if (!written_slots.contains(slot))
        for (int64_t i = 0; i < sh13[1] * sh13[2]; ++i)
          ASSERT_EQ(d.w13_data[l][slot * sh13[1] * sh13[2] + i], kUntouched);
  }
}

void run_equivalence(int tp, int tp_rank, std::optional<std::vector<int64_t>> map, int64_t pad = 0) {
  SCOPED_TRACE(fmt::format("tp {} rank {} ep {} pad {}", tp, tp_rank, map.has_value(), pad));
  Model m;
  Destination d(tp, tp_rank, map, pad);
  Bucket b = pack(m, destination_layout(d, m.inv));
  ExpertLoader loader(m.inv, d.storage, 0);
  auto result = loader.load(b.views);
  ASSERT_EQ(result.remaining.size(), static_cast<size_t>(kLayers));  // the layernorms
  EXPECT_EQ(result.remaining[0].info->name, "model.layers.0.input_layernorm.weight");
  expect_matches_full_tp_loading(m, d, tp, tp_rank, map);
}

// The reference's test_destination_local_copy_matches_vllm_full_weight_tp_loading (tp rank 1 of
// 2), plus EP, padded storage and other TP ranks.
TEST(ExpertLoader, DirectCopyEqualsFullWeightTpLoading) { run_equivalence(2, 1, std::nullopt); }
TEST(ExpertLoader, DirectCopyEqualsFullWeightTpLoadingOtherRanks) {
  run_equivalence(2, 0, std::nullopt);
  run_equivalence(4, 3, std::nullopt);
  run_equivalence(1, 0, std::nullopt);
}
TEST(ExpertLoader, DirectCopyWithNonContiguousEp) { run_equivalence(1, 0, std::vector<int64_t>{-1, 0, -1, 1}); }
TEST(ExpertLoader, DirectCopyWithEpAndTp) { run_equivalence(2, 1, std::vector<int64_t>{0, -1, 1, -1}); }
TEST(ExpertLoader, DirectCopyIntoPaddedStorage) {
  run_equivalence(2, 1, std::nullopt, 2);
  run_equivalence(1, 0, std::vector<int64_t>{-1, 1, -1, 0}, 1);
}

TEST(ExpertLoader, AdjacentExpertsAreOneCopy) {
  Model m;
  Destination d(1, 0, std::nullopt);
  // The gates of experts 0..3 back to back, then downs 0, 1 and 3 (a gap at slot 2).
  std::vector<std::string> order;
  for (int e = 0; e < 4; ++e) order.push_back(expert_name(0, e, 0));
  for (int e : {0, 1, 3}) order.push_back(expert_name(0, e, 2));
  Bucket b = pack(m, Layout{}, order);
  ExpertLoader loader(m.inv, d.storage, 0);
  auto r = loader.load(b.views);
  EXPECT_EQ(r.experts, 7u);
  EXPECT_EQ(r.copies, 3u);  // gates 0..3, downs 0..1, down 3
  EXPECT_EQ(d.w13_at(0, 2, 0, 0), m.at(expert_name(0, 2, 0), 0, 0));
  EXPECT_EQ(d.w13_at(0, 2, kI, 0), kUntouched);  // no up sent
  EXPECT_EQ(d.w2_at(0, 2, 0, 0), kUntouched);    // down 2 not sent
  EXPECT_EQ(d.w2_at(0, 3, kH - 1, kI - 1), m.at(expert_name(0, 3, 2), kH - 1, kI - 1));

  // HF order (gate, up, down per expert): one copy per tensor.
  Destination d2(1, 0, std::nullopt);
  Bucket all = pack(m, Layout{});
  ExpertLoader loader2(m.inv, d2.storage, 0);
  auto r2 = loader2.load(all.views);
  EXPECT_EQ(r2.experts, static_cast<uint64_t>(kLayers * kE * 3));
  EXPECT_EQ(r2.copies, r2.experts);
}

TEST(ExpertLoader, ExpertsSplitOverBatchesLandTheSame) {
  Model m;
  Destination d(2, 0, std::vector<int64_t>{1, -1, 0, -1});
  Bucket b = pack(m, destination_layout(d, m.inv));
  ExpertLoader loader(m.inv, d.storage, 0);
  for (const auto& v : b.views) loader.load(std::span<const TensorView>(&v, 1));
  expect_matches_full_tp_loading(m, d, 2, 0, std::vector<int64_t>{1, -1, 0, -1});
}

// ---- rejections -----------------------------------------------------------------------------

struct Fixture {
  Model m;
  Destination d{2, 1, std::vector<int64_t>{-1, 0, -1, 1}};
  Bucket b = pack(m, destination_layout(d, m.inv));
  std::deque<TensorInfo> extra;

  const TensorView& view(const std::string& name) {
    return *std::find_if(b.views.begin(), b.views.end(), [&](const TensorView& v) { return v.info->name == name; });
  }
  // A view of `like`'s bytes under another info.
  TensorView altered(const std::string& like, TensorInfo info) {
    extra.push_back(std::move(info));
    TensorView v = view(like);
    v.info = &extra.back();
    return v;
  }
  std::string load_error(ErrorKind kind, std::vector<TensorView> batch, int rank = 3) {
    ExpertLoader loader(m.inv, d.storage, rank);
    return error_of(kind, [&] { loader.load(batch); });
  }
};

TEST(ExpertLoaderRejects, ParameterItDoesNotHold) {
  Fixture f;
  f.d.storage.resize(2);  // layer 0 only
  auto msg = f.load_error(ErrorKind::kLayout, {f.view(expert_name(1, 1, 0))});
  EXPECT_THAT(msg, AllOf(HasSubstr(expert_name(1, 1, 0)), HasSubstr(w13(1)), HasSubstr("destination rank 3"),
                         HasSubstr("does not hold")));
}

TEST(ExpertLoaderRejects, NdimMismatch) {
  Fixture f;
  auto v = f.altered(expert_name(0, 1, 0), {expert_name(0, 1, 0), DType::kFloat32, {kI / 2 * kH}});
  EXPECT_THAT(f.load_error(ErrorKind::kLayout, {v}),
              AllOf(HasSubstr("Sharded expert " + expert_name(0, 1, 0) +
                              " requires a 3-D vLLM parameter and 2-D source tensor, got 3-D and 1-D"),
                    HasSubstr("destination rank 3")));
}

TEST(ExpertLoaderRejects, ShapeMismatch) {
  Fixture f;
  // A full (unsharded) gate sent to a tp-2 destination.
  Model m;
  Bucket full = pack(m, Layout{});
  TensorView v = *std::find_if(full.views.begin(), full.views.end(),
                               [&](const TensorView& x) { return x.info->name == expert_name(0, 1, 0); });
  EXPECT_THAT(f.load_error(ErrorKind::kLayout, {v}),
              AllOf(HasSubstr("Received sharded expert " + expert_name(0, 1, 0) +
                              " with shape [8, 6], expected [4, 6] from full shape [8, 6] and TP size 2"),
                    HasSubstr("destination rank 3")));
  v = f.altered(expert_name(0, 1, 2), {expert_name(0, 1, 2), DType::kFloat32, {kH - 1, 4}});
  EXPECT_THAT(f.load_error(ErrorKind::kLayout, {v}), HasSubstr("with shape [5, 4], expected [6, 4]"));
}

TEST(ExpertLoaderRejects, UnownedExpertUnknownNameDtypeDuplicateMemory) {
  Fixture f;
  Model m;
  Bucket full = pack(m, Layout{});
  // Expert 0 is not owned (map[0] = -1); give it the sharded shape so only ownership fails.
  auto unowned = f.altered(expert_name(0, 1, 0), {expert_name(0, 0, 0), DType::kFloat32, {kI / 2, kH}});
  EXPECT_THAT(
      f.load_error(ErrorKind::kLayout, {unowned}),
      AllOf(HasSubstr(expert_name(0, 0, 0)), HasSubstr("does not own expert 0"), HasSubstr("destination rank 3")));

  auto unknown = f.altered(expert_name(0, 1, 0), {expert_name(0, 9, 0), DType::kFloat32, {kI / 2, kH}});
  EXPECT_THAT(f.load_error(ErrorKind::kLayout, {unknown}),
              AllOf(HasSubstr(expert_name(0, 9, 0)), HasSubstr("not in the model")));

  auto bf16 = f.altered(expert_name(0, 1, 0), {expert_name(0, 1, 0), DType::kBFloat16, {kI / 2, kH}});
  EXPECT_THAT(f.load_error(ErrorKind::kLayout, {bf16}), AllOf(HasSubstr("is bfloat16"), HasSubstr("holds float32")));

  EXPECT_THAT(f.load_error(ErrorKind::kLayout, {f.view(expert_name(0, 1, 0)), f.view(expert_name(0, 1, 0))}),
              AllOf(HasSubstr("slot 0"), HasSubstr("written twice")));

  TensorView device = f.view(expert_name(0, 1, 0));
  device.memory = MemoryKind::kCuda;
  f.load_error(ErrorKind::kUnsupported, {device});
}

TEST(ExpertLoaderRejects, SlotOutOfRange) {
  Model m;
  Destination d(1, 0, std::nullopt);
  for (auto& s : d.storage) s.shape[0] = 2;  // room for experts 0 and 1 only, no EP map
  Bucket b = pack(m, Layout{});
  ExpertLoader loader(m.inv, d.storage, 1);
  auto msg = error_of(ErrorKind::kLayout, [&] { loader.load(b.views); });
  EXPECT_THAT(msg, AllOf(HasSubstr("maps to slot 2"), HasSubstr("has 2 slots"), HasSubstr("destination rank 1")));
}

TEST(ExpertLoaderRejects, NothingIsWrittenWhenABatchFails) {
  Fixture f;
  auto bad = f.altered(expert_name(0, 1, 0), {expert_name(0, 1, 0), DType::kFloat32, {kI / 2 * kH}});
  std::vector<TensorView> batch = {f.view(expert_name(0, 1, 0)), f.view(expert_name(0, 3, 2)), bad};
  f.load_error(ErrorKind::kLayout, batch);
  for (const auto& v : f.d.w13_data)
    for (float x : v) ASSERT_EQ(x, kUntouched);
  for (const auto& v : f.d.w2_data)
    for (float x : v) ASSERT_EQ(x, kUntouched);
}

// ---- storage validation (V31-V38; FP8, which the reference refuses as V40) --------------------

ExpertStorage good_storage() {
  ExpertStorage s;
  s.name = "model.layers.0.mlp.experts.routed_experts.w13_weight";
  s.shape = {4, 8, 6};
  return s;
}

std::string storage_error(ErrorKind kind, std::vector<ExpertStorage> storage) {
  return error_of(kind, [&] { expert_layout_from_storage(storage, 5); });
}

TEST(ExpertStorageValidation, ReportsTheLayout) {
  ExpertStorage a = good_storage();
  a.tp_size = 2;
  a.tp_rank = 1;
  a.use_ep = true;
  a.expert_map = std::vector<int64_t>{-1, 0, -1, 1};
  ExpertStorage b = a;
  b.name = "model.layers.0.mlp.experts.routed_experts.w2_weight";
  b.shape = {2, 6, 4};
  auto c = expert_layout_from_storage(std::vector<ExpertStorage>{a, b}, 0);
  ASSERT_EQ(c.expert_params.size(), 2u);
  const auto& e = c.expert_params.at(a.name);
  EXPECT_EQ(e.tp_rank, 1);
  EXPECT_EQ(e.tp_size, 2);
  ASSERT_TRUE(e.local_expert_ids);
  EXPECT_THAT(*e.local_expert_ids, ElementsAre(1, 3));
  // Without EP: all experts.
  EXPECT_FALSE(expert_layout_from_storage(std::vector<ExpertStorage>{good_storage()}, 0)
                   .expert_params.begin()
                   ->second.local_expert_ids);
  // num_logical_experts bounds the map (vLLM's expert_map[:logical]).
  a.expert_map = std::vector<int64_t>{-1, 0, -1, 1, 2};
  a.num_logical_experts = 4;
  EXPECT_THAT(
      *expert_layout_from_storage(std::vector<ExpertStorage>{a}, 0).expert_params.begin()->second.local_expert_ids,
      ElementsAre(1, 3));
}

TEST(ExpertStorageValidation, RejectsWhatTheReferenceRejects) {
  auto with = [](auto edit) {
    ExpertStorage s = good_storage();
    edit(s);
    return std::vector<ExpertStorage>{s};
  };
  // V31
  EXPECT_THAT(storage_error(ErrorKind::kUnsupported, with([](ExpertStorage& s) { s.transposed = true; })),
              AllOf(HasSubstr("requires canonical expert-weight orientation"), HasSubstr("w13_weight is transposed"),
                    HasSubstr("destination rank 5")));
  // V32
  EXPECT_THAT(
      storage_error(ErrorKind::kLayout, with([](ExpertStorage& s) { s.loader_inspectable = false; })),
      HasSubstr(
          "Could not inspect the vLLM expert weight loader for model.layers.0.mlp.experts.routed_experts.w13_weight"));
  // V33
  EXPECT_THAT(storage_error(ErrorKind::kLayout, with([](ExpertStorage& s) {
                              s.shape = {4, 48};
                            })),
              AllOf(HasSubstr("Unsupported vLLM expert storage"), HasSubstr("shape=[4, 48]")));
  EXPECT_THAT(storage_error(ErrorKind::kLayout, with([](ExpertStorage& s) {
                              s.shape = {4, 7, 6};
                            })),
              HasSubstr("shape=[4, 7, 6]"));
  // V34
  EXPECT_THAT(storage_error(ErrorKind::kUnsupported, with([](ExpertStorage& s) { s.quant_method = "Fp8MoEMethod"; })),
              AllOf(HasSubstr("requires canonical unquantized Triton expert weights"),
                    HasSubstr("uses Fp8MoEMethod/TRITON"), HasSubstr("moe_backend=triton")));
  EXPECT_THAT(
      storage_error(ErrorKind::kUnsupported, with([](ExpertStorage& s) { s.moe_backend = "FLASHINFER_TRTLLM"; })),
      HasSubstr("uses unquantized/FLASHINFER_TRTLLM"));
  EXPECT_NO_THROW(expert_layout_from_storage(with([](ExpertStorage& s) { s.moe_backend = "BATCHED_TRITON"; }), 0));
  // V35
  EXPECT_THAT(storage_error(ErrorKind::kUnsupported, with([](ExpertStorage& s) {
                              s.use_ep = true, s.eplb = true, s.expert_map = std::vector<int64_t>{0, 1, 2, 3};
                            })),
              HasSubstr("does not support dynamic vLLM expert load balancing"));
  // V36
  EXPECT_THAT(
      storage_error(ErrorKind::kLayout, with([](ExpertStorage& s) { s.use_ep = true; })),
      HasSubstr(
          "vLLM reports EP for model.layers.0.mlp.experts.routed_experts.w13_weight without an expert ownership map"));
  // V37
  EXPECT_THAT(
      storage_error(ErrorKind::kUnsupported, with([](ExpertStorage& s) {
                      s.use_ep = true, s.expert_map = std::vector<int64_t>{0, 1, 2, 3}, s.global_num_experts = 6;
                    })),
      AllOf(HasSubstr("does not support redundant vLLM experts"), HasSubstr("4 logical and 6 physical")));
  // V38: first three, sorted
  std::vector<ExpertStorage> odd;
  for (int l : {3, 1, 2, 0}) {
    ExpertStorage s = good_storage();
    s.name = fmt::format("model.layers.{}.mlp.experts.w13_weight", l);
    odd.push_back(s);
  }
  EXPECT_THAT(storage_error(ErrorKind::kLayout, odd),
              AllOf(HasSubstr("not under the expected '.routed_experts.' submodule"),
                    HasSubstr("(saw model.layers.0.mlp.experts.w13_weight, model.layers.1.mlp.experts.w13_weight, "
                              "model.layers.2.mlp.experts.w13_weight)"),
                    HasSubstr("stale experts")));
  // Not a fused expert parameter; listed twice; bad tp rank.
  EXPECT_THAT(
      storage_error(ErrorKind::kLayout, with([](ExpertStorage& s) { s.name = "model.layers.0.mlp.gate.weight"; })),
      HasSubstr("not a fused expert parameter"));
  EXPECT_THAT(storage_error(ErrorKind::kLayout, {good_storage(), good_storage()}), HasSubstr("listed twice"));
  EXPECT_THAT(storage_error(ErrorKind::kLayout, with([](ExpertStorage& s) { s.tp_size = 2, s.tp_rank = 2; })),
              HasSubstr("tp_rank 2"));
}

// FP8 experts (the reference refuses them, V40): block-scaled float8_e4m3fn weights go into vLLM's
// fused FP8 storage with their "_scale_inv" scales beside, each scale block where its 128 x 128
// weights went: gate's blocks, then up's, in w13_weight_scale_inv; down's columns of blocks in
// w2_weight_scale_inv.
struct Fp8Model {
  static constexpr int64_t kExperts = 2, kHidden = 128, kInter = 256;  // two blocks of rows per gate/up
  ModelInventory inv;
  std::map<std::string, std::vector<std::byte>> data;  // every byte distinct enough to show a misplacement

  Fp8Model() {
    ModelInventory bf16;
    bf16.name = "tiny-fp8";
    bf16.tensors.push_back({"model.layers.0.input_layernorm.weight", DType::kBFloat16, {kHidden}});
    for (int e = 0; e < kExperts; ++e)
      for (int p = 0; p < 3; ++p)
        bf16.tensors.push_back(
            {expert_name(0, e, p), DType::kBFloat16,
             p == 2 ? std::vector<int64_t>{kHidden, kInter} : std::vector<int64_t>{kInter, kHidden}});
    inv = fp8_block_inventory(bf16);
    for (size_t k = 0; k < inv.tensors.size(); ++k) {
      const TensorInfo& t = inv.tensors[k];
      std::vector<std::byte> bytes(t.nbytes());
      if (t.dtype == DType::kFloat32) {
        for (int64_t i = 0; i < t.numel(); ++i) {
          const float v = static_cast<float>(k * 100 + i);
          std::memcpy(bytes.data() + i * 4, &v, 4);
        }
      } else {
        for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 31 + k * 7) % 251);
      }
      data[t.name] = std::move(bytes);
    }
  }
  const TensorInfo& info(const std::string& name) const {
    return *std::find_if(inv.tensors.begin(), inv.tensors.end(), [&](const TensorInfo& t) { return t.name == name; });
  }
};

// Rank `tp_rank` of TP `tp`: FP8 weight storage and its scale storage for layer 0.
struct Fp8Destination {
  std::vector<std::byte> w13_bytes, w2_bytes, w13_scale, w2_scale;
  std::vector<ExpertStorage> storage;
  Fp8Destination(int tp, int tp_rank, bool with_scales = true) {
    const int64_t e = Fp8Model::kExperts, h = Fp8Model::kHidden, s = Fp8Model::kInter / tp;
    const int64_t hb = (h + 127) / 128, sb = (s + 127) / 128;
    auto add = [&](std::string name, DType dtype, std::vector<int64_t> shape, std::vector<std::byte>& bytes) {
      ExpertStorage st;
      st.name = std::move(name);
      st.dtype = dtype;
      st.shape = std::move(shape);
      bytes.assign(TensorInfo{st.name, dtype, st.shape}.nbytes(), std::byte{0xEE});
      st.data = bytes.data();
      st.quant_method = "fp8";
      st.tp_rank = tp_rank;
      st.tp_size = tp;
      storage.push_back(std::move(st));
    };
    add(w13(0), DType::kFloat8E4M3FN, {e, 2 * s, h}, w13_bytes);
    add(w2(0), DType::kFloat8E4M3FN, {e, h, s}, w2_bytes);
    if (with_scales) {
      add(w13(0) + "_scale_inv", DType::kFloat32, {e, 2 * sb, hb}, w13_scale);
      add(w2(0) + "_scale_inv", DType::kFloat32, {e, hb, sb}, w2_scale);
    }
  }
};

// One element of a row-major tensor's bytes.
template <typename T>
T element(const std::vector<std::byte>& bytes, const std::vector<int64_t>& shape, std::vector<int64_t> at) {
  int64_t i = 0;
  for (size_t d = 0; d < shape.size(); ++d) i = i * shape[d] + at[d];
  T v;
  std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
  return v;
}

TEST(ExpertLoader, Fp8ExpertsAndTheirBlockScalesLandWhereVllmLoadsThem) {
  const Fp8Model m;
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(fmt::format("tp 2 rank {}", rank));
    Fp8Destination d(2, rank);
    const Layout layout = layout_from_compact(expert_layout_from_storage(d.storage, 0), m.inv, 0);
    // What a source sends for this layout: every tensor's selection, scales sliced with their weights.
    std::deque<TensorInfo> infos;
    std::vector<std::vector<std::byte>> buffers;
    std::vector<TensorView> batch;
    for (const TensorInfo& t : m.inv.tensors) {
      const Selection sel = select(layout, t);
      ASSERT_NE(sel.take, Take::kDrop) << t.name;
      buffers.emplace_back(sel.info.nbytes());
      if (sel.take == Take::kSlice)
        copy_slice(m.data.at(t.name).data(), t, sel.slice, buffers.back().data());
      else
        buffers.back() = m.data.at(t.name);
      infos.push_back(sel.info);
      batch.push_back({&infos.back(), buffers.back().data()});
    }
    ExpertLoader loader(m.inv, d.storage, 0);
    const ExpertLoadResult result = loader.load(batch);
    ASSERT_EQ(result.remaining.size(), 1u);  // the layernorm
    EXPECT_EQ(result.experts, 2u * 6);       // 2 experts x (3 weights + 3 scales)
    const int64_t s = Fp8Model::kInter / 2, h = Fp8Model::kHidden;
    for (int64_t e = 0; e < Fp8Model::kExperts; ++e) {
      const std::string gate = expert_name(0, e, 0), up = expert_name(0, e, 1), down = expert_name(0, e, 2);
      const auto& sh13 = d.storage[0].shape;
      for (int64_t r = 0; r < 2 * s; ++r)
        for (int64_t c = 0; c < h; ++c) {
          const auto got = element<uint8_t>(d.w13_bytes, sh13, {e, r, c});
          const auto want = r < s ? element<uint8_t>(m.data.at(gate), m.info(gate).shape, {rank * s + r, c})
                                  : element<uint8_t>(m.data.at(up), m.info(up).shape, {rank * s + r - s, c});
          ASSERT_EQ(got, want) << "expert " << e << " w13[" << r << "," << c << "]";
        }
      for (int64_t r = 0; r < h; ++r)
        for (int64_t c = 0; c < s; ++c)
          ASSERT_EQ(element<uint8_t>(d.w2_bytes, d.storage[1].shape, {e, r, c}),
                    element<uint8_t>(m.data.at(down), m.info(down).shape, {r, rank * s + c}))
              << "expert " << e << " w2[" << r << "," << c << "]";
      // One block of 128 rows per rank: gate's scale row `rank`, then up's; down's scale column.
      const std::string gs = gate + "_scale_inv", us = up + "_scale_inv", ds = down + "_scale_inv";
      EXPECT_EQ(element<float>(d.w13_scale, d.storage[2].shape, {e, 0, 0}),
                element<float>(m.data.at(gs), m.info(gs).shape, {rank, 0}));
      EXPECT_EQ(element<float>(d.w13_scale, d.storage[2].shape, {e, 1, 0}),
                element<float>(m.data.at(us), m.info(us).shape, {rank, 0}));
      EXPECT_EQ(element<float>(d.w2_scale, d.storage[3].shape, {e, 0, 0}),
                element<float>(m.data.at(ds), m.info(ds).shape, {0, rank}));
    }
  }
}

TEST(ExpertStorageValidation, Fp8StorageNeedsItsBlockScalesAndWholeBlocks) {
  const Fp8Model m;
  // Without its scale storage an FP8 weight would serve stale scales.
  EXPECT_THAT(error_of(ErrorKind::kUnsupported, [&] { ExpertLoader(m.inv, Fp8Destination(2, 0, false).storage, 3); }),
              AllOf(HasSubstr("destination rank 3"), HasSubstr("needs its block-scale storage"),
                    HasSubstr("w13_weight_scale_inv")));
  // A scale storage whose weight is not FP8.
  Fp8Destination bf16(2, 0);
  bf16.storage[0].dtype = DType::kBFloat16;
  bf16.storage[0].quant_method.clear();
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { ExpertLoader(m.inv, bf16.storage, 3); }),
              HasSubstr("has no FP8 expert weight"));
  // A scale storage that is not the block scales of its weights' slots (up's blocks missing).
  Fp8Destination short_scales(2, 0);
  short_scales.storage[2].shape[1] = 1;
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { ExpertLoader(m.inv, short_scales.storage, 3); }),
              AllOf(HasSubstr("w13_weight_scale_inv is float32 [2, 1, 1]"), HasSubstr("are float32 [2, 2, 1]")));
  // TP 4 cuts each 128-row block of gate and up in half: refused before anything moves, naming the block.
  Fp8Destination tp4(4, 1);
  EXPECT_THAT(
      error_of(ErrorKind::kLayout, [&] { layout_from_compact(expert_layout_from_storage(tp4.storage, 1), m.inv, 1); }),
      HasSubstr("_scale_inv"));
  // Other quantizations stay refused (V34).
  Fp8Destination other(2, 0);
  other.storage[0].quant_method = "awq";
  EXPECT_THAT(error_of(ErrorKind::kUnsupported, [&] { expert_layout_from_storage(other.storage, 0); }),
              HasSubstr("unquantized"));
}

}  // namespace
}  // namespace refit
