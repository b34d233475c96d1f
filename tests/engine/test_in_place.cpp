// Tensors sent in place (direct_reads): a destination on the source's host loads them straight
// from the source's own memory, and buckets only name them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <set>
#include <thread>

#include "core/error_of.h"
#include "engine/protocol.h"
#include "engine_harness.h"
#include "refit/error.h"

namespace refit {
namespace {

using testing::error_of;
using testing::inproc_options;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::Received;
using testing::VectorSource;

// The in-process transport, counting registrations and optionally handing out a corrupted copy
// of whatever a destination maps.
class WatchedTransport final : public Transport {
 public:
  explicit WatchedTransport(std::unique_ptr<Transport> inner, bool corrupt_maps = false, bool batched_reads = false)
      : inner_(std::move(inner)), corrupt_maps_(corrupt_maps), batched_reads_(batched_reads) {}
  std::string name() const override { return inner_->name(); }
  RegionId register_memory(void* base, size_t bytes) override {
    ++registered;
    return inner_->register_memory(base, bytes);
  }
  Allocation allocate_memory(size_t bytes) override { return inner_->allocate_memory(bytes); }
  RemoteRegion describe(RegionId region) const override { return inner_->describe(region); }
  void deregister_memory(RegionId region) override {
    ++deregistered;
    inner_->deregister_memory(region);
  }
  bool registration_current(RegionId region) const override { return inner_->registration_current(region); }
  Bytes address() const override { return inner_->address(); }
  PeerId connect(std::span<const uint8_t> address, const std::string& label) override {
    return inner_->connect(address, label);
  }
  void disconnect(PeerId peer) override { inner_->disconnect(peer); }
  TransportCapabilities capabilities() const override {
    TransportCapabilities caps = inner_->capabilities();
    caps.batched_reads = batched_reads_;
    return caps;
  }
  // Batched: every range read now (the in-process transport reads synchronously), as one read.
  ReadId post_reads(PeerId peer, std::span<const ReadRange> ranges, RegionId local_region, Deadline deadline) override {
    if (!batched_reads_) return Transport::post_reads(peer, ranges, local_region, deadline);
    ++batches;
    for (const ReadRange& r : ranges)
      inner_->read(peer, *r.remote, r.remote_offset, r.local, local_region, r.length, deadline);
    return kBatch;
  }
  ReadId post_read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                   uint64_t length, Deadline deadline) override {
    return inner_->post_read(peer, remote, remote_offset, local, local_region, length, deadline);
  }
  bool test_read(ReadId read) override { return read == kBatch || inner_->test_read(read); }
  void wait_read(ReadId read, Deadline deadline) override {
    if (read != kBatch) inner_->wait_read(read, deadline);
  }
  void cancel_read(ReadId read) override {
    if (read != kBatch) inner_->cancel_read(read);
  }
  const std::byte* map(PeerId peer, const RemoteRegion& remote) override {
    ++mapped;
    const std::byte* base = inner_->map(peer, remote);
    if (!corrupt_maps_ || base == nullptr || remote.length == 0) return base;
    auto& copy = copies_.emplace_back(base, base + remote.length);
    copy[remote.length / 2] ^= std::byte{0x5a};
    return copy.data();
  }
  void send(PeerId peer, std::span<const uint8_t> message, Deadline deadline) override {
    inner_->send(peer, message, deadline);
  }
  Bytes receive(PeerId peer, Deadline deadline) override { return inner_->receive(peer, deadline); }
  std::optional<Bytes> try_receive(PeerId peer) override { return inner_->try_receive(peer); }
  uint64_t activity() override { return inner_->activity(); }
  void wait_activity(uint64_t seen, Deadline deadline) override { inner_->wait_activity(seen, deadline); }

  std::atomic<int> registered{0}, deregistered{0}, mapped{0}, batches{0};

 private:
  static constexpr ReadId kBatch = ~ReadId{0};
  std::unique_ptr<Transport> inner_;
  bool corrupt_maps_;
  bool batched_reads_;
  std::vector<std::vector<std::byte>> copies_;
};

struct InPlacePair {
  std::shared_ptr<InProcFabric> fabric = make_inproc_fabric();
  SessionId session = new_session_id();
  std::shared_ptr<WatchedTransport> source_transport, destination_transport;
  std::unique_ptr<CheckpointEngine> source, destination;
  SendStats sent;

  struct Options {
    uint64_t bucket = 256;
    bool destination_maps = true;  // map_source_buffers at the destination
    bool checksums = false;
    bool corrupt_maps = false;
    bool batched_reads = false;  // the destination's transport takes a bucket's reads in one call
    std::optional<Layout> layout;
  };
  explicit InPlacePair(Options o) {
    source_transport = std::make_shared<WatchedTransport>(create_inproc_transport(fabric));
    destination_transport =
        std::make_shared<WatchedTransport>(create_inproc_transport(fabric), o.corrupt_maps, o.batched_reads);
    auto so = inproc_options(fabric, o.bucket, session);
    auto dop = inproc_options(fabric, o.bucket, session);
    so.config.direct_reads = dop.config.direct_reads = true;
    so.config.verify_checksums = dop.config.verify_checksums = o.checksums;
    dop.config.map_source_buffers = o.destination_maps;
    dop.layout = o.layout;
    so.transport = source_transport;
    dop.transport = destination_transport;
    source = std::make_unique<CheckpointEngine>(so);
    destination = std::make_unique<CheckpointEngine>(dop);
    std::vector<Metadata> md = {source->prepare(), destination->prepare()};
    source->init_source(0, 1, 1, md);
    destination->init_destination(0, 1, 1, md);
  }
  // `temporaries`: the source's views do not outlive send() (VectorSource::temporaries).
  ReceiveStats refit(const std::vector<OwnedTensor>& weights, const BatchLoader& loader, bool temporaries = false) {
    auto sending = std::async(std::launch::async, [&] {
      VectorSource src(weights);
      return source->send(temporaries ? src.temporaries() : src);
    });
    ReceiveStats stats;
    try {
      stats = destination->receive(loader);
    } catch (...) {
      sending.wait();
      throw;
    }
    sent = sending.get();
    return stats;
  }
};

std::vector<OwnedTensor> model(uint32_t seed) {
  return {
      make_tensor("embed", DType::kBFloat16, {64, 16}, seed + 1),  // 2048 B: larger than a bucket
      make_tensor("norm", DType::kFloat32, {16}, seed + 2),
      make_tensor("empty", DType::kFloat32, {0, 4}, seed + 3),
      make_tensor("bias", DType::kFloat8E4M3FN, {7}, seed + 4),
      make_tensor("ids", DType::kInt64, {3}, seed + 5),
      make_tensor("head", DType::kBFloat16, {300}, seed + 6),
  };
}

// The destination got every tensor, or its slice in `layout`, bitwise.
void expect_received(const std::vector<OwnedTensor>& weights, Received& got, const Layout& layout) {
  ASSERT_EQ(got.tensors.size(), weights.size());
  for (const auto& t : weights) {
    const Selection s = select(layout, t.info);
    std::vector<std::byte> expected(s.info.nbytes());
    if (s.take == Take::kSlice)
      copy_slice(t.data.data(), t.info, s.slice, expected.data());
    else
      expected = t.data;
    EXPECT_EQ(got.tensors[t.info.name].data, expected) << t.info.name;
  }
}

uint64_t payload_of(const std::vector<OwnedTensor>& weights) {
  uint64_t n = 0;
  for (const auto& t : weights) n += t.info.nbytes();
  return n;
}

TEST(InPlace, TheLoaderGetsViewsOfTheSourcesOwnTensors) {
  InPlacePair p({});
  const auto weights = model(1);
  std::map<std::string, const std::byte*> seen;
  Received got;
  auto record = got.loader();
  auto stats = p.refit(weights, [&](LoadBatch batch) {
    for (const auto& v : batch) seen[v.info->name] = v.data;
    record(batch);
  });
  ASSERT_EQ(got.tensors.size(), weights.size());
  for (const auto& t : weights) {
    EXPECT_EQ(got.tensors[t.info.name].data, t.data) << t.info.name;
    // Every tensor with bytes is read where the source keeps it: no copy on the way.
    if (t.info.nbytes() > 0) EXPECT_EQ(seen[t.info.name], t.data.data()) << t.info.name;
  }
  EXPECT_EQ(stats.in_place_bytes, payload_of(weights));
  EXPECT_EQ(p.sent.in_place_bytes, payload_of(weights));
  EXPECT_EQ(stats.wire_bytes, 0u);  // nothing went through a bucket (the empty tensor has no bytes)
  EXPECT_FALSE(p.destination->stale());
}

TEST(InPlace, BatchesKeepTheBucketSizeAndSendReturnsOnlyOnceEverythingIsLoaded) {
  InPlacePair p({.bucket = 64});
  std::vector<OwnedTensor> weights;
  for (int i = 0; i < 12; ++i) weights.push_back(make_tensor("t" + std::to_string(i), DType::kFloat32, {8}, i));
  std::promise<void> last_batch_started;
  std::atomic<bool> release_last{false};
  auto sending = std::async(std::launch::async, [&] {
    VectorSource src(weights);
    return p.source->send(src);
  });
  Received got;
  auto record = got.loader();
  size_t loaded = 0;
  auto receiving = std::async(std::launch::async, [&] {
    return p.destination->receive([&](LoadBatch batch) {
      loaded += batch.size();
      if (loaded == weights.size()) {
        last_batch_started.set_value();
        while (!release_last) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      record(batch);
    });
  });
  last_batch_started.get_future().wait();
  // The source's tensors are still being read: send() must not have returned.
  EXPECT_EQ(sending.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  release_last = true;
  auto stats = receiving.get();
  auto sent = sending.get();
  // 32-byte tensors in 64-byte buckets: two per batch.
  EXPECT_EQ(stats.batches, 6u);
  for (size_t n : got.batch_sizes) EXPECT_EQ(n, 2u);
  EXPECT_EQ(sent.in_place_bytes, 12u * 32);
  for (const auto& t : weights) EXPECT_EQ(got.tensors[t.info.name].data, t.data);
}

// A bucket that holds nothing in the source's buffers takes none of them: the source announces
// every such bucket without waiting for the destination, which goes from one to the next with no
// round trip between. Here the loader holds the first batch for 100 ms; everything is announced
// before the destination lets go of it.
TEST(InPlace, BucketsAllInPlaceAreAnnouncedWithoutWaitingForTheDestination) {
  InPlacePair p({.bucket = 64});
  std::vector<OwnedTensor> weights;
  for (int i = 0; i < 12; ++i) weights.push_back(make_tensor("t" + std::to_string(i), DType::kFloat32, {8}, i));
  Received got;
  auto record = got.loader();
  auto stats = p.refit(weights, [&](LoadBatch batch) {
    if (got.batch_sizes.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    record(batch);
  });
  for (const auto& t : weights) EXPECT_EQ(got.tensors[t.info.name].data, t.data) << t.info.name;
  ASSERT_EQ(stats.batches, 6u);
  double first_release = 0;
  for (const auto& e : stats.events)
    if (e.phase == TimelinePhase::kRelease && e.bucket == 0) first_release = e.start;
  ASSERT_GT(first_release, 0);
  int announced = 0;
  for (const auto& e : p.sent.events)
    if (e.phase == TimelinePhase::kAnnounce) {
      ++announced;
      EXPECT_LT(e.start, first_release) << "bucket " << e.bucket << " waited for the destination";
    }
  EXPECT_EQ(announced, 6);
}

// Buckets with packed bytes (the strided columns of "o") still take turns in the two buffers,
// between buckets all in place that take none: every byte arrives, refit after refit.
TEST(InPlace, PackedBucketsBetweenBucketsAllInPlaceKeepTheirBuffers) {
  std::vector<OwnedTensor> weights;
  Layout layout;
  for (int i = 0; i < 6; ++i) {
    // Buckets of 64 B: [a] all in place, then [b in place, o packed], and so on.
    const std::string n = std::to_string(i);
    weights.push_back(make_tensor("a" + n, DType::kFloat32, {16}, 10 + i));
    weights.push_back(make_tensor("b" + n, DType::kFloat32, {16}, 20 + i));
    weights.push_back(make_tensor("o" + n, DType::kFloat32, {4, 8}, 30 + i));  // columns 2..5: 64 B packed
    layout.tensors["o" + n] = Request::narrow(1, 2, 4);
  }
  InPlacePair p({.bucket = 64, .layout = layout});
  for (int refit = 0; refit < 3; ++refit) {
    for (auto& t : weights) t.data[refit] ^= std::byte{0x33};  // new weights each refit
    Received got;
    auto record = got.loader();
    auto stats = p.refit(weights, [&](LoadBatch batch) {
      // A slow loader: a source refilling a buffer too early would overwrite what it reads.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      record(batch);
    });
    expect_received(weights, got, layout);
    EXPECT_EQ(stats.in_place_bytes, 12u * 64);
    EXPECT_EQ(stats.wire_bytes, 6u * 64);
    std::vector<uint64_t> packed;
    for (const auto& e : p.sent.events)
      if (e.phase == TimelinePhase::kPack) packed.push_back(e.bytes);
    EXPECT_THAT(packed, ::testing::ElementsAre(0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64));
  }
}

// While the loader holds a batch, the destination makes the next bucket ready, so that it is
// there the moment the batch is released: no hand-off between the two. Returns the batches.
size_t batches_ready_on_release(CheckpointEngine& source, CheckpointEngine& destination,
                                const std::vector<OwnedTensor>& weights) {
  auto sending = std::async(std::launch::async, [&] {
    VectorSource src(weights);
    return source.send(src);
  });
  destination.begin_receive();
  ReceivedBatch batch;
  size_t batches = 0;
  while (true) {
    // Until the first batch, wait; after that each must be ready at once.
    const auto until = batches == 0 ? deadline_after(std::chrono::seconds(10)) : Clock::now();
    const ReceiveProgress progress = destination.next_batch(until, &batch);
    if (progress == ReceiveProgress::kDone) break;
    if (progress != ReceiveProgress::kBatch) {
      ADD_FAILURE() << "no batch ready after batch " << batches;
      destination.abort_receive("the test gives up");
      sending.wait();
      return batches;
    }
    ++batches;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    destination.release_batch();
  }
  destination.finish_receive();
  sending.get();
  return batches;
}

std::vector<OwnedTensor> eight_tensors() {
  std::vector<OwnedTensor> weights;
  for (int i = 0; i < 8; ++i) weights.push_back(make_tensor("t" + std::to_string(i), DType::kFloat32, {8}, i));
  return weights;
}

TEST(InPlace, TheNextBatchIsReadyWhenTheLoaderReleasesOne) {
  InPlacePair p({.bucket = 64});
  EXPECT_EQ(batches_ready_on_release(*p.source, *p.destination, eight_tensors()), 4u);
  EXPECT_EQ(p.destination->stale(), false);
}

// The same through buckets: mapped (acknowledged once loaded) and staged (once read).
TEST(InPlace, TheNextBucketIsReadyWhenTheLoaderReleasesOneMappedOrStaged) {
  for (bool map : {true, false}) {
    SCOPED_TRACE(map ? "mapped" : "staged");
    testing::Pair p(64, false, 10.0, map);
    p.connect();
    EXPECT_EQ(batches_ready_on_release(*p.source, *p.destination, eight_tensors()), 4u);
  }
}

TEST(InPlace, RegistrationsAreKeptAcrossRefitsAndMadeAgainWhenTheMemoryMoves) {
  InPlacePair p({});
  auto weights = model(3);
  const int with_bytes = 5;  // all but the empty tensor
  for (uint32_t r = 0; r < 3; ++r) {
    // Training changes the values, not where they live.
    for (auto& t : weights) std::fill(t.data.begin(), t.data.end(), static_cast<std::byte>(r + 1));
    Received got;
    p.refit(weights, got.loader());
    for (const auto& t : weights) EXPECT_EQ(got.tensors[t.info.name].data, t.data) << "refit " << r;
    EXPECT_EQ(p.source_transport->registered, with_bytes) << "refit " << r;
  }
  EXPECT_EQ(p.source_transport->deregistered, 0);
  const int maps = p.destination_transport->mapped;
  // The parameters move (new memory): registered again; the old registrations go.
  auto moved = model(9);
  Received got;
  p.refit(moved, got.loader());
  for (const auto& t : moved) EXPECT_EQ(got.tensors[t.info.name].data, t.data);
  EXPECT_EQ(p.source_transport->registered, 2 * with_bytes);
  EXPECT_EQ(p.source_transport->deregistered, with_bytes);
  EXPECT_GT(p.destination_transport->mapped, maps);
}

TEST(InPlace, SlicesGoInPlaceWhenContiguousAndThroughBucketsOtherwise) {
  std::vector<OwnedTensor> weights = {
      make_tensor("q", DType::kBFloat16, {8, 6}, 1),  // rows 4..7: contiguous
      make_tensor("o", DType::kFloat32, {5, 8}, 2),   // columns 2..5: strided, packed
      make_tensor("n", DType::kFloat32, {8}, 3),      // whole
  };
  Layout layout;
  layout.tensors["q"] = Request::narrow(0, 4, 4);
  layout.tensors["o"] = Request::narrow(1, 2, 4);
  InPlacePair p({.bucket = 64, .layout = layout});
  Received got;
  auto stats = p.refit(weights, got.loader());
  expect_received(weights, got, layout);
  EXPECT_EQ(stats.in_place_bytes, 4u * 6 * 2 + 8 * 4);
  EXPECT_EQ(stats.wire_bytes, 5u * 4 * 4);
}

// Small tensors are cheaper packed than read one by one from the source's memory.
TEST(InPlace, ADestinationThatDoesNotMapGetsSmallTensorsThroughBuckets) {
  InPlacePair p({.destination_maps = false});
  const auto weights = model(5);
  Received got;
  auto stats = p.refit(weights, got.loader());
  for (const auto& t : weights) EXPECT_EQ(got.tensors[t.info.name].data, t.data);
  EXPECT_EQ(stats.in_place_bytes, 0u);
  EXPECT_EQ(p.sent.in_place_bytes, 0u);
  EXPECT_EQ(p.source_transport->registered, 0);  // nothing registered for nothing
}

// Tensors of at least 64 KiB (and one split over two buckets), small ones between them, an empty
// one and a strided slice: what a destination that reads the source's memory gets.
std::vector<OwnedTensor> large_model(uint32_t seed) {
  return {
      make_tensor("embed", DType::kBFloat16, {256, 256}, seed + 1),  // 128 KiB
      make_tensor("norm", DType::kFloat32, {16}, seed + 2),
      make_tensor("empty", DType::kFloat32, {0, 4}, seed + 3),
      make_tensor("qkv", DType::kFloat32, {300, 256}, seed + 4),  // 300 KiB: larger than a bucket
      make_tensor("ids", DType::kInt64, {3}, seed + 5),
      make_tensor("head", DType::kFloat8E4M3FN, {70001}, seed + 6),  // odd size: padding after it
      make_tensor("o", DType::kFloat32, {256, 128}, seed + 7),       // sliced by columns below: strided
  };
}

Layout columns_of_o() {
  Layout layout;
  layout.tensors["o"] = Request::narrow(1, 0, 64);
  return layout;
}

// A destination that cannot map (another host) reads large tensors from the source's own memory,
// unpacked: only the small tensors and the strided slice go through the source's buffers.
TEST(InPlace, ADestinationThatReadsTheSourcesMemoryGetsLargeTensorsUnpacked) {
  for (bool checksums : {false, true}) {
    InPlacePair p({.bucket = 256 << 10, .destination_maps = false, .checksums = checksums, .layout = columns_of_o()});
    auto weights = large_model(11);
    const uint64_t read_in_place = (128 + 300) * 1024 + 70001;  // embed, qkv, head
    for (uint32_t r = 0; r < 3; ++r) {
      // Training changes the values, not where they live: every refit reads them afresh.
      for (auto& t : weights)
        for (size_t i = 0; i < t.data.size(); ++i) t.data[i] = static_cast<std::byte>(i * 7 + r * 13 + 1);
      Received got;
      auto stats = p.refit(weights, got.loader());
      expect_received(weights, got, columns_of_o());
      EXPECT_EQ(stats.in_place_bytes, read_in_place) << "refit " << r << ", checksums " << checksums;
      EXPECT_EQ(p.sent.in_place_bytes, read_in_place);
      EXPECT_EQ(p.destination_transport->mapped, 0);
      // The same buckets every refit: their manifests are replayed.
      if (r > 0) EXPECT_EQ(stats.replayed_buckets, stats.buckets) << "refit " << r;
    }
    EXPECT_EQ(p.source_transport->registered, 3);  // the three large tensors, once
  }
}

// A transport with batched_reads gets each bucket's reads in one post_reads call; one without it
// refuses such a call.
TEST(InPlace, ABatchingTransportReadsEachBucketInOneCall) {
  InPlacePair p({.bucket = 256 << 10,
                 .destination_maps = false,
                 .checksums = true,
                 .batched_reads = true,
                 .layout = columns_of_o()});
  const auto weights = large_model(13);
  Received got;
  auto stats = p.refit(weights, got.loader());
  expect_received(weights, got, columns_of_o());
  EXPECT_GT(stats.in_place_bytes, 0u);
  EXPECT_GT(p.destination_transport->batches, 0);
  EXPECT_LT(p.destination_transport->batches, static_cast<int>(stats.buckets) + 1);
  EXPECT_EQ(error_of(ErrorKind::kUnsupported,
                     [&] { p.source_transport->post_reads(0, {}, 0, deadline_after(std::chrono::seconds(1))); }),
            "INPROC reads one range at a time (no batched_reads)");
}

// A source whose views do not outlive send() has nothing to be read later: it packs everything.
TEST(InPlace, ADestinationThatReadsTheSourcesMemoryGetsTemporariesPacked) {
  InPlacePair p({.bucket = 256 << 10, .destination_maps = false});
  const auto weights = large_model(12);
  Received got;
  auto stats = p.refit(weights, got.loader(), /*temporaries=*/true);
  expect_received(weights, got, Layout{});
  EXPECT_EQ(stats.in_place_bytes, 0u);
  EXPECT_EQ(p.source_transport->registered, 0);
}

// A weight stream of temporaries (a gathered or converted copy per tensor) may reuse a view's
// memory for the next tensor: nothing of it may be read in place.
TEST(InPlace, AStreamOfTemporariesGoesThroughBuckets) {
  InPlacePair p({});
  const auto weights = model(6);
  Received got;
  auto stats = p.refit(weights, got.loader(), /*temporaries=*/true);
  for (const auto& t : weights) EXPECT_EQ(got.tensors[t.info.name].data, t.data);
  EXPECT_EQ(stats.in_place_bytes, 0u);
  EXPECT_EQ(p.sent.in_place_bytes, 0u);
  EXPECT_EQ(p.source_transport->registered, 0);
}

TEST(InPlace, ChecksumsCoverTheBytesReadInPlace) {
  {
    InPlacePair p({.checksums = true});
    const auto weights = model(7);
    Received got;
    auto stats = p.refit(weights, got.loader());
    for (const auto& t : weights) EXPECT_EQ(got.tensors[t.info.name].data, t.data);
    EXPECT_GT(stats.in_place_bytes, 0u);
  }
  {
    // What the destination maps differs by one byte from what the source hashed.
    InPlacePair p({.checksums = true, .corrupt_maps = true});
    Received got;
    EXPECT_THAT(testing::error_of(ErrorKind::kIntegrity, [&] { p.refit(model(7), got.loader()); }),
                ::testing::HasSubstr("arrived corrupted"));
    EXPECT_TRUE(p.destination->stale());
  }
}

}  // namespace
}  // namespace refit
