// Helpers for engine tests over the in-process transport: synthetic tensors, a vector-backed
// weight source, and a loader that records what it received.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/protocol.h"
#include "refit/checkpoint_engine.h"
#include "transport/inproc/inproc_transport.h"

namespace refit::testing {

struct OwnedTensor {
  TensorInfo info;
  std::vector<std::byte> data;
};

inline OwnedTensor make_tensor(std::string name, DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  OwnedTensor t{{std::move(name), dtype, std::move(shape)}, {}};
  t.data.resize(t.info.nbytes());
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : t.data) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::byte>(x);
  }
  return t;
}

class VectorSource : public WeightSource {
 public:
  explicit VectorSource(const std::vector<OwnedTensor>& tensors) : tensors_(tensors) {}
  bool next(TensorView* out) override {
    if (index_ == tensors_.size()) return false;
    const auto& t = tensors_[index_++];
    *out = {&t.info, t.data.data(), MemoryKind::kHost};
    return true;
  }
  size_t consumed() const { return index_; }
  bool views_outlive_send() const override { return outlive_; }
  VectorSource& temporaries() {  // views that do not outlive send(): nothing goes in place
    outlive_ = false;
    return *this;
  }

 private:
  const std::vector<OwnedTensor>& tensors_;
  size_t index_ = 0;
  bool outlive_ = true;
};

struct Received {
  std::map<std::string, OwnedTensor> tensors;
  std::vector<size_t> batch_sizes;
  BatchLoader loader() {
    return [this](LoadBatch batch) {
      batch_sizes.push_back(batch.size());
      for (const auto& v : batch) {
        OwnedTensor t{*v.info, std::vector<std::byte>(v.data, v.data + v.info->nbytes())};
        tensors[v.info->name] = std::move(t);
      }
    };
  }
};

inline EngineOptions inproc_options(const std::shared_ptr<InProcFabric>& fabric, uint64_t bucket_bytes,
                                    const SessionId& session, double timeout_s = 10.0) {
  EngineOptions o;
  o.bucket_bytes = bucket_bytes;
  o.session = session;
  o.config.timeout_s = timeout_s;
  // The in-process transport maps any registered memory, so with direct_reads every tensor of
  // these tests would go in place: they test buckets, and the in-place tests turn it on.
  o.config.direct_reads = false;
  o.transport = create_inproc_transport(fabric);
  return o;
}

inline void expect_same(const std::vector<OwnedTensor>& sent, const Received& got) {
  ASSERT_EQ(got.tensors.size(), sent.size());
  for (const auto& t : sent) {
    auto it = got.tensors.find(t.info.name);
    ASSERT_NE(it, got.tensors.end()) << t.info.name;
    EXPECT_EQ(it->second.info, t.info) << t.info.name;
    EXPECT_EQ(it->second.data, t.data) << t.info.name;
  }
}

struct Pair {
  std::shared_ptr<InProcFabric> fabric = make_inproc_fabric();
  SessionId session = new_session_id();
  std::unique_ptr<CheckpointEngine> source, destination;
  std::vector<Metadata> metadata;
  SendStats sent_stats;  // of the last refit

  explicit Pair(uint64_t bucket, bool release = false, double timeout_s = 10.0, bool map = true,
                bool receives_only = false) {
    auto so = inproc_options(fabric, bucket, session, timeout_s);
    auto dop = inproc_options(fabric, bucket, session, timeout_s);
    so.config.release_after_refit = dop.config.release_after_refit = release;
    dop.config.map_source_buffers = map;
    dop.receives_only = receives_only;
    source = std::make_unique<CheckpointEngine>(so);
    destination = std::make_unique<CheckpointEngine>(dop);
  }
  void connect() {
    metadata = {source->prepare(), destination->prepare()};
    source->init_source(0, 1, 1, metadata);
    destination->init_destination(0, 1, 1, metadata);
  }
  // Sends `weights` from the source on a thread of its own.
  std::future<SendStats> start_send(const std::vector<OwnedTensor>& weights) {
    return std::async(std::launch::async, [this, &weights] {
      VectorSource src(weights);
      return source->send(src);
    });
  }
  ReceiveStats refit(const std::vector<OwnedTensor>& weights, Received& got) {
    auto sent = start_send(weights);
    ReceiveStats stats;
    try {
      stats = destination->receive(got.loader());
    } catch (...) {
      sent.wait();
      throw;
    }
    sent_stats = sent.get();
    return stats;
  }
};

// A destination connected to a fake source: the test sends it whatever messages it likes.
struct RogueSource {
  std::shared_ptr<InProcFabric> fabric = make_inproc_fabric();
  SessionId session = new_session_id();
  std::unique_ptr<Transport> transport = create_inproc_transport(fabric);
  std::vector<std::byte> memory = std::vector<std::byte>(128);
  CheckpointEngine destination{inproc_options(fabric, 64, session)};
  PeerId to_destination = 0;
  uint64_t first_refit = 0;  // refit k of this connection is first_refit + k on the wire

  RogueSource() {
    auto region = transport->register_memory(memory.data(), memory.size());
    protocol::EngineMetadata fake;
    fake.session = session;
    fake.bucket_bytes = 64;
    fake.transport_name = transport->name();
    fake.transport_address = transport->address();
    fake.buffers = transport->describe(region);
    std::vector<Metadata> md = {protocol::encode(fake), destination.prepare()};
    destination.init_destination(0, 1, 1, md);
    first_refit = protocol::first_refit(fake.generation, protocol::decode_metadata(md[1], "d").generation);
    to_destination = transport->connect(protocol::decode_metadata(md[1], "d").transport_address, "destination");
  }
  void send(const Bytes& message) { transport->send(to_destination, message, deadline_after(std::chrono::seconds(1))); }
};

}  // namespace refit::testing
