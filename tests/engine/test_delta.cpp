// Delta refit (refit_cfg.nixl.delta) through the engine: versions, whole refits where the
// destination does not hold the base, and bit-exact results after many refits.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "core/error_of.h"
#include "delta/codec.h"
#include "delta/link_delta.h"
#include "engine_harness.h"
#include "memory/host_copy_pool.h"
#include "refit/ext/box_copy.h"

namespace refit {
namespace {

using testing::error_kind_of;
using testing::error_of;
using testing::expect_same;
using ::testing::HasSubstr;
using testing::inproc_options;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::Received;
using testing::VectorSource;

std::vector<OwnedTensor> model(uint32_t seed) {
  return {
      make_tensor("model.embed_tokens.weight", DType::kBFloat16, {512, 64}, seed + 1),  // 64 KiB: split
      make_tensor("model.layers.0.mlp.weight", DType::kBFloat16, {128, 64}, seed + 2),
      make_tensor("model.layers.0.norm.weight", DType::kFloat32, {64}, seed + 3),
      make_tensor("model.layers.0.empty", DType::kFloat32, {0, 4}, seed + 4),
      make_tensor("model.layers.0.scale", DType::kFloat8E4M3FN, {300}, seed + 5),
      make_tensor("lm_head.weight", DType::kBFloat16, {256, 64}, seed + 6),
  };
}

// An optimizer step as bits see it: `share` of each tensor's elements get new bits.
void step(std::vector<OwnedTensor>& weights, double share, uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& t : weights) {
    const size_t element = dtype_size(t.info.dtype), elements = t.data.size() / element;
    const size_t n = static_cast<size_t>(share * elements);
    for (size_t k = 0; k < n; ++k) t.data[(rng() % elements) * element] ^= std::byte{0x01};
  }
}

// One refit of `weights` through a source's side alone: the header, what goes of each tensor,
// the trailer (their memory lives until the source's next begin()).
// `threads`: the pool's (0: each tensor compared as it comes; more: in batches on them).
std::vector<TensorView> encoded(SourceDelta& source, const std::vector<OwnedTensor>& weights, uint64_t version,
                                bool measured = false, int threads = 0, size_t* early = nullptr) {
  std::vector<TensorView> views{source.begin(version, "destination rank 0", measured)};
  VectorSource inner(weights);
  HostCopyPool pool(threads);
  CopyStream copies;  // whole tensors: nothing to pack
  size_t ready_early = 0;
  auto take = [&](std::span<const TensorView> ready) { views.insert(views.end(), ready.begin(), ready.end()); };
  TensorView v;
  while (inner.next(&v)) {
    const auto ready = source.add(v, Box::whole(), *v.info, /*outlives=*/true, copies, pool);
    ready_early += ready.empty() ? 0 : 1;
    take(ready);
  }
  if (early) *early = ready_early;
  take(source.flush(pool));
  views.push_back(source.end());
  return views;
}

uint64_t bytes_of(const std::vector<OwnedTensor>& weights) {
  uint64_t n = 0;
  for (const auto& t : weights) n += t.info.nbytes();
  return n;
}

// A source and a destination with delta on, over the in-process transport; either end can be
// replaced, and every refit goes through connect() first when asked.
struct DeltaPair {
  std::shared_ptr<InProcFabric> fabric = make_inproc_fabric();
  SessionId session = new_session_id();
  std::unique_ptr<CheckpointEngine> source, destination;
  SendStats sent;

  explicit DeltaPair(DeltaMode source_delta = DeltaMode::kOn, DeltaMode destination_delta = DeltaMode::kOn) {
    source = make(source_delta);
    destination = make(destination_delta);
  }
  std::unique_ptr<CheckpointEngine> make(DeltaMode delta, bool release = false) {
    auto o = inproc_options(fabric, 16 << 10, session);
    o.config.delta = delta;
    o.config.release_after_refit = release;
    return std::make_unique<CheckpointEngine>(o);
  }
  void connect() {
    std::vector<Metadata> md = {source->prepare(), destination->prepare()};
    source->init_source(0, 1, 1, md);
    destination->init_destination(0, 1, 1, md);
  }
  ReceiveStats refit(const std::vector<OwnedTensor>& weights, Received& got, const BatchLoader& loader = nullptr) {
    auto sending = std::async(std::launch::async, [&] {
      VectorSource src(weights);
      return source->send(src);
    });
    ReceiveStats stats;
    try {
      stats = destination->receive(loader ? loader : got.loader());
    } catch (...) {
      try {
        sending.get();
      } catch (...) {
      }
      throw;
    }
    sent = sending.get();
    return stats;
  }
  // A refit that must deliver `weights` bitwise.
  ReceiveStats refit_exact(const std::vector<OwnedTensor>& weights) {
    Received got;
    ReceiveStats stats = refit(weights, got);
    expect_same(weights, got);
    return stats;
  }
};

TEST(DeltaRefit, OnlyChangedElementsCrossAndEveryRefitIsBitExact) {
  DeltaPair p;
  p.connect();
  auto weights = model(1);
  const uint64_t full = bytes_of(weights);
  auto first = p.refit_exact(weights);
  EXPECT_EQ(first.delta_tensors, 0u) << "the first refit has no base: everything goes whole";
  EXPECT_EQ(first.tensors, weights.size());
  EXPECT_GE(first.wire_bytes, full);
  for (uint32_t r = 1; r <= 6; ++r) {
    step(weights, 0.01, r);
    auto stats = p.refit_exact(weights);
    EXPECT_EQ(stats.tensors, weights.size());
    EXPECT_EQ(stats.payload_bytes, full);
    EXPECT_EQ(stats.delta_tensors, weights.size() - 1) << "all but the empty tensor come as changes";
    EXPECT_EQ(p.sent.delta_tensors, stats.delta_tensors);
    EXPECT_EQ(p.sent.tensors, weights.size());
    EXPECT_LT(stats.wire_bytes, full / 10) << "1% of the elements changed, refit " << r;
    EXPECT_FALSE(p.destination->stale());
    // Where the time went: comparing at the source, patching at the destination, each within the refit.
    EXPECT_GT(p.sent.delta_seconds, 0);
    EXPECT_LE(p.sent.delta_seconds, p.sent.seconds);
    EXPECT_GT(stats.delta_seconds, 0);
    EXPECT_LE(stats.delta_seconds, stats.total_seconds);
  }
}

TEST(DeltaRefit, UnchangedWeightsCostHeadersOnly) {
  DeltaPair p;
  p.connect();
  auto weights = model(2);
  p.refit_exact(weights);
  auto stats = p.refit_exact(weights);
  EXPECT_LT(stats.wire_bytes, 64u * (weights.size() + 2));
}

TEST(DeltaRefit, DenseChangesGoWhole) {
  DeltaPair p;
  p.connect();
  auto weights = model(3);
  p.refit_exact(weights);
  weights = model(4);  // every element new
  auto stats = p.refit_exact(weights);
  EXPECT_EQ(stats.delta_tensors, 0u);
  EXPECT_GE(stats.wire_bytes, bytes_of(weights));
}

TEST(DeltaRefit, ARestartedDestinationGetsTheWholeModelThenChangesAgain) {
  DeltaPair p;
  p.connect();
  auto weights = model(5);
  p.refit_exact(weights);
  step(weights, 0.01, 50);
  // The destination restarts: a fresh engine holds nothing, and says so in its metadata.
  p.destination = p.make(DeltaMode::kOn);
  p.connect();
  auto whole = p.refit_exact(weights);
  EXPECT_EQ(whole.delta_tensors, 0u);
  EXPECT_GE(whole.wire_bytes, bytes_of(weights));
  step(weights, 0.01, 51);
  auto delta = p.refit_exact(weights);
  EXPECT_GT(delta.delta_tensors, 0u);
}

TEST(DeltaRefit, ADestinationMayAskForTheWholeModel) {
  DeltaPair p;
  p.connect();
  auto weights = model(10);
  p.refit_exact(weights);
  step(weights, 0.01, 100);
  EXPECT_GT(p.refit_exact(weights).delta_tensors, 0u);
  p.destination->request_full_refit();
  p.connect();  // its next metadata declares no version
  step(weights, 0.01, 101);
  EXPECT_EQ(p.refit_exact(weights).delta_tensors, 0u);
  step(weights, 0.01, 102);
  EXPECT_GT(p.refit_exact(weights).delta_tensors, 0u);
}

TEST(DeltaRefit, ARestartedSourceSendsTheWholeModel) {
  DeltaPair p;
  p.connect();
  auto weights = model(6);
  p.refit_exact(weights);
  p.source = p.make(DeltaMode::kOn);  // no base
  p.connect();
  step(weights, 0.01, 60);
  auto stats = p.refit_exact(weights);
  EXPECT_EQ(stats.delta_tensors, 0u);
}

TEST(DeltaRefit, AFailedRefitIsFollowedByAWholeOne) {
  DeltaPair p;
  p.connect();
  auto weights = model(7);
  p.refit_exact(weights);
  step(weights, 0.01, 70);
  // The loader fails, after the batch's changes went into the destination's copy: neither side
  // may use its copy as a base again.
  int batches = 0;
  Received failed;
  EXPECT_THROW(p.refit(weights, failed,
                       [&](LoadBatch) {
                         if (++batches == 1) throw std::runtime_error("the inference engine ran out of memory");
                       }),
               Error);
  EXPECT_TRUE(p.destination->stale());
  p.connect();  // the same engines, prepared again (as the synchronizer does after a failure)
  step(weights, 0.01, 71);
  auto stats = p.refit_exact(weights);
  EXPECT_EQ(stats.delta_tensors, 0u);
  step(weights, 0.01, 72);
  EXPECT_GT(p.refit_exact(weights).delta_tensors, 0u);
}

TEST(DeltaRefit, VersionsSurviveAReconnectWithReleasedBuffers) {
  // release_after_refit: buffers are freed and the engines prepare again before every refit; the
  // destination declares the version it holds, so changes keep flowing.
  DeltaPair p;
  p.source = p.make(DeltaMode::kOn, true);
  p.destination = p.make(DeltaMode::kOn, true);
  auto weights = model(8);
  for (uint32_t r = 0; r < 4; ++r) {
    p.connect();
    if (r > 0) step(weights, 0.01, 80 + r);
    auto stats = p.refit_exact(weights);
    EXPECT_EQ(stats.delta_tensors > 0, r > 0) << r;
    p.source->finalize();
    p.destination->finalize();
  }
}

TEST(DeltaRefit, BothEndsMustAgree) {
  for (auto [source_delta, destination_delta] : {std::pair{DeltaMode::kOn, DeltaMode::kOff},
                                                 {DeltaMode::kOff, DeltaMode::kOn},
                                                 {DeltaMode::kAuto, DeltaMode::kOn}}) {
    DeltaPair p(source_delta, destination_delta);
    std::vector<Metadata> md = {p.source->prepare(), p.destination->prepare()};
    auto kind = error_kind_of([&] { p.source->init_source(0, 1, 1, md); });
    EXPECT_EQ(kind, ErrorKind::kConfig);
    try {
      p.destination->init_destination(0, 1, 1, md);
      FAIL() << "a destination whose delta setting differs from its source's connected";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("refit_cfg.nixl.delta"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("source rank 0"), std::string::npos) << e.what();
    }
  }
}

// A destination with a layout (a TP rank's slices, a tensor it does not hold): the source selects
// what it holds first, row and column slices packed, and compares that; every refit delivers
// exactly the slices, and after the first they come as changes.
TEST(DeltaRefit, ADestinationWithALayoutGetsItsSlicesAsChanges) {
  // Also with release_after_refit: the engines prepare again before every refit (a new pack stream).
  for (bool release : {false, true}) {
    SCOPED_TRACE(release ? "release_after_refit" : "buffers kept");
    DeltaPair p;
    auto o = inproc_options(p.fabric, 16 << 10, p.session);
    o.config.delta = DeltaMode::kOn;
    o.config.release_after_refit = release;
    o.layout = Layout{};
    o.layout->tensors["model.embed_tokens.weight"] = Request::narrow(0, 128, 256);  // rows
    o.layout->tensors["model.layers.0.mlp.weight"] = Request::narrow(1, 16, 32);    // columns: strided
    o.layout->tensors["lm_head.weight"] = Request::drop();
    p.source = p.make(DeltaMode::kOn, release);
    p.destination = std::make_unique<CheckpointEngine>(o);
    auto weights = model(7);
    for (uint32_t r = 0; r < 4; ++r) {
      if (r == 0 || release) p.connect();
      if (r > 0) step(weights, 0.01, 70 + r);
      Received got;
      const ReceiveStats stats = p.refit(weights, got);
      ASSERT_EQ(got.tensors.size(), weights.size() - 1) << "lm_head.weight is not held";
      for (const auto& t : weights) {
        const Selection s = select(*o.layout, t.info);
        if (s.take == Take::kDrop) continue;
        std::vector<std::byte> expected(s.info.nbytes());
        const Box box = Box::of(Request{s.take, s.slice});
        pack_box(t.data.data(), t.info.shape, dtype_size(t.info.dtype), box, 0, expected.size(), expected.data());
        ASSERT_TRUE(got.tensors.contains(t.info.name)) << t.info.name;
        EXPECT_EQ(got.tensors[t.info.name].info, s.info) << t.info.name;
        EXPECT_EQ(got.tensors[t.info.name].data, expected) << t.info.name << ", refit " << r;
      }
      EXPECT_EQ(p.sent.dropped, 1u);
      if (r > 0) EXPECT_EQ(stats.delta_tensors, weights.size() - 2) << "all it holds but the empty tensor";
      if (release) {
        p.source->finalize();
        p.destination->finalize();
      }
    }
  }
}

// A tensor the destination's layout holds that the stream never yields fails the refit, as
// without delta.
TEST(DeltaRefit, ALayoutTensorTheStreamNeverYieldsFailsTheRefit) {
  DeltaPair p;
  auto o = inproc_options(p.fabric, 16 << 10, p.session);
  o.config.delta = DeltaMode::kOn;
  o.layout = Layout{};
  o.layout->tensors["model.layers.9.missing"] = Request::whole();
  p.destination = std::make_unique<CheckpointEngine>(o);
  p.connect();
  Received got;
  std::string message;
  error_kind_of([&] { p.refit(model(3), got); }, &message);  // throws if the refit went through
  EXPECT_NE(message.find("never yielded"), std::string::npos) << message;
  EXPECT_NE(message.find("model.layers.9.missing"), std::string::npos) << message;
}

// A tensor the stream yields twice is refused by its name, whether it goes whole or as changes
// (which travel under names of their own), with or without a destination layout.
TEST(DeltaRefit, ATensorYieldedTwiceIsRefusedByItsOwnName) {
  for (const bool layout : {false, true}) {
    DeltaPair p;
    if (layout) {
      auto o = inproc_options(p.fabric, 16 << 10, p.session);
      o.config.delta = DeltaMode::kOn;
      o.layout = Layout{};
      o.layout->drop_prefixes.push_back("nothing.");
      p.destination = std::make_unique<CheckpointEngine>(o);
    }
    p.connect();
    auto weights = model(4);
    p.refit_exact(weights);  // every tensor has a base now
    step(weights, 0.01, 40);
    weights.push_back(weights[1]);
    Received got;
    std::string message;
    EXPECT_EQ(error_kind_of([&] { p.refit(weights, got); }, &message), ErrorKind::kInvalidArgument);
    EXPECT_THAT(message, HasSubstr("tensor '" + weights[1].info.name + "' appears twice in one refit"));
  }
}

// Where the pool has threads, a source compares its host tensors in batches on them: the same
// records, in the same order, as one at a time; a tensor twice in a batch is refused.
TEST(DeltaRefit, HostTensorsComparedOnThePoolsThreadsMakeTheSameRecords) {
  auto weights = model(11);
  for (int k = 0; k < 70; ++k)  // more tensors than a batch holds
    weights.push_back(make_tensor("extra." + std::to_string(k), DType::kBFloat16, {64, 33}, 500 + k));
  SourceDelta alone, batched;
  size_t early_alone = 0, early_batched = 0;
  for (int refit = 0; refit < 3; ++refit) {
    const std::vector<TensorView> a = encoded(alone, weights, refit == 0 ? 0 : alone.commit(0), false, 0, &early_alone);
    const std::vector<TensorView> b =
        encoded(batched, weights, refit == 0 ? 0 : batched.commit(0), false, 3, &early_batched);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 1; i < a.size(); ++i) {  // after the header (each source's versions are its own)
      EXPECT_EQ(a[i].info->name, b[i].info->name) << refit << " " << i;
      const auto bytes_a = std::span(a[i].data, a[i].info->nbytes()),
                 bytes_b = std::span(b[i].data, b[i].info->nbytes());
      EXPECT_TRUE(std::equal(bytes_a.begin(), bytes_a.end(), bytes_b.begin(), bytes_b.end())) << a[i].info->name;
    }
    if (refit > 0) EXPECT_TRUE(b[1].info->name.starts_with("refit:delta:")) << "changes went";
    EXPECT_EQ(early_alone, weights.size()) << "no threads: each tensor goes as it comes";
    EXPECT_GE(early_batched, 1u) << "a full batch goes before the stream ends";
    EXPECT_LT(early_batched, weights.size()) << "with threads, tensors wait for their batch";
    step(weights, 0.01, 40 + refit);
  }
  // The same tensor twice in one batch would update one base on two threads: refused.
  std::vector<OwnedTensor> twice{weights[0], weights[0]};
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument, [&] { encoded(batched, twice, batched.commit(0), false, 3); }),
              HasSubstr("appears twice in one refit"));
}

// A host tensor of several scan parts (an embedding) is compared in parts on the pool's threads:
// its record carries the word hash, and a destination patches it to the source's bits.
TEST(DeltaRefit, ALargeHostTensorComparedInPartsPatchesToTheSourcesBits) {
  // Parts of 16 MiB: the last one short, of every element size.
  std::vector<OwnedTensor> weights{
      make_tensor("model.embed_tokens.weight", DType::kBFloat16, {10240, 2048}, 1),  // 40 MiB: 3 parts
      make_tensor("model.norm.weight", DType::kFloat32, {2048}, 2),
      make_tensor("bytes", DType::kUInt8, {(32 << 20) + 3}, 3),     // a 3-byte third part
      make_tensor("doubles", DType::kFloat64, {(4 << 20) + 1}, 4),  // an 8-byte third part
      make_tensor("words", DType::kInt32, {(8 << 20) + 5, 1}, 5)};  // a 20-byte third part
  for (int threads : {0, 3}) {
    SourceDelta source;
    DestinationDelta destination;
    HostCopyPool pool(2);
    std::vector<TensorView> out;
    std::vector<std::shared_ptr<const void>> owners;
    uint64_t version = 0;
    for (int refit = 0; refit < 3; ++refit) {
      const std::vector<TensorView> views = encoded(source, weights, version, false, threads);
      destination.begin();
      destination.transform(views, {}, out, owners, "source rank 0", pool);
      destination.finish("source rank 0", pool);
      version = source.commit(0);
      ASSERT_EQ(out.size(), weights.size());
      for (size_t k = 0; k < weights.size(); ++k)
        ASSERT_TRUE(std::equal(weights[k].data.begin(), weights[k].data.end(), out[k].data))
            << weights[k].info.name << ", refit " << refit << ", " << threads << " threads";
      if (refit > 0)
        for (size_t k : {1, 3, 4, 5}) {  // the large ones, after the header
          ASSERT_EQ(views[k].info->name, "refit:delta:" + weights[k - 1].info.name);
          const DeltaHeader h =
              read_delta_header({reinterpret_cast<const uint8_t*>(views[k].data), views[k].info->nbytes()}, "record");
          EXPECT_EQ(h.checksum_kind, threads > 0 ? DeltaChecksum::kWords : DeltaChecksum::kXxh3);
          EXPECT_GT(h.changed, 0u);
        }
      step(weights, 0.01, 70 + refit);
    }
  }
}

// The destination's side alone: changes to a version it does not hold are refused before
// anything is written, and the same changes never apply twice.
TEST(DeltaRefit, ChangesApplyOnlyToTheirBaseAndNeverTwice) {
  auto weights = model(9);
  SourceDelta source;
  DestinationDelta destination, fresh;
  HostCopyPool pool(2);  // the checksums on threads too
  std::vector<TensorView> out;
  std::vector<std::shared_ptr<const void>> owners;
  auto run = [&](DestinationDelta& d, uint64_t version, std::vector<TensorView>* records = nullptr) {
    const std::vector<TensorView> views = encoded(source, weights, version);
    if (records) *records = views;
    d.begin();
    d.transform(views, {}, out, owners, "source rank 0", pool);
    // Whole tensors too are handed out as the destination's copy holds them, none in what came
    // (the engine gives the transfer buffer back before its loader runs).
    for (const TensorView& o : out)
      for (const TensorView& v : views)
        if (o.info->nbytes() > 0) EXPECT_FALSE(o.data >= v.data && o.data < v.data + v.info->nbytes()) << o.info->name;
    d.finish("source rank 0", pool);
    source.commit(0);
  };
  run(destination, 0);
  const uint64_t base = destination.version();
  ASSERT_NE(base, 0u);
  step(weights, 0.01, 90);
  // Keep the records of this delta refit (their memory lives until the source's next begin()).
  const std::vector<TensorView> records = encoded(source, weights, base);
  EXPECT_TRUE(records[1].info->name.starts_with("refit:delta:"));
  // A destination that holds nothing refuses them.
  fresh.begin();
  EXPECT_EQ(error_kind_of([&] { fresh.transform(records, {}, out, owners, "source rank 0", pool); }),
            ErrorKind::kProtocol);
  // The one that holds the base applies them, and gets the new bits.
  destination.begin();
  destination.transform(records, {}, out, owners, "source rank 0", pool);
  destination.finish("source rank 0", pool);
  ASSERT_EQ(out.size(), weights.size());  // every tensor, the markers left out
  for (size_t k = 0; k < weights.size(); ++k)
    EXPECT_TRUE(std::equal(weights[k].data.begin(), weights[k].data.end(), out[k].data)) << weights[k].info.name;
  // Applying them again is refused: the destination now holds the version they made.
  destination.begin();
  try {
    destination.transform(records, {}, out, owners, "source rank 0", pool);
    FAIL() << "a delta applied twice";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    EXPECT_NE(std::string(e.what()).find("refusing"), std::string::npos) << e.what();
  }
}

// A destination applies a batch's changes together (on the pool's threads): a record that comes
// twice in one batch is still applied in order, so the second application is caught by the
// checksum, naming the tensor; and the rest of the batch is exact once it is not repeated.
TEST(DeltaRefit, ARecordTwiceInOneBatchIsCaughtByItsChecksum) {
  auto weights = model(9);
  SourceDelta source;
  DestinationDelta destination;
  HostCopyPool pool(2);
  std::vector<TensorView> out;
  std::vector<std::shared_ptr<const void>> owners;
  destination.begin();
  destination.transform(encoded(source, weights, 0), {}, out, owners, "source rank 0", pool);
  destination.finish("source rank 0", pool);
  source.commit(0);
  step(weights, 0.01, 91);
  std::vector<TensorView> records = encoded(source, weights, destination.version());
  ASSERT_TRUE(records[2].info->name.starts_with("refit:delta:"));
  records.insert(records.begin() + 3, records[2]);
  destination.begin();
  try {
    destination.transform(records, {}, out, owners, "source rank 0", pool);
    FAIL() << "a record applied twice";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIntegrity);
    const std::string tensor = records[2].info->name.substr(std::string("refit:delta:").size());
    EXPECT_NE(std::string(e.what()).find("'" + tensor + "'"), std::string::npos) << e.what();
  }
}

// delta: auto on a link that maps memory on one host (the in-process transport's): a full refit
// there is one copy per byte, so delta stays off, and both ends know it.
TEST(DeltaRefit, AutoStaysOffWhereTheLinkMapsMemoryOnOneHost) {
  DeltaPair p(DeltaMode::kAuto, DeltaMode::kAuto);
  auto weights = model(3);
  p.connect();
  for (int refit = 0; refit < 3; ++refit) {
    Received got;
    const ReceiveStats stats = p.refit(weights, got);
    expect_same(weights, got);
    EXPECT_EQ(stats.delta_tensors, 0u);
    EXPECT_EQ(stats.tensors, weights.size());  // no delta header or trailer
    EXPECT_EQ(p.sent.delta_tensors, 0u);
    step(weights, 0.01, 40 + refit);
  }
}

// delta: auto elsewhere: the source sends each refit the way (changes or whole) whose last refit
// took less time, measures changes as soon as it can, and the slower way again every 8 refits.
TEST(DeltaRefit, AutoSendsEachRefitTheWayThatWasFasterAndMeasuresTheOtherAgain) {
  auto weights = model(5);
  SourceDelta source;
  DestinationDelta destination;
  HostCopyPool pool;
  std::vector<TensorView> out;
  std::vector<std::shared_ptr<const void>> owners;
  // One refit through both sides, committed as taking `whole_s` or `changes_s` by the way it
  // went; true when it sent changes.
  auto run = [&](double whole_s, double changes_s) {
    step(weights, 0.01, 7);
    const std::vector<TensorView> views = encoded(source, weights, destination.version(), true);
    const bool changes = std::any_of(views.begin(), views.end(),
                                     [](const TensorView& v) { return v.info->name.starts_with("refit:delta:"); });
    destination.begin();
    destination.transform(views, {}, out, owners, "source rank 0", pool);
    destination.finish("source rank 0", pool);
    for (size_t k = 0; k < weights.size(); ++k)
      EXPECT_TRUE(std::equal(weights[k].data.begin(), weights[k].data.end(), out[k].data)) << weights[k].info.name;
    source.commit(changes ? changes_s : whole_s);
    return changes;
  };
  EXPECT_FALSE(run(1.0, 0.2)) << "no base yet: whole";
  EXPECT_TRUE(run(1.0, 0.2)) << "changes not measured yet: tried";
  int whole = 0;
  for (int refit = 0; refit < 16; ++refit) whole += run(1.0, 0.2) ? 0 : 1;
  EXPECT_EQ(whole, 2) << "changes are faster: whole again only every 8th refit";
  // Changes become the slower way (a fast link, dense changes): the next refits go whole, and
  // changes are measured again every 8th.
  EXPECT_TRUE(run(1.0, 3.0));
  std::vector<bool> ways;
  for (int refit = 0; refit < 16; ++refit) ways.push_back(run(1.0, 3.0));
  EXPECT_EQ(std::count(ways.begin(), ways.end(), true), 2);
  EXPECT_FALSE(ways.front());
}

}  // namespace
}  // namespace refit
