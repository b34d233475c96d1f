#include "engine/delta.h"

#include <spdlog/spdlog.h>

#include "core/delta_codec.h"
#include "core/fail.h"
#include "core/random_id.h"
#include "core/wire.h"
#include "memory/cuda/device_delta.h"
#include "refit/ext/box_copy.h"

namespace refit {
namespace {

constexpr std::string_view kMarkerMagic = "RFDV";
constexpr std::string_view kDeltaEndName = "refit:delta-end";

// The header ("refit:delta": the version the changes apply to, 0 for none, and the one they make)
// and the trailer ("refit:delta-end": how many tensors came between them).
std::vector<uint8_t> encode_marker(uint64_t a, uint64_t b) {
  ByteWriter w;
  w.put_raw(kMarkerMagic);
  w.put<uint64_t>(a);
  w.put<uint64_t>(b);
  return w.take();
}

std::pair<uint64_t, uint64_t> decode_marker(std::span<const uint8_t> bytes, const TensorView& view,
                                            const std::string& who) {
  ByteReader in(bytes, fmt::format("'{}' from {}", view.info->name, who));
  in.expect_magic(kMarkerMagic);
  const uint64_t a = in.get<uint64_t>("first"), b = in.get<uint64_t>("second");
  in.expect_end();
  return {a, b};
}

std::span<const std::byte> bytes_of(const TensorView& view) { return {view.data, view.info->nbytes()}; }

DeviceDelta& made(std::unique_ptr<DeviceDelta>& gpu) {
  if (!gpu) gpu = std::make_unique<DeviceDelta>();
  return *gpu;
}

}  // namespace

void HeldTensor::assign(const TensorView& view, DeviceDelta& gpu) {
  const uint64_t nbytes = view.info->nbytes();
  if (view.memory == MemoryKind::kHost) {
    device = DeviceBuffer();
    bytes.assign(view.data, view.data + nbytes);
  } else if (memory == MemoryKind::kCuda && info.nbytes() == nbytes && nbytes > 0) {
    gpu.assign(device, view.data, nbytes);
  } else {
    bytes.clear();
    device = gpu.copy_of(view.data, nbytes);
  }
  info = *view.info;
  memory = view.memory;
}

// The weight stream a delta refit sends: header, each tensor as changes or whole, trailer. Every
// record it makes lives until the next begin(), so the views outlive send() whenever the
// caller's do.
class SourceDelta::Stream : public WeightSource {
 public:
  Stream(SourceDelta& owner, WeightSource& inner, bool changes, uint64_t base, uint64_t made)
      : owner_(owner), inner_(inner), changes_(changes) {
    add_marker(kDeltaHeaderName, encode_marker(base, made));
  }

  bool next(TensorView* out) override {
    if (pending_) {
      *out = view_of(records_.back());
      pending_ = false;
      return true;
    }
    if (ended_) return false;
    TensorView view;
    if (!inner_.next(&view)) {
      ended_ = true;
      add_marker(kDeltaEndName, encode_marker(sent_, 0));
      pending_ = false;
      *out = view_of(records_.back());
      return true;
    }
    if (view.info == nullptr) fail(ErrorKind::kInvalidArgument, "the weight stream yielded a tensor without metadata");
    const TensorInfo& info = *view.info;
    if (info.name.starts_with("refit:delta"))
      fail(ErrorKind::kInvalidArgument, "tensor '{}': names starting with 'refit:delta' are refit's own (delta refit)",
           info.name);
    ++sent_;
    const uint64_t nbytes = info.nbytes();
    if (nbytes > 0 && view.data == nullptr)
      fail(ErrorKind::kInvalidArgument, "tensor '{}' ({} bytes) has no data pointer", info.name, nbytes);
    auto it = owner_.base_.find(info.name);
    if (!changes_ || it == owner_.base_.end() || !(it->second.info == info) || it->second.memory != view.memory ||
        nbytes == 0) {
      // Whole: the destination takes it as it is, and so does our base.
      owner_.base_[info.name].assign(view, owner_.gpu());
    } else {
      // The encoder makes the base equal to the tensor whether or not it sends changes.
      std::vector<uint8_t> record;
      HeldTensor& base = it->second;
      const size_t element_size = dtype_size(info.dtype);
      const DeltaResult result = view.memory == MemoryKind::kHost
                                     ? encode_delta(base.bytes, bytes_of(view), element_size, record, &owner_.scratch_)
                                     : owner_.gpu().encode(base.device, view.data, nbytes, element_size, record);
      if (result.encoded) {
        ++owner_.counts_.changed_tensors;
        owner_.counts_.record_bytes += record.size();
        records_.push_back(
            {TensorInfo{
                 std::string(kDeltaTensorPrefix) + info.name, DType::kUInt8, {static_cast<int64_t>(record.size())}},
             std::move(record)});
        *out = view_of(records_.back());
        return true;
      }
    }
    *out = view;
    return true;
  }

  bool views_outlive_send() const override { return inner_.views_outlive_send(); }

 private:
  struct Record {
    TensorInfo info;
    std::vector<uint8_t> bytes;
  };
  static TensorView view_of(const Record& r) {
    return {&r.info, reinterpret_cast<const std::byte*>(r.bytes.data()), MemoryKind::kHost};
  }
  void add_marker(std::string_view name, std::vector<uint8_t> bytes) {
    const auto size = static_cast<int64_t>(bytes.size());
    records_.push_back({TensorInfo{std::string(name), DType::kUInt8, {size}}, std::move(bytes)});
    pending_ = true;
  }

  SourceDelta& owner_;
  WeightSource& inner_;
  const bool changes_;
  std::deque<Record> records_;  // a deque: views of earlier records stay valid
  bool pending_ = false;        // records_.back() is a marker not yet yielded
  bool ended_ = false;
  uint64_t sent_ = 0;
};

SelectedSource::SelectedSource(const Layout& layout, double timeout_s) : layout_(layout), timeout_s_(timeout_s) {}
SelectedSource::~SelectedSource() = default;

WeightSource& SelectedSource::begin(WeightSource& inner, CopyStream& copies, NameIndex& yielded) {
  inner_ = &inner;
  copies_ = &copies;
  yielded_ = &yielded;
  dropped_ = 0;
  return *this;
}

bool SelectedSource::next(TensorView* out) {
  TensorView view;
  while (inner_->next(&view)) {
    if (view.info == nullptr) fail(ErrorKind::kInvalidArgument, "the weight stream yielded a tensor without metadata");
    const Selection selection = select(layout_, *view.info);
    if (selection.take == Take::kDrop) {
      ++dropped_;
      continue;
    }
    yielded_->add(view.info->name);
    if (selection.take == Take::kWhole) {
      *out = view;
      return true;
    }
    Slice& slice = slices_[view.info->name];
    slice.info = selection.info;
    const uint64_t bytes = slice.info.nbytes();
    std::byte* data = nullptr;
    if (view.memory == MemoryKind::kHost) {
      slice.device = DeviceBuffer();
      slice.host.resize(bytes);
      data = slice.host.data();
    } else {
      slice.host.clear();
      if (slice.device.size() != bytes) slice.device = DeviceBuffer(Device{Device::Kind::kCuda, -1}, bytes);
      data = slice.device.data();
    }
    const Box box = Box::of(Request{selection.take, selection.slice});
    if (view.info->nbytes() > 0 && view.data == nullptr)
      fail(ErrorKind::kInvalidArgument, "tensor '{}' ({} bytes) has no data pointer", view.info->name,
           view.info->nbytes());
    for_each_box_block(view.info->shape, dtype_size(view.info->dtype), box, 0, bytes, [&](const BoxBlock& b) {
      copies_->copy_2d(data + b.packed_offset, b.row_bytes, view.data + b.tensor_offset, b.pitch, b.row_bytes, b.rows,
                       view.memory, view.memory);
    });
    copies_->synchronize(
        deadline_after(std::chrono::duration<double>(timeout_s_)));  // compared as soon as it is yielded
    *out = {&slice.info, data, view.memory};
    return true;
  }
  return false;
}

SourceDelta::SourceDelta() = default;
SourceDelta::~SourceDelta() = default;

WeightSource& SourceDelta::begin(WeightSource& weights, uint64_t destination_version, const std::string& destination,
                                 bool measured) {
  counts_ = {};
  const bool possible = base_version_ != 0 && destination_version == base_version_;
  if (!possible)
    spdlog::info("delta refit: {} {}: sending every tensor whole", destination,
                 destination_version == 0 ? "holds no version of the weights (new, restarted, or its last refit failed)"
                                          : "holds another version of the weights than this source's base");
  bool changes = possible;
  if (possible && measured && seconds_[0] >= 0 && seconds_[1] >= 0) {
    const bool faster = seconds_[1] < seconds_[0];
    changes = ++since_measured_ >= kRemeasureEvery ? !faster : faster;
    if (since_measured_ >= kRemeasureEvery) since_measured_ = 0;
    if (changes != changes_now_)
      spdlog::info(
          "delta refit (auto): sending {} to {}: the last refit sent as changes took {:.3f} s, whole {:.3f} s{}",
          changes ? "changes" : "every tensor whole", destination, seconds_[1], seconds_[0],
          changes != faster ? " (measuring the slower way again)" : "");
  }
  changes_now_ = changes;
  do next_version_ = random_u64();
  while (next_version_ == 0);
  stream_.reset();
  stream_ = std::make_unique<Stream>(*this, weights, changes, changes ? base_version_ : 0, next_version_);
  // Until commit(), the base is being rewritten: a failure in between must not leave it usable.
  base_version_ = 0;
  return *stream_;
}

uint64_t SourceDelta::commit(double seconds) {
  seconds_[changes_now_ ? 1 : 0] = seconds;
  base_version_ = next_version_;
  return base_version_;
}

DeviceDelta& SourceDelta::gpu() { return made(gpu_); }

void SourceDelta::drop() { base_version_ = 0; }

DestinationDelta::DestinationDelta() = default;
DestinationDelta::~DestinationDelta() = default;

DeviceDelta& DestinationDelta::gpu() { return made(gpu_); }

void DestinationDelta::begin() {
  header_seen_ = ended_ = false;
  announced_ = arrived_ = 0;
  counts_ = {};
}

void DestinationDelta::transform(std::span<const TensorView> in, std::span<const std::shared_ptr<const void>> in_owners,
                                 std::vector<TensorView>& out, std::vector<std::shared_ptr<const void>>& owners,
                                 const std::string& who) {
  out.clear();
  owners.clear();
  for (size_t k = 0; k < in.size(); ++k) {
    const TensorView& view = in[k];
    const std::string& name = view.info->name;
    if (name == kDeltaHeaderName) {
      if (header_seen_ || arrived_ > 0)
        fail(ErrorKind::kProtocol, "{} sent the delta header after {} tensors", who, arrived_);
      auto [base, made] = decode_marker(on_host(view), view, who);
      if (base != 0 && base != version_)
        fail(ErrorKind::kProtocol,
             "{} sent changes to weights version {:016x}, but this destination holds {}: refusing them", who, base,
             version_ == 0 ? std::string("none") : fmt::format("{:016x}", version_));
      if (made == 0) fail(ErrorKind::kProtocol, "{} sent a delta header without a version", who);
      header_seen_ = true;
      new_version_ = made;
      version_ = 0;  // what we hold changes from here on, until finish()
      continue;
    }
    if (!header_seen_)
      fail(ErrorKind::kProtocol, "{} sent '{}' before the delta header (is delta on at both ends?)", who, name);
    if (ended_) fail(ErrorKind::kProtocol, "{} sent '{}' after the end of its delta refit", who, name);
    if (name == kDeltaEndName) {
      announced_ = decode_marker(on_host(view), view, who).first;
      ended_ = true;
      continue;
    }
    ++arrived_;
    if (name.starts_with(kDeltaTensorPrefix)) {
      const std::string_view target = std::string_view(name).substr(kDeltaTensorPrefix.size());
      auto it = held_.find(target);
      if (it == held_.end())
        fail(ErrorKind::kProtocol, "{} sent changes to '{}', which this destination never received whole", who, target);
      HeldTensor& held = it->second;
      const std::string what = fmt::format("changes to '{}' from {}", target, who);
      const std::span<const uint8_t> record = on_host(view);
      const uint64_t nbytes = held.info.nbytes();
      const size_t element_size = dtype_size(held.info.dtype);
      DeltaHeader h;
      uint64_t now = 0;
      if (held.memory == MemoryKind::kHost) {
        h = apply_delta(held.bytes, element_size, record, what);
        now = delta_checksum(held.bytes, h.checksum_kind);
      } else {
        h = gpu().apply(held.device, nbytes, element_size, record, what);
        now = gpu().checksum(held.device.data(), nbytes, h.checksum_kind);
      }
      if (now != h.checksum)
        fail(ErrorKind::kIntegrity,
             "'{}' after applying {} changed elements from {} does not match the source's checksum: the weights "
             "this destination held were not the source's base",
             target, h.changed, who);
      ++counts_.changed_tensors;
      counts_.record_bytes += view.info->nbytes();
      out.push_back({&held.info, held.data(), held.memory});
      owners.push_back(nullptr);
      continue;
    }
    held_[name].assign(view, gpu());
    out.push_back(view);
    owners.push_back(k < in_owners.size() ? in_owners[k] : nullptr);
  }
}

std::span<const uint8_t> DestinationDelta::on_host(const TensorView& view) {
  if (view.memory == MemoryKind::kHost) return {reinterpret_cast<const uint8_t*>(view.data), view.info->nbytes()};
  gpu().read(view.data, view.info->nbytes(), record_);
  return record_;
}

void DestinationDelta::finish(const std::string& who) {
  if (!header_seen_) fail(ErrorKind::kProtocol, "{} sent no delta header (is delta on at both ends?)", who);
  if (!ended_) fail(ErrorKind::kProtocol, "{} did not end its delta refit", who);
  if (announced_ != arrived_)
    fail(ErrorKind::kProtocol, "{} announced {} tensors in its delta refit, {} arrived", who, announced_, arrived_);
  version_ = new_version_;
}

}  // namespace refit
