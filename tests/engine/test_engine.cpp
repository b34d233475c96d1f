#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <thread>
#include <tuple>

#include "core/error_of.h"
#include "engine/protocol.h"
#include "engine_harness.h"
#include "refit/error.h"
#include "transport/fault_injection.h"

namespace refit {
namespace {

using testing::error_kind_of;
using testing::expect_same;
using testing::inproc_options;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::Pair;
using testing::Received;
using testing::RogueSource;
using testing::VectorSource;

std::vector<OwnedTensor> mixed_model(uint32_t seed) {
  return {
      make_tensor("model.embed_tokens.weight", DType::kBFloat16, {64, 16}, seed + 1),  // 2048 B: split
      make_tensor("model.layers.0.norm.weight", DType::kFloat32, {16}, seed + 2),
      make_tensor("model.layers.0.empty", DType::kFloat32, {0, 4}, seed + 3),
      make_tensor("model.layers.0.bias", DType::kFloat8E4M3FN, {7}, seed + 4),
      make_tensor("model.layers.0.ids", DType::kInt64, {3}, seed + 5),
      make_tensor("lm_head.weight", DType::kBFloat16, {300}, seed + 6),
  };
}

TEST(Engine, DeliversEveryTensorBitwiseWithSplitsAlignmentAndEmptyTensors) {
  Pair p(256);
  p.connect();
  auto weights = mixed_model(1);
  Received got;
  auto stats = p.refit(weights, got);
  expect_same(weights, got);
  EXPECT_EQ(stats.tensors, weights.size());
  EXPECT_FALSE(p.destination->stale());
  // Only the used part of each bucket crosses: padding aside, no more than the payload.
  uint64_t payload = 0;
  for (const auto& t : weights) payload += t.info.nbytes();
  EXPECT_EQ(stats.payload_bytes, payload);
  EXPECT_LT(stats.wire_bytes, payload + 64);
}

TEST(Engine, AViewSourceStreamsTheCallersTensorsOnceInOrderForInPlaceReads) {
  const auto weights = mixed_model(9);
  std::vector<TensorView> views;
  for (const auto& t : weights) views.push_back({&t.info, t.data.data(), MemoryKind::kHost});
  ViewSource source(views);
  EXPECT_TRUE(source.views_outlive_send());  // the caller's own tensors: destinations may read them in place
  TensorView v;
  for (const auto& expected : views) {
    ASSERT_TRUE(source.next(&v));
    EXPECT_EQ(v.info, expected.info);
    EXPECT_EQ(v.data, expected.data);
  }
  EXPECT_FALSE(source.next(&v));
  EXPECT_FALSE(source.next(&v));  // stays at the end

  // Through an engine: every tensor arrives bitwise.
  Pair p(256);
  p.connect();
  Received got;
  auto sending = std::async(std::launch::async, [&] {
    ViewSource again(views);
    return p.source->send(again);
  });
  p.destination->receive(got.loader());
  EXPECT_EQ(sending.get().tensors, weights.size());
  expect_same(weights, got);
}

TEST(Engine, StagedAndMappedDestinationsGetTheSameBytesOverManyBuckets) {
  // 40-byte buckets: many buckets in flight, split tensors; both ways of reading, three refits.
  for (bool map : {false, true}) {
    Pair p(40, false, 10.0, map);
    p.connect();
    for (uint32_t r = 0; r < 3; ++r) {
      auto weights = mixed_model(100 * r + 7);
      Received got;
      auto stats = p.refit(weights, got);
      expect_same(weights, got);
      EXPECT_EQ(stats.mapped, map);
      EXPECT_GT(stats.buckets, 50u);
    }
  }
}

// Every bucket leaves a trace on both sides, in the order the pipeline runs it: packed, announced,
// read (staged only), loaded, released; the source sees each release after the load began.
TEST(Engine, BothSidesRecordEveryBucketOnTheTimeline) {
  for (bool map : {false, true}) {
    Pair p(40, false, 10.0, map);
    p.connect();
    auto weights = mixed_model(11);
    Received got;
    const double before = timeline_now();
    auto stats = p.refit(weights, got);
    const double after = timeline_now();
    // (source side?, phase, bucket) -> event
    std::map<std::tuple<bool, TimelinePhase, uint64_t>, TimelineEvent> at;
    for (const bool source : {true, false})
      for (const auto& e : source ? p.sent_stats.events : stats.events) {
        EXPECT_LE(before, e.start);
        EXPECT_LE(e.start, e.end);
        EXPECT_LE(e.end, after);
        EXPECT_EQ(e.peer, 0u);
        EXPECT_TRUE(at.emplace(std::tuple(source, e.phase, e.bucket), e).second)
            << to_string(e.phase) << " twice for bucket " << e.bucket;
      }
    auto count = [&](TimelinePhase phase) {
      return std::count_if(at.begin(), at.end(), [&](const auto& kv) { return std::get<1>(kv.first) == phase; });
    };
    auto event = [&](bool source, TimelinePhase phase, uint64_t bucket) { return at.at({source, phase, bucket}); };
    const auto buckets = static_cast<long>(stats.buckets);
    ASSERT_GT(buckets, 10);
    EXPECT_EQ(count(TimelinePhase::kPack), buckets);
    EXPECT_EQ(count(TimelinePhase::kAnnounce), buckets);
    EXPECT_EQ(count(TimelinePhase::kLoad), buckets);
    EXPECT_EQ(count(TimelinePhase::kRelease), 2 * buckets);  // seen by each side
    EXPECT_EQ(count(TimelinePhase::kRead), map ? 0 : buckets);
    uint64_t packed = 0, pieces = 0;
    for (long b = 0; b < buckets; ++b) {
      const auto pack = event(true, TimelinePhase::kPack, b);
      const auto announce = event(true, TimelinePhase::kAnnounce, b);
      const auto load = event(false, TimelinePhase::kLoad, b);
      EXPECT_LE(load.start, event(false, TimelinePhase::kRelease, b).start) << b;
      packed += pack.bytes;
      EXPECT_LE(pack.end, announce.start) << b;
      EXPECT_LE(announce.start, load.start) << b;
      if (!map) {
        const auto read = event(false, TimelinePhase::kRead, b);
        EXPECT_LE(announce.start, read.start) << b;
        EXPECT_LE(read.end, load.start) << b;
        EXPECT_EQ(read.bytes, pack.bytes) << b;
      }
      EXPECT_EQ(load.bytes, pack.bytes) << b;
      // Both sides count the same tensor pieces in a bucket.
      EXPECT_GE(pack.pieces, 1u) << b;
      EXPECT_EQ(load.pieces, pack.pieces) << b;
      pieces += pack.pieces;
    }
    // Every tensor is a piece, plus one more wherever a bucket boundary cuts one.
    EXPECT_GE(pieces, weights.size());
    EXPECT_LE(pieces, weights.size() + buckets - 1);
    EXPECT_GT(pieces, weights.size());  // 40-byte buckets do cut tensors
    EXPECT_EQ(packed, stats.wire_bytes);
  }
}

TEST(Engine, AReceiveOnlyDestinationAllocatesBuffersOnlyWhenItCannotMapItsSource) {
  for (bool map : {true, false}) {
    for (bool release : {false, true}) {
      Pair p(64, release, 10.0, map, /*receives_only=*/true);
      for (uint32_t r = 0; r < 2; ++r) {
        if (release || r == 0) p.connect();
        auto weights = mixed_model(3 * r + 1);
        Received got;
        auto stats = p.refit(weights, got);
        expect_same(weights, got);
        EXPECT_EQ(stats.mapped, map);
        EXPECT_EQ(stats.buffer_bytes, map ? 0u : 128u) << "map " << map;
        if (release) {
          p.source->finalize();
          p.destination->finalize();
        }
      }
    }
  }
}

TEST(Engine, AReceiveOnlyEngineCannotSendNorFeedADestination) {
  auto fabric = make_inproc_fabric();
  SessionId session = new_session_id();
  auto a_options = inproc_options(fabric, 64, session), b_options = inproc_options(fabric, 64, session);
  a_options.receives_only = b_options.receives_only = true;
  CheckpointEngine a(a_options), b(b_options);
  std::vector<Metadata> md = {a.prepare(), b.prepare()};
  std::string message = testing::error_of(ErrorKind::kInvalidArgument, [&] { a.init_source(0, 1, 1, md); });
  EXPECT_NE(message.find("receive only"), std::string::npos) << message;
  message = testing::error_of(ErrorKind::kProtocol, [&] { b.init_destination(0, 1, 1, md); });
  EXPECT_NE(message.find("source rank 0 published no transfer buffers"), std::string::npos) << message;
}

TEST(Engine, ATransportDeviceThatContradictsTheConfiguredDeviceIsRefused) {
  EngineOptions options;
  options.bucket_bytes = 1 << 20;
  options.config.backend_name = "UCX";
  options.config.backend_init_params["device"] = "cuda:1";  // config.device stays cpu
  const std::string message = testing::error_of(ErrorKind::kConfig, [&] { CheckpointEngine engine(options); });
  EXPECT_NE(message.find("backend_init_params.device is 'cuda:1' but refit_cfg.nixl.device is 'cpu'"),
            std::string::npos)
      << message;
}

TEST(Engine, APluginTransportIsRefusedNamingTheFactoryThatCreatesIt) {
  EngineOptions options;
  options.bucket_bytes = 1 << 20;
  options.config = parse_config("refit_transport: 'my.engines:Loopback'\nrefit_cfg: {'my.engines:Loopback': {}}\n");
  const std::string message = testing::error_of(ErrorKind::kConfig, [&] { CheckpointEngine engine(options); });
  EXPECT_NE(message.find("refit.create_checkpoint_engine('my.engines:Loopback'"), std::string::npos) << message;
}

TEST(Engine, OddBucketSizeOf17Bytes) {
  Pair p(17);
  p.connect();
  auto weights = mixed_model(2);
  Received got;
  p.refit(weights, got);
  expect_same(weights, got);
}

TEST(Engine, EmptyStreamCompletesWithoutBatches) {
  Pair p(64);
  p.connect();
  std::vector<OwnedTensor> none;
  Received got;
  auto stats = p.refit(none, got);
  EXPECT_EQ(stats.batches, 0u);
  EXPECT_EQ(stats.buckets, 1u);
  EXPECT_FALSE(p.destination->stale());
}

TEST(Engine, SeveralRefitsKeepOrReleaseBuffers) {
  for (bool release : {false, true}) {
    Pair p(100, release);
    for (uint32_t r = 0; r < 3; ++r) {
      if (release || r == 0) p.connect();
      auto weights = mixed_model(10 * r);
      Received got;
      p.refit(weights, got);
      expect_same(weights, got);
      if (release) {
        p.source->finalize();
        p.destination->finalize();
      }
    }
  }
}

TEST(Engine, SourceWithoutPeerDrainsItsWeights) {
  auto fabric = make_inproc_fabric();
  auto session = new_session_id();
  CheckpointEngine s0(inproc_options(fabric, 128, session)), s1(inproc_options(fabric, 128, session)),
      d0(inproc_options(fabric, 128, session));
  std::vector<Metadata> md = {s0.prepare(), s1.prepare(), d0.prepare()};
  s0.init_source(0, 2, 1, md);
  s1.init_source(1, 2, 1, md);
  d0.init_destination(0, 2, 1, md);
  auto weights = mixed_model(3);
  VectorSource idle(weights);
  auto idle_stats = s1.send(idle);
  EXPECT_FALSE(idle_stats.had_peer);
  EXPECT_EQ(idle.consumed(), weights.size());
  auto sent = std::async(std::launch::async, [&] {
    VectorSource src(weights);
    return s0.send(src);
  });
  Received got;
  d0.receive(got.loader());
  EXPECT_TRUE(sent.get().had_peer);
  expect_same(weights, got);
}

// A source that is not connected (before init_source, after finalize) has no destination to
// drain for: its send would report success while nobody got a byte, so it is refused; a
// destination that is not connected refuses to receive alike.
TEST(Engine, ASourceThatIsNotConnectedRefusesToSend) {
  Pair p(256);
  auto weights = mixed_model(1);
  VectorSource before(weights);
  EXPECT_NE(testing::error_of(ErrorKind::kTopology, [&] { p.source->send(before); })
                .find("send() before the source was connected"),
            std::string::npos);
  EXPECT_EQ(before.consumed(), 0u);
  Received none;
  EXPECT_NE(testing::error_of(ErrorKind::kTopology, [&] { p.destination->receive(none.loader()); })
                .find("receive() before init_destination()"),
            std::string::npos);
  p.connect();
  Received got;
  p.refit(weights, got);
  expect_same(weights, got);
  p.source->finalize();
  VectorSource after(weights);
  EXPECT_NE(testing::error_of(ErrorKind::kTopology, [&] { p.source->send(after); }).find("after finalize()"),
            std::string::npos);
  p.destination->finalize();
  EXPECT_NE(testing::error_of(ErrorKind::kTopology, [&] { p.destination->receive(none.loader()); })
                .find("(or after finalize())"),
            std::string::npos);
}

// A peer that leaves the connection (finalize, its engine's end) tells the other side: that side's
// next refit fails at once naming it, not at its deadline (60 s here).
TEST(Engine, APeerThatLeavesEndsTheOthersNextRefitAtOnce) {
  for (bool destination_leaves : {true, false}) {
    Pair p(256, false, /*timeout_s=*/60.0);
    p.connect();
    auto weights = mixed_model(2);
    Received got;
    p.refit(weights, got);
    (destination_leaves ? p.destination : p.source)->finalize();
    const auto start = Clock::now();
    std::string message;
    if (destination_leaves) {
      VectorSource src(weights);
      EXPECT_EQ(error_kind_of([&] { p.source->send(src); }, &message), ErrorKind::kPeerLost);
      EXPECT_THAT(message, ::testing::HasSubstr("destination rank 0 left this connection"));
    } else {
      EXPECT_EQ(error_kind_of([&] { p.destination->receive(got.loader()); }, &message), ErrorKind::kPeerLost);
      EXPECT_THAT(message, ::testing::HasSubstr("source rank 0 left this connection"));
    }
    EXPECT_THAT(message, ::testing::HasSubstr("it called finalize()"));
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0) << message;
    // Its metadata named that connection: init from it again is refused; a new prepare() works.
    auto& left = destination_leaves ? p.destination : p.source;
    const std::string refused = testing::error_of(ErrorKind::kInvalidArgument, [&] {
      destination_leaves ? left->init_destination(0, 1, 1, p.metadata) : left->init_source(0, 1, 1, p.metadata);
    });
    EXPECT_THAT(refused, ::testing::HasSubstr("needs a new prepare()"));
    p.connect();
    Received again;
    p.refit(weights, again);
    expect_same(weights, again);
  }
}

// An init that fails after linking to its peers tells them: a source whose destination's init
// failed fails its send at once with the destination's error, not at its deadline.
TEST(Engine, AnInitThatFailsAfterLinkingEndsItsPeersRefitAtOnce) {
  Pair p(256, false, /*timeout_s=*/60.0);
  p.metadata = {p.source->prepare(), p.destination->prepare()};
  p.source->init_source(0, 1, 1, p.metadata);
  // The destination sees its source's buffers as missing, once linked to it.
  protocol::EngineMetadata source_md = protocol::decode_metadata(p.metadata[0], "source");
  source_md.buffers.length = 0;
  std::vector<Metadata> wrong = {protocol::encode(source_md), p.metadata[1]};
  const std::string init_error =
      testing::error_of(ErrorKind::kProtocol, [&] { p.destination->init_destination(0, 1, 1, wrong); });
  EXPECT_THAT(init_error, ::testing::HasSubstr("published no transfer buffers"));
  auto weights = mixed_model(2);
  VectorSource src(weights);
  const auto start = Clock::now();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { p.source->send(src); }, &message), ErrorKind::kProtocol);
  EXPECT_THAT(message, ::testing::HasSubstr("destination rank 0 left this connection"));
  EXPECT_THAT(message, ::testing::HasSubstr("its init failed"));
  EXPECT_THAT(message, ::testing::HasSubstr("published no transfer buffers"));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0) << message;
}

// A destination's own configuration mistake (experts sharded without a layout) is found once it
// is linked, so its source hears of it at once too.
TEST(Engine, ADestinationsConfigurationMistakeEndsItsSourcesRefitAtOnce) {
  auto fabric = make_inproc_fabric();
  const SessionId session = new_session_id();
  EngineOptions destination_options = inproc_options(fabric, 256, session, /*timeout_s=*/60.0);
  destination_options.config.shard_expert_weights = true;  // and no layout
  CheckpointEngine source(inproc_options(fabric, 256, session, 60.0)), destination(destination_options);
  const std::vector<Metadata> md = {source.prepare(), destination.prepare()};
  source.init_source(0, 1, 1, md);
  EXPECT_THAT(testing::error_of(ErrorKind::kConfig, [&] { destination.init_destination(0, 1, 1, md); }),
              ::testing::HasSubstr("declared no layout"));
  auto weights = mixed_model(2);
  VectorSource src(weights);
  const auto start = Clock::now();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { source.send(src); }, &message), ErrorKind::kConfig);
  EXPECT_THAT(message, ::testing::HasSubstr("destination rank 0 left this connection"));
  EXPECT_THAT(message, ::testing::HasSubstr("refit_cfg.nixl.shard_expert_weights is true"));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0) << message;
}

// A destination that never receives (its own init or receive failed): the source's wait ends at
// its deadline and says where to look.
TEST(Engine, ASourceWhoseDestinationNeverReceivesTimesOutPointingAtIt) {
  Pair p(256, /*release=*/false, /*timeout_s=*/0.5);
  p.connect();
  auto weights = mixed_model(1);
  VectorSource src(weights);
  const std::string message = testing::error_of(ErrorKind::kTimeout, [&] { p.source->send(src); });
  EXPECT_NE(message.find("destination rank 0"), std::string::npos) << message;
  EXPECT_NE(message.find("is alive; the cause is likely on its side"), std::string::npos) << message;
}

TEST(Engine, RepeatedNameFailsTheRefitOnBothSides) {
  Pair p(256);
  p.connect();
  std::vector<OwnedTensor> weights = {make_tensor("w", DType::kFloat32, {4}, 1),
                                      make_tensor("w", DType::kFloat32, {4}, 2)};
  Received got;
  EXPECT_THROW(p.refit(weights, got), Error);
  EXPECT_TRUE(p.destination->stale());
}

// Whatever a weight stream or a loader throws ends the refit on both sides at once, reported as
// what it was: not a std::exception, std::bad_alloc, or the caller's own error.
class ThrowingSource final : public WeightSource {
 public:
  ThrowingSource(const std::vector<OwnedTensor>& weights, std::function<void()> fail_after)
      : weights_(weights), fail_(std::move(fail_after)) {}
  bool next(TensorView* out) override {
    if (index_ == 2) fail_();
    if (index_ == weights_.size()) return false;
    const auto& t = weights_[index_++];
    *out = {&t.info, t.data.data(), MemoryKind::kHost};
    return true;
  }

 private:
  const std::vector<OwnedTensor>& weights_;
  std::function<void()> fail_;
  size_t index_ = 0;
};

TEST(Engine, AnythingTheWeightStreamThrowsAbortsTheDestinationAtOnceAndIsNamed) {
  struct Case {
    std::function<void()> fail;
    ErrorKind kind;
    const char* says;
  };
  const Case cases[] = {
      {[] { throw 42; }, ErrorKind::kInternal, "the weight stream threw something that is not a std::exception"},
      {[] { throw std::bad_alloc(); }, ErrorKind::kInternal, "out of memory (std::bad_alloc)"},
      {[] { throw std::runtime_error("gather failed"); }, ErrorKind::kInvalidArgument,
       "weight stream failed: gather failed"},
  };
  for (const Case& c : cases) {
    Pair p(64, false, 30.0);
    p.connect();
    const auto weights = mixed_model(5);
    const auto start = std::chrono::steady_clock::now();
    auto sending = std::async(std::launch::async, [&] {
      ThrowingSource source(weights, c.fail);
      return p.source->send(source);
    });
    Received got;
    try {
      p.destination->receive(got.loader());
      ADD_FAILURE() << "the destination should fail: " << c.says;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(c.says));
    }
    try {
      sending.get();
      ADD_FAILURE() << "the source should fail: " << c.says;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), c.kind) << e.what();
      EXPECT_THAT(e.what(), ::testing::HasSubstr(c.says));
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "not the 30 s timeout";
    EXPECT_TRUE(p.destination->stale());
  }
}

// One send at a time per engine: a second send from another thread would interleave its buckets
// with the first's on the same link (a destination took one send's bytes under the other's names,
// and reported success). It is refused, and so is what would replace or free what the running
// send works from (prepare, init, finalize); the running send goes through.
TEST(Engine, OneSendAtATimeAndNothingReplacesWhatARunningSendWorksFrom) {
  Pair p(64, false, 30.0);
  p.connect();
  const auto weights = mixed_model(5);
  std::promise<void> started, go;
  std::shared_future<void> resume = go.get_future().share();
  auto sending = std::async(std::launch::async, [&] {
    ThrowingSource source(weights, [&] {  // holds the send at its third tensor
      started.set_value();
      resume.wait();
    });
    return p.source->send(source);
  });
  Received got;
  auto receiving = std::async(std::launch::async, [&] { return p.destination->receive(got.loader()); });
  started.get_future().wait();
  std::string message;
  VectorSource other(weights);
  EXPECT_EQ(error_kind_of([&] { p.source->send(other); }, &message), ErrorKind::kInvalidArgument);
  EXPECT_THAT(message, ::testing::HasSubstr("send() while another send() runs on this engine")) << message;
  EXPECT_EQ(error_kind_of([&] { p.source->finalize(); }, &message), ErrorKind::kInvalidArgument);
  EXPECT_THAT(message, ::testing::HasSubstr("finalize() while send() runs")) << message;
  EXPECT_EQ(error_kind_of([&] { p.source->prepare(); }, &message), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { p.source->init_source(0, 1, 1, p.metadata); }, &message), ErrorKind::kInvalidArgument);
  go.set_value();
  sending.get();
  receiving.get();
  expect_same(weights, got);
  VectorSource again(weights);  // the engine sends again once the first send is done
  Received next;
  auto receiving_next = std::async(std::launch::async, [&] { return p.destination->receive(next.loader()); });
  p.source->send(again);
  receiving_next.get();
  expect_same(weights, next);
}

TEST(Engine, ALoaderThatThrowsSomethingElseStillAbortsTheSource) {
  Pair p(64, false, 30.0);
  p.connect();
  auto weights = mixed_model(6);
  const auto start = std::chrono::steady_clock::now();
  auto sent = p.start_send(weights);
  try {
    p.destination->receive([](LoadBatch) { throw 7; });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_THAT(e.what(), ::testing::HasSubstr("the loader threw something that is not a std::exception"));
  }
  EXPECT_THROW(sent.get(), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "not the 30 s timeout";
}

TEST(Engine, LoaderFailureAbortsTheSourceAndLeavesDestinationStale) {
  Pair p(64);
  p.connect();
  auto weights = mixed_model(4);
  auto sent = p.start_send(weights);
  try {
    p.destination->receive([](LoadBatch) { throw std::runtime_error("loader exploded"); });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loader exploded"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("destination rank 0"), std::string::npos);
  }
  EXPECT_TRUE(p.destination->stale());
  try {
    sent.get();
    FAIL() << "source should fail after the abort";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
  }
}

// The pull-style receive: the caller takes batch after batch; the bytes are those receive() gives.
// Merged tensors come with their memory, which stays valid (and unchanged) while it is held, even
// across later refits; views into the transfer buffers come without.
TEST(EnginePull, BatchByBatchWithMergedTensorsTheCallerMayKeep) {
  for (bool map : {false, true}) {
    Pair p(256, false, 10.0, map);
    p.connect();
    std::shared_ptr<const void> kept;  // the memory of the split embedding of refit 0
    const std::byte* kept_data = nullptr;
    std::vector<std::byte> kept_bytes;
    for (uint32_t r = 0; r < 3; ++r) {
      auto weights = mixed_model(10 * r + 1);
      auto sent = p.start_send(weights);
      Received got;
      p.destination->begin_receive();
      EXPECT_TRUE(p.destination->receiving());
      uint64_t batches = 0;
      for (;;) {
        ReceivedBatch batch;
        const auto progress = p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch);
        if (progress == ReceiveProgress::kDone) break;
        ASSERT_EQ(progress, ReceiveProgress::kBatch);
        EXPECT_EQ(batch.index, batches++);
        ASSERT_EQ(batch.owners.size(), batch.tensors.size());
        for (size_t i = 0; i < batch.tensors.size(); ++i) {
          const bool merged = batch.tensors[i].info->nbytes() > 256;
          EXPECT_EQ(batch.owners[i] != nullptr, merged) << batch.tensors[i].info->name;
          if (merged && r == 0) {
            kept = batch.owners[i];
            kept_data = batch.tensors[i].data;
            kept_bytes.assign(batch.tensors[i].data, batch.tensors[i].data + batch.tensors[i].info->nbytes());
          }
        }
        got.loader()(batch.tensors);
        p.destination->release_batch();
      }
      const ReceiveStats stats = p.destination->finish_receive();
      EXPECT_FALSE(p.destination->receiving());
      sent.get();
      expect_same(weights, got);
      EXPECT_EQ(stats.batches, batches);
      EXPECT_EQ(stats.tensors, weights.size());
      EXPECT_FALSE(p.destination->stale());
      ASSERT_TRUE(kept);
      // Refits 1 and 2 merged the embedding again, with other content: not into the kept memory.
      EXPECT_EQ(std::memcmp(kept_data, kept_bytes.data(), kept_bytes.size()), 0) << "refit " << r;
    }
  }
}

TEST(EnginePull, ASlowSourceMakesNextBatchReturnWaitingUntilItsBatchesCome) {
  Pair p(256);
  p.connect();
  auto weights = mixed_model(2);
  std::promise<void> go;
  auto sent = std::async(std::launch::async, [&] {
    go.get_future().wait();
    VectorSource src(weights);
    return p.source->send(src);
  });
  p.destination->begin_receive();
  ReceivedBatch batch;
  EXPECT_EQ(p.destination->next_batch(deadline_after(std::chrono::milliseconds(50)), &batch),
            ReceiveProgress::kWaiting);
  EXPECT_TRUE(p.destination->stale());
  go.set_value();
  Received got;
  int waits = 0;
  for (;;) {
    const auto progress = p.destination->next_batch(deadline_after(std::chrono::milliseconds(5)), &batch);
    if (progress == ReceiveProgress::kDone) break;
    if (progress == ReceiveProgress::kWaiting) {
      ASSERT_LT(++waits, 2000);
      continue;
    }
    got.loader()(batch.tensors);
    p.destination->release_batch();
  }
  p.destination->finish_receive();
  sent.get();
  expect_same(weights, got);
}

// While the caller holds a batch, the destination's links move on (LinkProgress): a bucket
// announced meanwhile is read and acknowledged, so that the source refills its buffer and goes
// on instead of waiting for the caller.
TEST(EnginePull, LinksMoveOnWhileTheCallerHoldsABatch) {
  Pair p(256, false, 10.0, /*map=*/false);  // staged: every bucket read and acknowledged once read
  p.connect();
  std::vector<OwnedTensor> weights;
  for (uint32_t k = 0; k < 6; ++k)  // one bucket each
    weights.push_back(make_tensor("w" + std::to_string(k), DType::kFloat32, {64}, k));
  // Bucket 1 is announced 100 ms into the refit, when the caller already holds batch 0.
  class Slow : public WeightSource {
   public:
    explicit Slow(const std::vector<OwnedTensor>& w) : inner_(w) {}
    bool next(TensorView* out) override {
      if (yielded_++ == 2) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return inner_.next(out);
    }

   private:
    VectorSource inner_;
    int yielded_ = 0;
  };
  auto sent = std::async(std::launch::async, [&] {
    Slow source(weights);
    return p.source->send(source);
  });
  p.destination->begin_receive();
  ReceivedBatch batch;
  ASSERT_EQ(p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch), ReceiveProgress::kBatch);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const double released = timeline_now();
  p.destination->release_batch();
  while (p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch) == ReceiveProgress::kBatch)
    p.destination->release_batch();
  p.destination->finish_receive();
  const SendStats stats = sent.get();
  std::map<uint64_t, double> announced;
  for (const TimelineEvent& e : stats.events)
    if (e.phase == TimelinePhase::kAnnounce) announced[e.bucket] = e.start;
  ASSERT_EQ(announced.size(), 6u);
  // Bucket 3 goes into the buffer of bucket 1, which was read and acknowledged during the hold.
  EXPECT_LT(announced.at(3), released);
  EXPECT_GT(announced.at(4), released) << "bucket 4 needs the local buffer of bucket 2, freed by the release";
}

TEST(EnginePull, CallsOutOfOrderAreErrorsThatNameTheCall) {
  Pair p(256);
  p.connect();
  ReceivedBatch batch;
  std::string message;
  EXPECT_EQ(
      error_kind_of([&] { p.destination->next_batch(deadline_after(std::chrono::seconds(1)), &batch); }, &message),
      ErrorKind::kInvalidArgument);
  EXPECT_NE(message.find("next_batch() without a receive in progress"), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] { p.destination->release_batch(); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { p.destination->finish_receive(); }), ErrorKind::kInvalidArgument);

  auto weights = mixed_model(3);
  auto sent = p.start_send(weights);
  p.destination->begin_receive();
  EXPECT_EQ(error_kind_of([&] { p.destination->begin_receive(); }), ErrorKind::kInvalidArgument);
  ASSERT_EQ(p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch), ReceiveProgress::kBatch);
  EXPECT_EQ(
      error_kind_of([&] { p.destination->next_batch(deadline_after(std::chrono::seconds(1)), &batch); }, &message),
      ErrorKind::kInvalidArgument);
  EXPECT_NE(message.find("batch 0 is still held"), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] { p.destination->finish_receive(); }, &message), ErrorKind::kInvalidArgument);
  EXPECT_NE(message.find("a batch is held"), std::string::npos) << message;
  // Misuse ends nothing: the refit goes on.
  Received got;
  got.loader()(batch.tensors);
  p.destination->release_batch();
  for (;;) {
    const auto progress = p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch);
    if (progress == ReceiveProgress::kDone) break;
    got.loader()(batch.tensors);
    p.destination->release_batch();
  }
  p.destination->finish_receive();
  sent.get();
  expect_same(weights, got);
}

// A destination connected again while it receives: the receive ends first (its readers work from
// the links being replaced), the source is told why, and the new connection refits.
TEST(EnginePull, AnInitDuringAReceiveEndsItAndTellsTheSource) {
  Pair p(256);
  p.connect();
  auto weights = mixed_model(3);
  auto sent = p.start_send(weights);
  p.destination->begin_receive();
  ReceivedBatch batch;
  ASSERT_EQ(p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch), ReceiveProgress::kBatch);
  // The connection is over for both sides: the same metadata cannot start another (a new prepare()).
  std::string refused =
      testing::error_of(ErrorKind::kInvalidArgument, [&] { p.destination->init_destination(0, 1, 1, p.metadata); });
  EXPECT_THAT(refused, ::testing::HasSubstr("needs a new prepare()"));
  EXPECT_FALSE(p.destination->receiving());
  EXPECT_TRUE(p.destination->stale());
  std::string message;
  EXPECT_EQ(error_kind_of([&] { sent.get(); }, &message), ErrorKind::kInvalidArgument);
  EXPECT_NE(message.find("connected again (init) during the receive"), std::string::npos) << message;
  p.connect();
  Received got;
  p.refit(weights, got);
  expect_same(weights, got);
  EXPECT_FALSE(p.destination->stale());
}

TEST(EnginePull, ABatchHeldPastTheDeadlineFailsTheRefitOnBothSides) {
  Pair p(64, false, /*timeout_s=*/0.5);
  p.connect();
  auto weights = mixed_model(5);
  auto sent = p.start_send(weights);
  p.destination->begin_receive();
  ReceivedBatch batch;
  ASSERT_EQ(p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch), ReceiveProgress::kBatch);
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  std::string message;
  EXPECT_EQ(error_kind_of([&] { p.destination->release_batch(); }, &message), ErrorKind::kTimeout);
  EXPECT_NE(message.find("held batch 0 for more than timeout_s=0.5"), std::string::npos) << message;
  EXPECT_NE(message.find("destination rank 0"), std::string::npos) << message;
  EXPECT_FALSE(p.destination->receiving());
  EXPECT_TRUE(p.destination->stale());
  EXPECT_THROW(sent.get(), Error);
}

TEST(EnginePull, GivingUpOrFinalizingFailsTheSourceAndLeavesTheDestinationStale) {
  for (bool finalize : {false, true}) {
    Pair p(64);
    p.connect();
    auto weights = mixed_model(6);
    auto sent = p.start_send(weights);
    p.destination->begin_receive();
    ReceivedBatch batch;
    ASSERT_EQ(p.destination->next_batch(deadline_after(std::chrono::seconds(10)), &batch), ReceiveProgress::kBatch);
    const auto start = Clock::now();
    if (finalize) {
      p.destination->finalize();
    } else {
      p.destination->abort_receive("the consumer went away");
    }
    EXPECT_FALSE(p.destination->receiving());
    EXPECT_TRUE(p.destination->stale());
    std::string message;
    error_kind_of([&] { sent.get(); }, &message);
    EXPECT_NE(message.find("aborted"), std::string::npos) << message;
    EXPECT_NE(message.find(finalize ? "finalize() was called during the receive" : "the consumer went away"),
              std::string::npos)
        << message;
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0) << "at once, not at a deadline";
  }
}

// A failed refit leaves messages queued (the source's next bucket, an abort); neither the next
// refit on the same connection nor one after reconnecting may mistake them for its own.
TEST(Engine, RefitAfterAFailureIgnoresItsLeftovers) {
  Pair p(64);
  p.connect();
  auto weights = mixed_model(7);
  auto failed = std::async(std::launch::async, [&] {
    VectorSource src(weights);
    try {
      p.source->send(src);
    } catch (const Error&) {
    }
  });
  EXPECT_THROW(p.destination->receive([](LoadBatch) { throw std::runtime_error("loader failed"); }), Error);
  failed.get();
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1) {
      p.source->finalize();
      p.destination->finalize();
      p.connect();
    }
    Received got;
    p.refit(weights, got);
    expect_same(weights, got);
    EXPECT_FALSE(p.destination->stale());
  }
}

TEST(Engine, SilentSourceTimesOutNamingPeerAndPhase) {
  Pair p(64, false, 0.3);
  p.connect();
  auto start = Clock::now();
  try {
    Received got;
    p.destination->receive(got.loader());
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    std::string msg = e.what();
    EXPECT_NE(msg.find("source rank 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("wait for bucket 0"), std::string::npos) << msg;
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0);
  EXPECT_TRUE(p.destination->stale());
}

TEST(Engine, LostSourceIsReportedAsPeerLost) {
  Pair p(64);
  p.connect();
  p.source.reset();
  try {
    Received got;
    p.destination->receive(got.loader());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kPeerLost);
    EXPECT_NE(std::string(e.what()).find("source rank 0"), std::string::npos) << e.what();
  }
}

TEST(Engine, MetadataFromAnotherSessionIsRefused) {
  auto fabric = make_inproc_fabric();
  CheckpointEngine s(inproc_options(fabric, 64, new_session_id())), d(inproc_options(fabric, 64, new_session_id()));
  std::vector<Metadata> md = {s.prepare(), d.prepare()};
  try {
    d.init_destination(0, 1, 1, md);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    EXPECT_NE(std::string(e.what()).find("another refit session"), std::string::npos);
  }
}

TEST(Engine, MetadataOfAnotherModelIsRefused) {
  auto fabric = make_inproc_fabric();
  auto session = new_session_id();
  auto so = inproc_options(fabric, 64, session);
  auto dop = inproc_options(fabric, 64, session);
  so.model_fingerprint = 1;
  dop.model_fingerprint = 2;
  CheckpointEngine s(so), d(dop);
  std::vector<Metadata> md = {s.prepare(), d.prepare()};
  try {
    s.init_source(0, 1, 1, md);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    EXPECT_NE(std::string(e.what()).find("another model"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("destination rank 0"), std::string::npos);
  }
}

TEST(Engine, PeersWithAnotherBucketSizeOrTransportAreRefusedBeforeAnyTransfer) {
  auto fabric = make_inproc_fabric();
  auto session = new_session_id();
  CheckpointEngine s(inproc_options(fabric, 64, session)), d(inproc_options(fabric, 128, session));
  std::vector<Metadata> md = {s.prepare(), d.prepare()};
  std::string message = testing::error_of(ErrorKind::kProtocol, [&] { d.init_destination(0, 1, 1, md); });
  EXPECT_NE(message.find("source rank 0 uses 64-byte buckets, this engine 128"), std::string::npos) << message;
  message = testing::error_of(ErrorKind::kProtocol, [&] { s.init_source(0, 1, 1, md); });
  EXPECT_NE(message.find("destination rank 0 uses 128-byte buckets, this engine 64"), std::string::npos) << message;

  // The same bucket size, but metadata that says another backend published it.
  CheckpointEngine s2(inproc_options(fabric, 64, session)), d2(inproc_options(fabric, 64, session));
  std::vector<Metadata> md2 = {s2.prepare(), d2.prepare()};
  auto forged = protocol::decode_metadata(md2[0], "source");
  forged.transport_name = "UCX";
  md2[0] = protocol::encode(forged);
  message = testing::error_of(ErrorKind::kProtocol, [&] { d2.init_destination(0, 1, 1, md2); });
  EXPECT_NE(message.find("source rank 0 uses transport 'UCX', this engine 'INPROC'"), std::string::npos) << message;
}

TEST(Engine, TopologyIsValidated) {
  auto fabric = make_inproc_fabric();
  auto session = new_session_id();
  CheckpointEngine s(inproc_options(fabric, 64, session)), d0(inproc_options(fabric, 64, session)),
      d1(inproc_options(fabric, 64, session));
  std::vector<Metadata> md = {s.prepare(), d0.prepare(), d1.prepare()};
  try {
    d1.init_destination(1, 1, 2, md);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTopology);
    EXPECT_NE(std::string(e.what()).find("train_world_size >= rollout_world_size"), std::string::npos);
  }
  EXPECT_THROW(d0.init_destination(2, 2, 1, md), Error);
  EXPECT_THROW(source_rank_for_destination(-1, 1, 1), Error);
  EXPECT_EQ(source_rank_for_destination(2, 4, 3), 2);
  std::vector<Metadata> short_md = {md[0]};
  EXPECT_THROW(s.init_source(0, 1, 1, short_md), Error);
}

TEST(Engine, ReceiveBeforeInitIsAnError) {
  auto fabric = make_inproc_fabric();
  CheckpointEngine d(inproc_options(fabric, 64, new_session_id()));
  Received got;
  EXPECT_THROW(d.receive(got.loader()), Error);
}

// A hand-made source: valid metadata, then whatever messages a test sends.
TEST(Engine, GarbledControlMessageIsAProtocolError) {
  RogueSource rogue;
  auto& d = rogue.destination;
  Bytes garbage = {0x52, 0x4d, 0x53, 0x47, 1, 0, 0, 0, 1, 9, 9};
  rogue.send(garbage);
  try {
    Received got;
    d.receive(got.loader());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    EXPECT_NE(std::string(e.what()).find("source rank 0"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(d.stale());
}

TEST(Engine, OutOfRangeChunkIsRejectedBeforeAnyRead) {
  RogueSource rogue;
  auto& d = rogue.destination;
  protocol::BucketReady bad;
  bad.refit = rogue.first_refit + 1;
  bad.is_last = true;
  bad.used_bytes = 32;
  protocol::edit_manifest(bad).entries.push_back({{"w", DType::kFloat32, {4}}, 0, 16, 24});  // ends at 40 > 32 used
  rogue.send(protocol::encode(bad));
  try {
    Received got;
    d.receive(got.loader());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
}

struct LayoutPair {
  std::shared_ptr<InProcFabric> fabric = make_inproc_fabric();
  SessionId session = new_session_id();
  std::unique_ptr<CheckpointEngine> source, destination;

  LayoutPair(uint64_t bucket, Layout layout) {
    auto dop = inproc_options(fabric, bucket, session);
    dop.layout = std::move(layout);
    source = std::make_unique<CheckpointEngine>(inproc_options(fabric, bucket, session));
    destination = std::make_unique<CheckpointEngine>(dop);
    std::vector<Metadata> md = {source->prepare(), destination->prepare()};
    source->init_source(0, 1, 1, md);
    destination->init_destination(0, 1, 1, md);
  }
};

TEST(EngineLayout, SourceSendsExactlyTheDeclaredSlices) {
  std::vector<OwnedTensor> weights = {
      make_tensor("model.layers.0.q_proj.weight", DType::kBFloat16, {8, 6}, 1),  // rows 4..7 (contiguous)
      make_tensor("model.layers.0.o_proj.weight", DType::kFloat32, {5, 8}, 2),   // columns 2..5 (strided)
      make_tensor("model.layers.0.norm.weight", DType::kFloat32, {8}, 3),        // whole (fallback)
      make_tensor("model.layers.1.q_proj.weight", DType::kBFloat16, {8, 6}, 4),  // dropped by prefix
      make_tensor("model.layers.0.other.weight", DType::kInt8, {3}, 5),          // dropped by entry
  };
  Layout layout;
  layout.tensors["model.layers.0.q_proj.weight"] = Request::narrow(0, 4, 4);
  layout.tensors["model.layers.0.o_proj.weight"] = Request::narrow(1, 2, 4);
  layout.tensors["model.layers.0.other.weight"] = Request::drop();
  layout.drop_prefixes = {"model.layers.1."};
  LayoutPair p(40, layout);
  ASSERT_NE(p.source->target_layout(), nullptr);
  EXPECT_EQ(*p.source->target_layout(), layout);

  auto sent = std::async(std::launch::async, [&] {
    VectorSource src(weights);
    return p.source->send(src);
  });
  Received got;
  p.destination->receive(got.loader());
  auto stats = sent.get();
  EXPECT_EQ(stats.tensors, 3u);
  EXPECT_EQ(stats.dropped, 2u);

  ASSERT_EQ(got.tensors.size(), 3u);
  for (const auto& [name, request] : layout.tensors) {
    if (request.take != Take::kSlice) continue;
    const auto& src = *std::find_if(weights.begin(), weights.end(), [&](const auto& t) { return t.info.name == name; });
    auto sel = select(layout, src.info);
    std::vector<std::byte> expected(sel.info.nbytes());
    copy_slice(src.data.data(), src.info, sel.slice, expected.data());
    ASSERT_TRUE(got.tensors.count(name)) << name;
    EXPECT_EQ(got.tensors[name].info.shape, sel.info.shape) << name;
    EXPECT_EQ(got.tensors[name].data, expected) << name;
  }
  EXPECT_EQ(got.tensors["model.layers.0.norm.weight"].data, weights[2].data);
  EXPECT_FALSE(got.tensors.count("model.layers.1.q_proj.weight"));
}

TEST(EngineLayout, ARequestedTensorTheStreamNeverYieldsIsAnError) {
  Layout layout;
  layout.tensors["model.layers.0.missing.weight"] = Request::whole();
  LayoutPair p(64, layout);
  std::vector<OwnedTensor> weights = {make_tensor("model.layers.0.present.weight", DType::kFloat32, {4}, 1)};
  auto sent = std::async(std::launch::async, [&] {
    VectorSource src(weights);
    return p.source->send(src);
  });
  Received got;
  EXPECT_THROW(p.destination->receive(got.loader()), Error);
  try {
    sent.get();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kLayout);
    EXPECT_NE(std::string(e.what()).find("model.layers.0.missing.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("destination rank 0"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(p.destination->stale());
}

struct ChecksumPair {
  std::shared_ptr<InProcFabric> fabric = make_inproc_fabric();
  SessionId session = new_session_id();
  std::unique_ptr<CheckpointEngine> source, destination;

  ChecksumPair(bool source_checks, bool destination_checks, uint64_t flip_every) {
    auto so = inproc_options(fabric, 100, session);
    auto dop = inproc_options(fabric, 100, session);
    so.config.verify_checksums = source_checks;
    dop.config.verify_checksums = destination_checks;
    if (flip_every > 0) dop.transport = flip_read_bytes(create_inproc_transport(fabric), flip_every);
    source = std::make_unique<CheckpointEngine>(so);
    destination = std::make_unique<CheckpointEngine>(dop);
    std::vector<Metadata> md = {source->prepare(), destination->prepare()};
    source->init_source(0, 1, 1, md);
    destination->init_destination(0, 1, 1, md);
  }

  // Returns the destination's error kind, or nothing when the refit succeeded.
  std::optional<ErrorKind> refit(const std::vector<OwnedTensor>& weights, Received& got) {
    auto sent = std::async(std::launch::async, [&] {
      VectorSource src(weights);
      try {
        source->send(src);
      } catch (const Error&) {
      }
    });
    std::optional<ErrorKind> kind;
    try {
      destination->receive(got.loader());
    } catch (const Error& e) {
      kind = e.kind();
    }
    sent.get();
    return kind;
  }
};

std::vector<OwnedTensor> checksum_model() {
  return {make_tensor("a", DType::kBFloat16, {300}, 1), make_tensor("b", DType::kFloat32, {40}, 2),
          make_tensor("c", DType::kInt8, {77}, 3)};
}

TEST(EngineChecksums, CleanRefitPassesWithChecksums) {
  ChecksumPair p(true, true, 0);
  Received got;
  EXPECT_FALSE(p.refit(checksum_model(), got).has_value());
  EXPECT_EQ(got.tensors.size(), 3u);
}

TEST(EngineChecksums, EveryFlippedByteIsCaught) {
  // Flip a byte in the 1st, 2nd, ... read of a refit: each time the refit fails as corrupted.
  for (uint64_t every = 1; every <= 8; ++every) {
    ChecksumPair p(true, true, every);
    Received got;
    auto kind = p.refit(checksum_model(), got);
    ASSERT_TRUE(kind.has_value()) << "corruption in read " << every << " went unnoticed";
    EXPECT_EQ(*kind, ErrorKind::kIntegrity);
    EXPECT_TRUE(p.destination->stale());
  }
}

TEST(EngineChecksums, WithoutChecksumsCorruptionIsNotDetectedByTheEngine) {
  // The control: the same corruption passes when checksums are off, which is why they exist.
  ChecksumPair p(false, false, 1);
  Received got;
  EXPECT_FALSE(p.refit(checksum_model(), got).has_value());
  EXPECT_NE(got.tensors["a"].data, checksum_model()[0].data);
}

TEST(EngineChecksums, DisagreeingSidesAreAConfigError) {
  ChecksumPair p(false, true, 0);
  Received got;
  auto kind = p.refit(checksum_model(), got);
  ASSERT_TRUE(kind.has_value());
  EXPECT_EQ(*kind, ErrorKind::kConfig);
}

}  // namespace
}  // namespace refit
