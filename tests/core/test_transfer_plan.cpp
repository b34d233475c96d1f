// The transfer plan (transfer_plan.h), source-layout builders and box copies, checked by moving
// real bytes: every source holds only its shard of a patterned model, every piece of the plan is
// packed from a shard in bucket-sized chunks and placed into its destination, and every byte each
// destination needs must then be there, written exactly once.
#include "refit/transfer_plan.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "core/error_of.h"
#include "core/reshard_models.h"
#include "refit/ext/box_copy.h"
#include "refit/fp8.h"
#include "refit/layout_builders.h"

namespace refit {
namespace {

using ::testing::AllOf;
using testing::deepseek;
using testing::error_of;
using ::testing::HasSubstr;
using testing::Model;
using testing::patterned;
using testing::qwen_moe;

using testing::Side;
using testing::vllm_side;

// The slice of tensor `t` a layout names, as a box of the whole tensor, and its origin for
// relative_to (dim -1: whole).
Slice origin_of(const Request& r) { return r.take == Take::kSlice ? r.slice : Slice{-1, 0, 0}; }

// Moves the plan's bytes as the engine does (each piece packed from the source's shard in chunks
// of at most `chunk` bytes, placed into the destination's tensor) and checks every destination.
void move_and_check(const ModelInventory& inv, std::span<const Layout> sources, std::span<const Layout> destinations,
                    const TransferPlan& plan, uint64_t chunk, const std::string& what) {
  const auto full = patterned(inv);
  // Each source holds only its shards.
  std::vector<std::map<uint32_t, std::vector<std::byte>>> shards(sources.size());
  for (size_t s = 0; s < sources.size(); ++s)
    for (uint32_t i = 0; i < inv.tensors.size(); ++i) {
      const Request r = sources[s].request_for(inv.tensors[i].name);
      if (r.take == Take::kDrop) continue;
      const TensorInfo& t = inv.tensors[i];
      std::vector<std::byte> shard(Box::of(r).nbytes_in(t));
      pack_box(full[i].data(), t.shape, dtype_size(t.dtype), Box::of(r), 0, shard.size(), shard.data());
      shards[s][i] = std::move(shard);
    }
  std::vector<std::map<uint32_t, std::vector<std::byte>>> got(destinations.size()), written(destinations.size());
  for (const TransferPiece& p : plan.pieces()) {
    const TensorInfo& t = inv.tensors[p.tensor];
    const uint64_t e = dtype_size(t.dtype);
    const Request held = sources[p.source].request_for(t.name);
    const Request need = destinations[p.destination].request_for(t.name);
    ASSERT_NE(held.take, Take::kDrop) << what << ": source " << p.source << " sends '" << t.name << "' it lacks";
    ASSERT_NE(need.take, Take::kDrop) << what << ": destination " << p.destination << " gets '" << t.name << "'";
    ASSERT_EQ(p.bytes, p.box.nbytes_in(t)) << what;
    const auto shard_shape = Box::of(held).shape_in(t.shape);
    const auto dest_shape = Box::of(need).shape_in(t.shape);
    auto& dest = got[p.destination][p.tensor];
    auto& mask = written[p.destination][p.tensor];
    dest.resize(Box::of(need).nbytes_in(t));
    mask.resize(dest.size());
    const Box in_shard = p.box.relative_to(origin_of(held)), in_dest = p.box.relative_to(origin_of(need));
    for (uint64_t at = 0; at < p.bytes; at += chunk) {
      const uint64_t n = std::min(chunk, p.bytes - at);
      std::vector<std::byte> packed(n), seen(n), ones(n, std::byte{1});
      pack_box(shards[p.source].at(p.tensor).data(), shard_shape, e, in_shard, at, n, packed.data());
      pack_box(mask.data(), dest_shape, e, in_dest, at, n, seen.data());
      ASSERT_TRUE(std::all_of(seen.begin(), seen.end(), [](std::byte b) { return b == std::byte{0}; }))
          << what << ": a byte of '" << t.name << "' for destination " << p.destination << " written twice";
      unpack_box(packed.data(), dest_shape, e, in_dest, at, n, dest.data());
      unpack_box(ones.data(), dest_shape, e, in_dest, at, n, mask.data());
    }
  }
  for (size_t d = 0; d < destinations.size(); ++d) {
    uint64_t needed = 0;
    for (uint32_t i = 0; i < inv.tensors.size(); ++i) {
      const TensorInfo& t = inv.tensors[i];
      const Request need = destinations[d].request_for(t.name);
      if (need.take == Take::kDrop) {
        EXPECT_FALSE(got[d].count(i)) << what << ": destination " << d << " got '" << t.name << "' it does not hold";
        continue;
      }
      std::vector<std::byte> expected(Box::of(need).nbytes_in(t));
      needed += expected.size();
      pack_box(full[i].data(), t.shape, dtype_size(t.dtype), Box::of(need), 0, expected.size(), expected.data());
      ASSERT_TRUE(got[d].count(i)) << what << ": destination " << d << " never got '" << t.name << "'";
      ASSERT_EQ(got[d][i], expected) << what << ": destination " << d << ", tensor '" << t.name << "'";
    }
    EXPECT_EQ(plan.ingress()[d], needed) << what << ": destination " << d << " receives more than it keeps";
  }
}

TEST(BoxCopy, ChunksOfAPackedBoxMatchTheWholeBox) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int64_t> shape;
    const int rank = 1 + rng() % 4;
    for (int d = 0; d < rank; ++d) shape.push_back(1 + rng() % 6);
    TensorInfo t{"t", DType::kBFloat16, shape};
    std::vector<std::byte> tensor(t.nbytes());
    for (size_t b = 0; b < tensor.size(); ++b) tensor[b] = std::byte(b * 7 + 3);
    Box box;
    const int cuts = rng() % 3;
    for (int c = 0; c < cuts && c < rank; ++c) {
      const int32_t dim = (c == 0 ? 0 : 1) + rng() % std::max(1, rank - 1);
      if (dim >= rank || box.along(dim, shape).length != shape[dim]) continue;
      const int64_t start = rng() % shape[dim];
      box = box.narrowed({dim, start, 1 + static_cast<int64_t>(rng() % (shape[dim] - start))});
    }
    // The reference: element by element, row-major over the box.
    const auto extent = box.shape_in(shape);
    std::vector<std::byte> expected;
    std::vector<int64_t> index(rank, 0);
    const uint64_t total = box.nbytes_in(t);
    for (uint64_t k = 0; k < total / 2; ++k) {
      uint64_t offset = 0;
      for (int d = 0; d < rank; ++d) offset = offset * shape[d] + box.along(d, shape).start + index[d];
      expected.push_back(tensor[offset * 2]);
      expected.push_back(tensor[offset * 2 + 1]);
      for (int d = rank - 1; d >= 0 && ++index[d] == extent[d]; --d) index[d] = 0;
    }
    std::vector<std::byte> packed(total), back(tensor.size());
    for (uint64_t at = 0; at < total;) {
      const uint64_t n = std::min<uint64_t>(1 + rng() % 9, total - at);
      pack_box(tensor.data(), shape, 2, box, at, n, packed.data() + at);
      unpack_box(packed.data() + at, shape, 2, box, at, n, back.data());
      at += n;
    }
    ASSERT_EQ(packed, expected) << "shape " << shape_string(shape) << ", box " << to_string(box);
    std::vector<std::byte> repacked(total);
    pack_box(back.data(), shape, 2, box, 0, total, repacked.data());
    EXPECT_EQ(repacked, expected) << to_string(box);
  }
}

TEST(TransferPlan, EveryDestinationGetsExactlyItsBytesOverManyLayoutPairs) {
  std::mt19937 rng(2026);
  int checked = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const Model& m = trial % 2 ? deepseek() : qwen_moe();
    Side sources;
    if (rng() % 4 == 0) {
      const int world = 1 + rng() % 5;
      sources.name = fmt::format("FSDP {}", world);
      for (int r = 0; r < world; ++r) sources.layouts.push_back(fsdp_source_layout(m.inventory, world, r));
    } else {
      TrainingParallel t;
      t.tp_size = 1 << (rng() % 3);
      if (&m == &qwen_moe()) t.tp_size = std::min(t.tp_size, 2);  // Megatron's limit: its 2 KV heads
      t.pp_size = 1 + rng() % 2;
      t.dp_size = 1 + rng() % 2;
      t.ep_size = 1 << (rng() % 3);
      t.expert_tp_size = rng() % 2 ? 1 : t.tp_size;
      if ((t.tp_size * t.dp_size) % (*t.expert_tp_size * t.ep_size) != 0) t.ep_size = 1;
      sources.name = fmt::format("Megatron tp{} pp{} dp{} ep{} etp{}", t.tp_size, t.pp_size, t.dp_size, t.ep_size,
                                 *t.expert_tp_size);
      sources.layouts = megatron_source_layouts(m.inventory, m.dims, t);
    }
    const Side dest = vllm_side(m, 1 << (rng() % 3), 1 + rng() % 2, rng() % 2, rng() % 4 != 0);
    const std::string what = sources.name + " -> " + dest.name + " (" + m.inventory.name + ")";
    const TransferPlan plan = plan_transfers(m.inventory, sources.layouts, dest.layouts);
    move_and_check(m.inventory, sources.layouts, dest.layouts, plan, 1 + rng() % 5000, what);
    if (HasFatalFailure()) return;
    ++checked;
  }
  EXPECT_EQ(checked, 60);
}

// ---- FP8 weights with their scales ------------------------------------------------------------

// Every FP8 scale a destination gets is exactly the blocks of the weight slice it gets.
void expect_scales_follow_weights(const ModelInventory& inv, const Layout& need, const std::string& what) {
  for (const auto& link : fp8_scales_of(inv)) {
    const Request weight = need.request_for(inv.tensors[link.weight].name);
    EXPECT_EQ(need.request_for(inv.tensors[link.scale].name), fp8_scale_request(inv, link, weight, what))
        << what << ": " << inv.tensors[link.scale].name;
  }
}

TEST(TransferPlan, Fp8WeightsReshardWithTheirScaleBlocks) {
  int sliced_scales = 0;
  for (const Model* m : {&testing::qwen_moe_fp8(), &testing::deepseek_fp8()}) {
    std::vector<Side> source_sides;
    for (TrainingParallel t :
         {TrainingParallel{2, 1, 2, 2, 1}, TrainingParallel{2, 1, 1, 1, std::nullopt}, TrainingParallel{1, 2, 4, 4, 1}})
      source_sides.push_back({fmt::format("Megatron tp{} pp{} ep{}", t.tp_size, t.pp_size, t.ep_size),
                              megatron_source_layouts(m->inventory, m->dims, t)});
    Side fsdp{"FSDP 3", {}};  // shards every tensor (scales too) on its own: a source may
    for (int r = 0; r < 3; ++r) fsdp.layouts.push_back(fsdp_source_layout(m->inventory, 3, r));
    source_sides.push_back(fsdp);
    for (const Side& dest :
         {vllm_side(*m, 2, 1, false, true), vllm_side(*m, 2, 2, true, true), vllm_side(*m, 1, 2, false, false)}) {
      for (const Side& sources : source_sides) {
        const std::string what = sources.name + " -> " + dest.name + " (" + m->inventory.name + ")";
        const TransferPlan plan = plan_transfers(m->inventory, sources.layouts, dest.layouts);
        move_and_check(m->inventory, sources.layouts, dest.layouts, plan, 3000, what);
        if (HasFatalFailure()) return;
        // The plan moves the scale bytes: each destination receives what its layout says it keeps.
        for (size_t d = 0; d < dest.layouts.size(); ++d)
          EXPECT_EQ(plan.ingress()[d], layout_bytes(dest.layouts[d], m->inventory).bytes) << what;
      }
      for (const Layout& need : dest.layouts) {
        expect_scales_follow_weights(m->inventory, need, dest.name);
        for (const auto& link : fp8_scales_of(m->inventory))
          sliced_scales += need.request_for(m->inventory.tensors[link.scale].name).take == Take::kSlice;
      }
    }
  }
  EXPECT_GT(sliced_scales, 100);  // the check above was not only about whole scales
}

TEST(TransferPlan, Fp8SlicesThatCutScaleBlocksAreRefusedBeforeAnyTransfer) {
  const Model& m = testing::qwen_moe_fp8();
  // TP 4 narrows each expert's 256 gate/up rows to 64: half a scale block.
  EXPECT_THAT(
      error_of(ErrorKind::kLayout, [&] { vllm_side(m, 4, 1, false, true); }),
      AllOf(HasSubstr("destination rank 0"), HasSubstr("cuts through scale block 0"), HasSubstr("_scale_inv'")));
  // Megatron TP 4 of DeepSeek-V3's MLA: kv_b_proj's 4 x 192 rows in 192-row shards.
  const Model& mla = testing::deepseek_fp8();
  TrainingParallel tp4{4, 1, 1, 1, std::nullopt};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { megatron_source_layouts(mla.inventory, mla.dims, tp4); }),
              AllOf(HasSubstr("source rank 0"), HasSubstr("kv_b_proj.weight' slice dim 0 [0, 192)")));

  // A layout written by hand that slices a weight but not its scale.
  const auto sources = megatron_source_layouts(m.inventory, m.dims, {2, 1, 1, 1, std::nullopt});
  Layout need;
  need.tensors["model.layers.1.self_attn.q_proj.weight"] = Request::narrow(0, 256, 256);
  const std::vector<Layout> needs{need};
  EXPECT_THAT(
      error_of(ErrorKind::kLayout, [&] { plan_transfers(m.inventory, sources, needs); }),
      AllOf(HasSubstr("destination rank 0 asks for FP8 scale 'model.layers.1.self_attn.q_proj.weight_scale_inv' as "
                      "whole but for its weight 'model.layers.1.self_attn.q_proj.weight' as dim 0 [256, 512), which "
                      "needs dim 0 [2, 4) of the scale")));
  add_fp8_scale_requests(need, m.inventory, "destination rank 0");
  const std::vector<Layout> fixed{need};
  const TransferPlan plan = plan_transfers(m.inventory, sources, fixed);
  move_and_check(m.inventory, sources, fixed, plan, 1000, "hand-written layout with its scales added");
}

TEST(TransferPlan, ReplicasShareTheEgress) {
  const Model& m = qwen_moe();
  TrainingParallel t;
  t.dp_size = 4;  // four full replicas
  const auto sources = megatron_source_layouts(m.inventory, m.dims, t);
  const auto dest = vllm_side(m, 4, 1, false, true).layouts;
  const TransferPlan plan = plan_transfers(m.inventory, sources, dest);
  const auto [lo, hi] = std::minmax_element(plan.egress().begin(), plan.egress().end());
  EXPECT_GT(*lo, 0u);
  EXPECT_LT(static_cast<double>(*hi) / *lo, 1.25) << "egress " << *lo << " .. " << *hi;
  // Fan-in: every destination reads from several replicas at once.
  for (uint32_t d = 0; d < 4; ++d) EXPECT_GE(plan.sources_of(d).size(), 2u) << "destination " << d;
}

TEST(TransferPlan, TheSamePlanEveryTime) {
  const Model& m = deepseek();
  TrainingParallel t{2, 2, 2, 2, std::nullopt};
  const auto sources = megatron_source_layouts(m.inventory, m.dims, t);
  const auto dest = vllm_side(m, 2, 1, true, true).layouts;
  const TransferPlan a = plan_transfers(m.inventory, sources, dest), b = plan_transfers(m.inventory, sources, dest);
  ASSERT_EQ(a.pieces().size(), b.pieces().size());
  for (size_t k = 0; k < a.pieces().size(); ++k) {
    EXPECT_EQ(a.pieces()[k].source, b.pieces()[k].source);
    EXPECT_EQ(a.pieces()[k].box, b.pieces()[k].box);
  }
}

// An engine keeps only its own links' pieces; with replicas sharing the egress (where a piece goes
// depends on every destination before it), its links and their buckets must still be the whole
// plan's.
TEST(TransferPlan, AnEnginesScopedPlanHasItsLinksOfTheWholePlan) {
  const Model& m = qwen_moe();
  TrainingParallel t;
  t.tp_size = 2;
  t.dp_size = 2;
  const auto sources = megatron_source_layouts(m.inventory, m.dims, t);
  const auto dest = vllm_side(m, 4, 1, false, true).layouts;
  const TransferPlan all = plan_transfers(m.inventory, sources, dest);
  const uint32_t S = all.source_count(), D = all.destination_count();
  auto same_pieces = [](std::span<const TransferPiece> a, std::span<const TransferPiece> b) {
    if (a.size() != b.size()) return false;
    for (size_t k = 0; k < a.size(); ++k)
      if (a[k].tensor != b[k].tensor || a[k].source != b[k].source || !(a[k].box == b[k].box)) return false;
    return true;
  };
  size_t kept = 0;
  for (uint32_t r = 0; r < S + D; ++r) {
    const bool source = r < S;
    const uint32_t rank = source ? r : r - S;
    const TransferPlan mine =
        plan_transfers(m.inventory, sources, dest, source ? PlanScope::source(rank) : PlanScope::destination(rank));
    EXPECT_EQ(mine.egress(), all.egress());
    for (uint32_t s = 0; s < S; ++s) EXPECT_EQ(mine.destinations_of(s), all.destinations_of(s)) << "source " << s;
    for (uint32_t d = 0; d < D; ++d) {
      EXPECT_EQ(mine.sources_of(d), all.sources_of(d)) << "destination " << d;
      for (uint32_t s = 0; s < S; ++s) {
        EXPECT_EQ(mine.link_bucket_bytes(s, d, 1 << 20), all.link_bucket_bytes(s, d, 1 << 20));
        if ((source ? s : d) == rank) {
          EXPECT_TRUE(same_pieces(mine.link(s, d), all.link(s, d))) << "link " << s << " -> " << d;
        } else if (!all.link(s, d).empty()) {
          error_of(ErrorKind::kInternal, [&] { mine.link(s, d); });
        }
      }
    }
    kept += mine.pieces().size();
  }
  // Each piece is kept by its source and by its destination, by no one else.
  EXPECT_EQ(kept, 2 * all.pieces().size());
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] { plan_transfers(m.inventory, sources, dest, PlanScope::destination(4)); }),
              HasSubstr("scoped to destination rank 4 of a group of 4 sources and 4 destinations"));
}

TEST(TransferPlan, OverlappingSourceSlicesAreRefusedNamingBothSources) {
  const Model& m = qwen_moe();
  const std::string name = "model.layers.0.mlp.experts.0.gate_proj.weight";  // [32, 64]
  Layout a, b;
  a.tensors[name] = Request::narrow(0, 0, 20);
  b.tensors[name] = Request::narrow(0, 16, 16);
  const Layout sources[] = {a, b};
  const Layout dest[] = {Layout{}};
  EXPECT_THAT(
      error_of(ErrorKind::kLayout, [&] { plan_transfers(m.inventory, sources, dest); }),
      AllOf(HasSubstr("source layouts overlap on tensor '" + name + "'"),
            HasSubstr("source rank 0 holds its dim 0 [0, 20)"), HasSubstr("source rank 1 holds its dim 0 [16, 32)")));
  // Slices of two different dims always overlap, as do a whole tensor and a slice of it.
  b.tensors[name] = Request::narrow(1, 0, 8);
  const Layout two_dims[] = {a, b};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { plan_transfers(m.inventory, two_dims, dest); }),
              HasSubstr("source layouts overlap"));
}

TEST(TransferPlan, ANeededSliceNobodyHoldsIsRefusedNamingTheDestination) {
  const Model& m = qwen_moe();
  const std::string name = "model.layers.2.self_attn.o_proj.weight";  // [64, 64]
  Layout a, b;
  a.tensors[name] = Request::narrow(1, 0, 16);
  b.tensors[name] = Request::narrow(1, 32, 32);  // columns [16, 32) are nowhere
  Layout need;
  need.fallback = Take::kDrop;
  need.tensors[name] = Request::narrow(0, 8, 8);
  const Layout sources[] = {a, b};
  const Layout dest[] = {Layout{}, need};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { plan_transfers(m.inventory, sources, dest); }),
              HasSubstr("but no source holds dim 1 [16, 32) of it"));
  // Destination 1 alone: its rows of those columns are missing too, and it is named.
  const Layout only_one[] = {need};
  auto message = error_of(ErrorKind::kLayout, [&] { plan_transfers(m.inventory, sources, only_one); });
  EXPECT_THAT(message, AllOf(HasSubstr("destination rank 0 needs dim 0 [8, 16) of tensor '" + name + "'"),
                             HasSubstr("no source holds dim 1 [16, 32)")));
  // A tensor no source holds at all.
  Layout nothing;
  nothing.fallback = Take::kDrop;
  const Layout empty_sources[] = {nothing};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { plan_transfers(m.inventory, empty_sources, only_one); }),
              HasSubstr("but no source holds any of it"));
}

TEST(TransferPlan, LayoutsThatDoNotFitTheModelAreRefusedNamingTheirOwner) {
  const Model& m = qwen_moe();
  Layout bad;
  bad.tensors["model.layers.0.self_attn.o_proj.weight"] = Request::narrow(0, 60, 8);  // rows 60..68 of 64
  const Layout sources[] = {Layout{}, bad};
  const Layout dest[] = {Layout{}};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { plan_transfers(m.inventory, sources, dest); }),
              AllOf(HasSubstr("layout of source rank 1"), HasSubstr("is outside its size 64")));
  Layout unknown;
  unknown.tensors["model.layers.99.nothing.weight"] = Request::whole();
  const Layout dest_unknown[] = {unknown};
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [&] {
                         plan_transfers(m.inventory, {sources, 1}, dest_unknown);
                       }),
              HasSubstr("layout of destination rank 0 lists tensor 'model.layers.99.nothing.weight'"));
}

TEST(SourceLayouts, DTensorPlacementsShardAsTorchDoes) {
  const int64_t shape[] = {10, 6};
  const Placement hsdp[] = {Placement::replicate(), Placement::shard_dim(0)};
  const int mesh[] = {2, 4};
  // Shard(0) over 4: chunks of ceil(10 / 4) = 3: [0,3) [3,6) [6,9) [9,10).
  std::vector<Request> got;
  for (int r = 0; r < 4; ++r) {
    const int at[] = {1, r};
    got.push_back(dtensor_request("w", shape, hsdp, mesh, at));
  }
  EXPECT_EQ(got[0], Request::narrow(0, 0, 3));
  EXPECT_EQ(got[3], Request::narrow(0, 9, 1));
  // Nested Shard(0), Shard(0) over (2, 2): halves, then halves of those.
  const Placement nested[] = {Placement::shard_dim(0), Placement::shard_dim(0)};
  const int mesh2[] = {2, 2}, at[] = {1, 1};
  EXPECT_EQ(dtensor_request("w", shape, nested, mesh2, at), Request::narrow(0, 8, 2));
  const Placement two_dims[] = {Placement::shard_dim(0), Placement::shard_dim(1)};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { dtensor_request("w", shape, two_dims, mesh2, at); }),
              HasSubstr("tensor 'w' is sharded along dims 0 and 1"));
}

TEST(SourceLayouts, MegatronWithMoreTensorRanksThanKvHeadsIsRefused) {
  // Megatron then splits its fused q/k/v into equal row blocks (checked against megatron-core in
  // python/tests/test_megatron_layouts.py): no slice of the HF q/k/v says what a rank holds.
  const Model& m = qwen_moe();  // 2 KV heads
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [&] {
                         megatron_source_layouts(m.inventory, m.dims, {4, 1, 1, 1, std::nullopt});
                       }),
              HasSubstr("tp 4 exceeds num_key_value_heads 2"));
  EXPECT_EQ(megatron_source_layouts(m.inventory, m.dims, {2, 1, 2, 1, std::nullopt}).size(), 4u);
  // MLA has no per-head K/V projections: any TP that divides its heads.
  EXPECT_EQ(megatron_source_layouts(deepseek().inventory, deepseek().dims, {4, 1, 1, 1, std::nullopt}).size(), 4u);
}

TEST(SourceLayouts, MegatronRanksSplitExpertsWithinAStage) {
  const Model& m = qwen_moe();
  TrainingParallel t{2, 2, 2, 4, 1};  // tp2 pp2 dp2 ep4 etp1: 8 ranks, 4 per stage
  const auto layouts = megatron_source_layouts(m.inventory, m.dims, t);
  ASSERT_EQ(layouts.size(), 8u);
  // Rank 5: stage 1 (layers 2, 3), tp rank 1, ep rank 1 (experts 2, 3), whole experts (etp 1).
  const Layout& l = layouts[5];
  EXPECT_EQ(l.request_for("model.layers.0.input_layernorm.weight").take, Take::kDrop);
  EXPECT_EQ(l.request_for("model.layers.3.mlp.experts.2.down_proj.weight").take, Take::kWhole);
  EXPECT_EQ(l.request_for("model.layers.3.mlp.experts.4.down_proj.weight").take, Take::kDrop);
  EXPECT_EQ(l.request_for("model.layers.3.self_attn.o_proj.weight"), Request::narrow(1, 32, 32));
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [&] {
                         megatron_source_layouts(m.inventory, m.dims, {1, 1, 2, 4, 1});
                       }),
              HasSubstr("cannot be split into expert tp 1 x ep 4 groups"));
  // megatron-core's MoE layer asserts that ep divides the experts: no uneven placement is described.
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [&] {
                         megatron_source_layouts(m.inventory, m.dims, {1, 1, 3, 3, 1});
                       }),
              HasSubstr("ep 3 does not divide the 8 routed experts"));
}

// The paired topology is the degenerate plan: source i serves destination i with its whole
// bucket, the sources past the destinations idle, no pieces planned ahead.
TEST(TransferPlan, ThePairedTopologyIsTheDegeneratePlan) {
  const TransferPlan plan = paired_plan(3, 2);
  EXPECT_TRUE(plan.paired());
  EXPECT_EQ(plan.source_count(), 3u);
  EXPECT_EQ(plan.destination_count(), 2u);
  EXPECT_EQ(plan.destinations_of(0), std::vector<uint32_t>{0});
  EXPECT_EQ(plan.destinations_of(1), std::vector<uint32_t>{1});
  EXPECT_TRUE(plan.destinations_of(2).empty());
  EXPECT_EQ(plan.sources_of(1), std::vector<uint32_t>{1});
  EXPECT_TRUE(plan.link(0, 0).empty());
  EXPECT_EQ(plan.link_bucket_bytes(1, 1, 5000), 5000u);  // one link per end: the engine's buffers
  EXPECT_THAT(error_of(ErrorKind::kTopology, [] { paired_plan(1, 2); }),
              HasSubstr("paired refit needs train_world_size >= rollout_world_size"));
  EXPECT_THAT(error_of(ErrorKind::kTopology, [] { paired_plan(0, 1); }), HasSubstr("world sizes must be >= 1"));
  ModelInventory model;
  model.tensors.push_back({"w", DType::kFloat32, {4}});
  EXPECT_FALSE(plan_transfers(model, std::vector<Layout>(1), std::vector<Layout>(1)).paired());
}

}  // namespace
}  // namespace refit
