// Helpers for engine tests over the in-process transport: synthetic tensors, a vector-backed
// weight source, and a loader that records what it received.
#pragma once

#include <cstring>
#include <map>
#include <string>
#include <vector>

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

}  // namespace refit::testing
