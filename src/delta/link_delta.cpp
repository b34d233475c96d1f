#include "delta/link_delta.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <mutex>
#include <optional>
#include <unordered_set>

#include "core/fail.h"
#include "core/random_id.h"
#include "core/wire.h"
#include "delta/bits.h"
#include "delta/codec.h"
#include "delta/device_delta.h"
#include "memory/host_copy_pool.h"
#include "refit/ext/box_copy.h"

namespace refit {
namespace {

constexpr std::string_view kMarkerMagic = "RFDV";
constexpr std::string_view kDeltaEndName = "refit:delta-end";
constexpr int64_t kMarkerBytes = 4 + 2 * 8;

// The header ("refit:delta": the version the changes apply to, 0 for none, and the one they make).
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

// The trailer ("refit:delta-end"): how many tensors came after the header, and the checksum of
// each that came whole, by the hash of its name (a whole tensor is checked where it landed too).
std::vector<uint8_t> encode_trailer(uint64_t tensors, const std::vector<WholeSum>& whole) {
  ByteWriter w;
  w.put_raw(kMarkerMagic);
  w.put<uint64_t>(tensors);
  w.put<uint64_t>(whole.size());
  for (const WholeSum& s : whole) {
    w.put<uint64_t>(s.name_hash);
    w.put<uint8_t>(static_cast<uint8_t>(s.kind));
    w.put<uint64_t>(s.checksum);
  }
  return w.take();
}

uint64_t name_hash(std::string_view name) { return XXH3_64bits(name.data(), name.size()); }

// The checksum of a held copy, of the kind its side computes: xxh3 on the host, the word hash on a GPU.
WholeSum sum_of(std::string_view name, HeldTensor& held, DeviceDelta& gpu) {
  const DeltaChecksum kind = held.memory == MemoryKind::kHost ? DeltaChecksum::kXxh3 : DeltaChecksum::kWords;
  return {name_hash(name), kind, held.checksum(kind, gpu)};
}

// Checksums of host ranges, each of its kind, on the pool's threads: a destination checks every
// tensor it patched or got whole, and the word hash of a GPU source's tensors runs at ~2 GB/s on
// one core (on one H100's host the check of 2.2 GiB took 0.9 s a refit). The word hash is a sum,
// so a large tensor's goes in parts; xxh3 goes a range per part.
struct HostSum {
  std::span<const std::byte> bytes;
  DeltaChecksum kind = DeltaChecksum::kXxh3;
};
constexpr uint64_t kHashPartBytes = 8 << 20;

std::vector<uint64_t> host_checksums(std::span<const HostSum> sums, HostCopyPool& pool) {
  struct Part {
    size_t sum;
    uint64_t first_word, words;
  };
  std::vector<Part> parts;
  for (size_t k = 0; k < sums.size(); ++k) {
    const uint64_t words = (sums[k].bytes.size() + 7) / 8, per_part = kHashPartBytes / 8;
    if (sums[k].kind == DeltaChecksum::kXxh3 || words <= per_part) {
      parts.push_back({k, 0, words});
      continue;
    }
    for (uint64_t w = 0; w < words; w += per_part) parts.push_back({k, w, std::min(per_part, words - w)});
  }
  std::vector<uint64_t> terms(parts.size());
  pool.for_each(parts.size(), [&](size_t p) {
    const Part& part = parts[p];
    const HostSum& sum = sums[part.sum];
    if (sum.kind == DeltaChecksum::kXxh3) {
      terms[p] = delta_checksum(sum.bytes, sum.kind);
      return;
    }
    const uint64_t begin = part.first_word * 8,
                   end = std::min<uint64_t>(sum.bytes.size(), (part.first_word + part.words) * 8);
    terms[p] = word_hash_terms(sum.bytes.subspan(begin, end - begin), part.first_word);
  });
  std::vector<uint64_t> out(sums.size(), 0);
  for (size_t p = 0; p < parts.size(); ++p) out[parts[p].sum] += terms[p];
  for (size_t k = 0; k < sums.size(); ++k)
    if (sums[k].kind == DeltaChecksum::kWords) out[k] = word_hash::finish(out[k], sums[k].bytes.size());
  return out;
}

DeviceDelta& made(std::unique_ptr<DeviceDelta>& gpu) {
  if (!gpu) gpu = std::make_unique<DeviceDelta>();
  return *gpu;
}

}  // namespace

void HeldTensor::assign(const TensorView& view, DeviceDelta& gpu, bool page_lock) {
  const uint64_t nbytes = view.info->nbytes();
  if (view.memory == MemoryKind::kHost) {
    device = DeviceBuffer();
    if (bytes.size() != nbytes) {  // unpinned before the vector lets its memory go
      pin = HostPin();
      pin_tried = nullptr;
    }
    bytes.assign(view.data, view.data + nbytes);
    if (page_lock && nbytes > 0 && pin_tried != bytes.data()) {
      pin = HostPin::pin(bytes.data(), bytes.size());
      pin_tried = bytes.data();
    }
  } else if (memory == MemoryKind::kCuda && info.nbytes() == nbytes && nbytes > 0) {
    gpu.assign(device, view.data, nbytes);
  } else {
    bytes.clear();
    device = gpu.copy_of(view.data, nbytes);
  }
  info = *view.info;
  memory = view.memory;
}

uint64_t HeldTensor::checksum(DeltaChecksum kind, DeviceDelta& gpu) {
  return memory == MemoryKind::kHost ? delta_checksum(bytes, kind) : gpu.checksum(device.data(), info.nbytes(), kind);
}

std::string delta_piece_name(const std::string& tensor, const Box& box) {
  return fmt::format("refit:piece:{}{}", tensor, to_string(box));
}

TensorView PackedBoxes::pack(const TensorView& view, const Box& box, const TensorInfo& info, CopyStream& copies) {
  Packed& packed = packed_[info.name];
  packed.info = info;
  if (view.info->nbytes() > 0 && view.data == nullptr)
    fail(ErrorKind::kInvalidArgument, "tensor '{}' ({} bytes) has no data pointer", view.info->name,
         view.info->nbytes());
  if (box.is_whole()) {
    packed.host.clear();
    packed.device = DeviceBuffer();
    return {&packed.info, view.data, view.memory};
  }
  const uint64_t bytes = info.nbytes();
  std::byte* data = nullptr;
  if (view.memory == MemoryKind::kHost) {
    packed.device = DeviceBuffer();
    packed.host.resize(bytes);
    data = packed.host.data();
  } else {
    packed.host.clear();
    if (packed.device.size() != bytes) packed.device = DeviceBuffer(Device{Device::Kind::kCuda, -1}, bytes);
    data = packed.device.data();
  }
  for_each_box_block(view.info->shape, dtype_size(view.info->dtype), box, 0, bytes, [&](const BoxBlock& b) {
    copies.copy_2d(data + b.packed_offset, b.row_bytes, view.data + b.tensor_offset, b.pitch, b.row_bytes, b.rows,
                   view.memory, view.memory);
  });
  copies.synchronize(deadline_after(std::chrono::duration<double>(timeout_s_)));  // compared as soon as it is packed
  return {&packed.info, data, view.memory};
}

SourceDelta::SourceDelta(double timeout_s) : packed_(timeout_s) {}
SourceDelta::~SourceDelta() = default;

TensorView SourceDelta::add_record(TensorInfo info, std::vector<uint8_t> bytes) {
  records_.push_back({std::move(info), std::move(bytes)});
  const Record& r = records_.back();
  return {&r.info, reinterpret_cast<const std::byte*>(r.bytes.data()), MemoryKind::kHost};
}

TensorView SourceDelta::begin(uint64_t destination_version, const std::string& destination, bool measured) {
  counts_ = {};
  records_.clear();
  whole_.clear();
  waiting_.clear();  // left by a failed refit
  infos_.clear();
  waiting_bytes_ = 0;
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
  const uint64_t base = changes ? base_version_ : 0;
  // Until commit(), the base is being rewritten: a failure in between must not leave it usable.
  base_version_ = 0;
  return add_record(TensorInfo{std::string(kDeltaHeaderName), DType::kUInt8, {kMarkerBytes}},
                    encode_marker(base, next_version_));
}

void SourceDelta::next(std::span<const TensorView> views, std::vector<TensorView>& out, HostCopyPool& pool) {
  out.assign(views.begin(), views.end());    // whole, unless changes go instead
  std::vector<DeviceDelta::EncodeJob> jobs;  // the GPU tensors compared, together
  std::vector<size_t> job_view;
  std::deque<std::vector<uint8_t>> records;  // the GPU jobs' records (a deque: their addresses stay)
  // The host tensors, copied into their bases or compared with them on the pool's threads.
  struct HostJob {
    size_t view = 0;  // in `views`
    HeldTensor* base = nullptr;
    bool whole = false;  // copied, not compared
    std::vector<uint8_t> record;
    bool encoded = false;
    size_t first_part = 0, parts = 0;  // compared in parts: which of `parts` below are its
  };
  std::deque<HostJob> host_jobs;
  // The checksums of the tensors that go whole, by view, so that the trailer lists them in the
  // stream's order whichever thread computed them.
  std::vector<std::optional<WholeSum>> sums(views.size());
  std::unordered_set<std::string_view> compared;
  DeviceDelta& device = gpu();
  for (size_t k = 0; k < views.size(); ++k) {
    const TensorView& view = views[k];
    if (view.info == nullptr) fail(ErrorKind::kInvalidArgument, "the weight stream yielded a tensor without metadata");
    const TensorInfo& info = *view.info;
    if (info.name.starts_with("refit:delta"))
      fail(ErrorKind::kInvalidArgument, "tensor '{}': names starting with 'refit:delta' are refit's own (delta refit)",
           info.name);
    ++counts_.tensors;
    const uint64_t nbytes = info.nbytes();
    if (nbytes > 0 && view.data == nullptr)
      fail(ErrorKind::kInvalidArgument, "tensor '{}' ({} bytes) has no data pointer", info.name, nbytes);
    // One use of a base per call: the jobs below update theirs later, on other threads.
    if (views.size() > 1 && !compared.insert(info.name).second)
      fail(ErrorKind::kInvalidArgument, "tensor '{}' appears twice in one refit", info.name);
    auto it = base_.find(info.name);
    // Whole: the destination takes it as it is, and so does our base, whose checksum the trailer
    // carries. Otherwise the encoder makes the base equal to the tensor, changes sent or not.
    const bool whole = !changes_now_ || it == base_.end() || !(it->second.info == info) ||
                       it->second.memory != view.memory || nbytes == 0;
    HeldTensor& base = whole ? base_[info.name] : it->second;
    if (view.memory == MemoryKind::kHost) {
      host_jobs.push_back({k, &base, whole, {}, false});
    } else if (whole) {
      base.assign(view, device);
      sums[k] = sum_of(info.name, base, device);
    } else {
      jobs.push_back({&base.device, view.data, nbytes, dtype_size(info.dtype), &records.emplace_back(), {}});
      job_view.push_back(k);
    }
  }
  auto sent_as_record = [&](size_t k, std::vector<uint8_t> record) {
    ++counts_.changed_tensors;
    counts_.record_bytes += record.size();
    const auto size = static_cast<int64_t>(record.size());
    out[k] = add_record(TensorInfo{std::string(kDeltaTensorPrefix) + views[k].info->name, DType::kUInt8, {size}},
                        std::move(record));
  };
  // Host tensors on the pool's threads, each compared with scratch of its own (kept for the next
  // call); a large one in parts, so that one embedding does not hold a batch on one thread.
  auto take_scratch = [&] {
    std::lock_guard lock(scratch_mutex_);
    if (scratch_.empty()) return std::make_unique<DeltaScratch>();
    auto scratch = std::move(scratch_.back());
    scratch_.pop_back();
    return scratch;
  };
  auto give_back = [&](std::unique_ptr<DeltaScratch> scratch) {
    std::lock_guard lock(scratch_mutex_);
    scratch_.push_back(std::move(scratch));
  };
  struct Item {
    size_t job = 0;
    size_t part = SIZE_MAX;  // in `parts`; SIZE_MAX: the whole tensor
  };
  std::vector<Item> items;
  std::vector<DeltaPart> parts;
  std::vector<std::unique_ptr<DeltaScratch>> part_scratch;  // parallel to parts
  for (size_t j = 0; j < host_jobs.size(); ++j) {
    HostJob& job = host_jobs[j];
    const uint64_t nbytes = views[job.view].info->nbytes();
    if (job.whole || pool.threads() == 0 || nbytes < 2 * kScanPartBytes) {
      items.push_back({j});
      continue;
    }
    job.first_part = parts.size();
    for (uint64_t at = 0; at < nbytes; at += kScanPartBytes) {
      items.push_back({j, parts.size()});
      parts.push_back({at, std::min(kScanPartBytes, nbytes - at)});
      part_scratch.push_back(take_scratch());
      parts.back().found = part_scratch.back().get();
    }
    job.parts = parts.size() - job.first_part;
  }
  pool.for_each(items.size(), [&](size_t i) {
    HostJob& job = host_jobs[items[i].job];
    const TensorView& view = views[job.view];
    const size_t element = dtype_size(view.info->dtype);
    if (items[i].part != SIZE_MAX) {
      DeltaPart& part = parts[items[i].part];
      scan_delta_part(std::span(job.base->bytes).subspan(part.first_byte, part.bytes),
                      bytes_of(view).subspan(part.first_byte, part.bytes), element, part);
      return;
    }
    if (!job.whole) {
      auto scratch = take_scratch();
      job.encoded = encode_delta(job.base->bytes, bytes_of(view), element, job.record, scratch.get()).encoded;
      give_back(std::move(scratch));
    } else {
      job.base->assign(view, device);
    }
    // Dense changes go whole after all (the base is the tensor now).
    if (!job.encoded) sums[job.view] = sum_of(view.info->name, *job.base, device);
  });
  // The tensors compared in parts: their records, a tensor per thread.
  std::vector<size_t> split;
  for (size_t j = 0; j < host_jobs.size(); ++j)
    if (host_jobs[j].parts > 0) split.push_back(j);
  pool.for_each(split.size(), [&](size_t i) {
    HostJob& job = host_jobs[split[i]];
    const TensorView& view = views[job.view];
    auto joined = take_scratch();
    job.encoded = join_delta_parts(job.base->bytes, bytes_of(view), dtype_size(view.info->dtype),
                                   std::span(parts).subspan(job.first_part, job.parts), job.record, *joined)
                      .encoded;
    give_back(std::move(joined));
    if (!job.encoded) sums[job.view] = sum_of(view.info->name, *job.base, device);
  });
  // Kept for the next call, a few: a part's changes are small where a record pays.
  for (auto& scratch : part_scratch)
    if (scratch_.size() <= static_cast<size_t>(pool.threads()) + 1) scratch_.push_back(std::move(scratch));
  for (HostJob& job : host_jobs)
    if (job.encoded) sent_as_record(job.view, std::move(job.record));
  if (!jobs.empty()) device.encode_batch(jobs, &pool);
  for (size_t j = 0; j < jobs.size(); ++j) {
    const size_t k = job_view[j];
    if (jobs[j].result.encoded)
      sent_as_record(k, std::move(*jobs[j].out));
    else
      sums[k] = sum_of(views[k].info->name, base_.find(views[k].info->name)->second, device);
  }
  for (auto& sum : sums)
    if (sum) whole_.push_back(*sum);
}

std::span<const TensorView> SourceDelta::add(const TensorView& view, const Box& box, const TensorInfo& info,
                                             bool outlives, CopyStream& copies, HostCopyPool& pool) {
  const bool as_is = box.is_whole() && info.name == view.info->name;
  TensorView in = as_is ? view : packed_.pack(view, box, info, copies);
  // Compared in batches: GPU tensors (two waits a batch), and host tensors where the pool has threads.
  const bool batches = in.memory == MemoryKind::kCuda || pool.threads() > 0;
  const bool waits = batches && (outlives || !as_is);
  if (waits) in.info = &infos_.emplace_back(*in.info);
  waiting_.push_back(in);
  waiting_bytes_ += in.info->nbytes();
  if (waits && waiting_.size() < delta_schedule::kBatchTensors && waiting_bytes_ < delta_schedule::kBatchBytes)
    return {};
  return flush(pool);
}

std::span<const TensorView> SourceDelta::flush(HostCopyPool& pool) {
  next(waiting_, ready_, pool);
  waiting_.clear();
  waiting_bytes_ = 0;
  return ready_;
}

TensorView SourceDelta::end() {
  std::vector<uint8_t> trailer = encode_trailer(counts_.tensors, whole_);
  const auto size = static_cast<int64_t>(trailer.size());
  return add_record(TensorInfo{std::string(kDeltaEndName), DType::kUInt8, {size}}, std::move(trailer));
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
  whole_.clear();
  announced_whole_.clear();
}

void DestinationDelta::transform(std::span<const TensorView> in, std::span<const std::shared_ptr<const void>> in_owners,
                                 std::vector<TensorView>& out, std::vector<std::shared_ptr<const void>>& owners,
                                 const std::string& who, HostCopyPool& pool) {
  out.clear();
  owners.clear();
  // Changes are applied together at the end of the batch (or before a tensor they touch arrives
  // whole), and each result is checked before the batch goes to the loader: records decoded and
  // host tensors patched and hashed on the pool's threads, GPU tensors patched with one wait (per
  // GPU). The batch's records and markers that arrived in GPU memory cross to the host first, together.
  struct Patch {
    std::string_view name;
    HeldTensor* held;
    std::span<const uint8_t> record;
    std::string what;
  };
  std::vector<Patch> host_patches, gpu_patches;
  // Adds the seconds since `start` to `total`, and returns now.
  auto lap = [](double& total, Clock::time_point start) {
    const auto now = Clock::now();
    total += std::chrono::duration<double>(now - start).count();
    return now;
  };
  // By index in `in`: a record's or marker's bytes on the host.
  std::vector<std::span<const uint8_t>> on_host(in.size());
  std::vector<DeviceDelta::Range> in_gpu(in.size());
  bool any_in_gpu = false;
  for (size_t k = 0; k < in.size(); ++k) {
    const TensorView& view = in[k];
    if (view.memory == MemoryKind::kHost) {
      on_host[k] = {reinterpret_cast<const uint8_t*>(view.data), view.info->nbytes()};
    } else if (view.info->name.starts_with(kDeltaHeaderName) && view.info->nbytes() > 0) {
      in_gpu[k] = {view.data, view.info->nbytes()};
      any_in_gpu = true;
    }
  }
  if (any_in_gpu) {
    const auto start = Clock::now();
    gpu().read(in_gpu, on_host);
    lap(counts_.to_host_seconds, start);
  }
  std::unordered_set<const HeldTensor*> pending;  // tensors with a patch or copy not yet applied
  // Each batch's records are decoded (and host tensors patched) together, their parts on the pool's threads.
  const DeltaForEach runner = parts_on(pool);
  auto patch_on_host = [&] {
    if (host_patches.empty()) return;
    std::vector<RecordToApply> records;
    for (const Patch& p : host_patches)
      records.push_back({p.held->bytes, dtype_size(p.held->info.dtype), p.record, p.what, {}});
    const auto start = Clock::now();
    apply_delta(records, runner);
    const auto applied = lap(counts_.decode_seconds, start);
    std::vector<HostSum> sums;
    for (const RecordToApply& r : records) sums.push_back({r.target, r.header.checksum_kind});
    const std::vector<uint64_t> now = host_checksums(sums, pool);
    for (size_t k = 0; k < host_patches.size(); ++k)
      check_patched(host_patches[k].name, records[k].header, now[k], who);
    lap(counts_.patch_seconds, applied);
    host_patches.clear();
  };
  auto patch_on_gpu = [&] {
    if (gpu_patches.empty()) return;
    // Each record's changes are decoded straight into the page-locked memory they cross to the GPU from.
    DeviceDelta& device = gpu();
    const auto start = Clock::now();
    std::vector<RecordToDecode> records;
    for (size_t k = 0; k < gpu_patches.size(); ++k) {
      const Patch& p = gpu_patches[k];
      const size_t element_size = dtype_size(p.held->info.dtype);
      if (device.queue_patch(p.held->device, p.held->info.nbytes(), element_size,
                             read_delta_header(p.record, p.what)) != k)
        fail(ErrorKind::kInternal, "delta refit: GPU patches of an earlier batch are still queued");
      records.push_back({p.record, element_size, p.held->info.nbytes(), {}, {}, p.what, {}});
    }
    for (size_t k = 0; k < records.size(); ++k) {
      const DeviceDelta::Changes changes = device.changes_of(k);
      records[k].index = changes.index;
      records[k].values = changes.values;
    }
    decode_delta_into(records, runner);
    const auto decoded = lap(counts_.decode_seconds, start);
    const auto patched = device.patch_queued();
    for (size_t k = 0; k < gpu_patches.size(); ++k)
      check_patched(gpu_patches[k].name, patched[k].header, patched[k].checksum, who);
    lap(counts_.patch_seconds, decoded);
    gpu_patches.clear();
  };
  // Tensors that came whole in host memory are copied into what we hold together, on the pool's
  // threads (a first refit is all whole), before any patch queued after them.
  std::vector<std::pair<HeldTensor*, TensorView>> copies;
  std::vector<std::pair<size_t, HeldTensor*>> came_whole;  // by index in `out`
  DeviceDelta& device = gpu();
  auto apply_pending = [&] {
    const auto start = Clock::now();
    pool.for_each(copies.size(), [&](size_t k) { copies[k].first->assign(copies[k].second, device, true); });
    lap(counts_.whole_seconds, start);
    copies.clear();
    patch_on_gpu();
    patch_on_host();
    pending.clear();
  };
  try {
    for (size_t k = 0; k < in.size(); ++k) {
      const TensorView& view = in[k];
      const std::string& name = view.info->name;
      if (name == kDeltaHeaderName) {
        if (header_seen_ || arrived_ > 0)
          fail(ErrorKind::kProtocol, "{} sent the delta header after {} tensors", who, arrived_);
        auto [base, made] = decode_marker(on_host[k], view, who);
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
        ByteReader trailer(on_host[k], fmt::format("'{}' from {}", name, who));
        trailer.expect_magic(kMarkerMagic);
        announced_ = trailer.get<uint64_t>("tensors");
        const uint64_t whole = trailer.get<uint64_t>("whole tensors");
        if (whole > announced_)
          fail(ErrorKind::kProtocol, "{} announced {} whole tensors of {}", who, whole, announced_);
        for (uint64_t w = 0; w < whole; ++w) {
          WholeSum s;
          s.name_hash = trailer.get<uint64_t>("name hash");
          const uint8_t kind = trailer.get<uint8_t>("checksum kind");
          if (kind > static_cast<uint8_t>(DeltaChecksum::kWords))
            fail(ErrorKind::kProtocol, "{} sent a whole tensor's checksum of unknown kind {}", who, kind);
          s.kind = static_cast<DeltaChecksum>(kind);
          s.checksum = trailer.get<uint64_t>("checksum");
          announced_whole_.push_back(s);
        }
        trailer.expect_end();
        ended_ = true;
        continue;
      }
      ++arrived_;
      ++counts_.tensors;
      if (name.starts_with(kDeltaTensorPrefix)) {
        const std::string_view target = std::string_view(name).substr(kDeltaTensorPrefix.size());
        auto it = held_.find(target);
        if (it == held_.end())
          fail(ErrorKind::kProtocol, "{} sent changes to '{}', which this destination never received whole", who,
               target);
        HeldTensor& held = it->second;
        Patch patch{it->first, &held, on_host[k], fmt::format("changes to '{}' from {}", target, who)};
        // A tensor patched twice in a batch (a protocol error), or a batch on another GPU: what is
        // pending is applied first, in order.
        const bool other_gpu = held.memory != MemoryKind::kHost && !gpu_patches.empty() &&
                               gpu_patches.front().held->device.device_index() != held.device.device_index();
        if (!pending.insert(&held).second || other_gpu) {
          apply_pending();
          pending.insert(&held);
        }
        (held.memory == MemoryKind::kHost ? host_patches : gpu_patches).push_back(std::move(patch));
        ++counts_.changed_tensors;
        counts_.record_bytes += view.info->nbytes();
        out.push_back({&held.info, held.data(), held.memory});
        owners.push_back(nullptr);
        continue;
      }
      HeldTensor& held = held_[name];
      if (!pending.insert(&held).second) {  // (a protocol error) what is pending goes first
        apply_pending();
        pending.insert(&held);
      }
      if (view.memory == MemoryKind::kHost) {
        copies.emplace_back(&held, view);
      } else {
        const auto start = Clock::now();
        held.assign(view, device, /*page_lock=*/true);
        lap(counts_.whole_seconds, start);
      }
      whole_.push_back(&*held_.find(name));
      came_whole.emplace_back(out.size(), &held);
      out.push_back(view);
      owners.push_back(k < in_owners.size() ? in_owners[k] : nullptr);
    }
    apply_pending();
    // The loader reads what came whole from the copy too, so that nothing it gets lies in the
    // transfer buffer, which goes back to the source before the loader runs.
    for (const auto& [index, held] : came_whole) {
      if (held->info.nbytes() == 0) continue;
      out[index] = {&held->info, held->data(), held->memory};
      owners[index] = nullptr;
    }
  } catch (...) {
    if (gpu_) gpu_->drop_queued();
    throw;
  }
}

void DestinationDelta::check_patched(std::string_view name, const DeltaHeader& h, uint64_t now,
                                     const std::string& who) {
  if (now != h.checksum)
    fail(ErrorKind::kIntegrity,
         "'{}' after applying {} changed elements from {} does not match the source's checksum: the weights "
         "this destination held were not the source's base",
         name, h.changed, who);
}

void DestinationDelta::finish(const std::string& who, HostCopyPool& pool) {
  if (!header_seen_) fail(ErrorKind::kProtocol, "{} sent no delta header (is delta on at both ends?)", who);
  if (!ended_) fail(ErrorKind::kProtocol, "{} did not end its delta refit", who);
  if (announced_ != arrived_)
    fail(ErrorKind::kProtocol, "{} announced {} tensors in its delta refit, {} arrived", who, announced_, arrived_);
  // Each tensor that came whole, as it landed here, against the source's checksum of what it sent.
  if (announced_whole_.size() != whole_.size())
    fail(ErrorKind::kProtocol, "{} announced {} whole tensors in its delta refit, {} arrived", who,
         announced_whole_.size(), whole_.size());
  std::map<uint64_t, const WholeSum*> announced;
  for (const WholeSum& s : announced_whole_) announced[s.name_hash] = &s;
  std::vector<const WholeSum*> wanted;
  std::vector<HostSum> on_host;  // the host copies' checksums, together (host_checksums)
  for (auto* entry : whole_) {
    auto it = announced.find(name_hash(entry->first));
    if (it == announced.end())
      fail(ErrorKind::kProtocol, "{} sent '{}' whole but announced no checksum for it", who, entry->first);
    wanted.push_back(it->second);
    if (entry->second.memory == MemoryKind::kHost) on_host.push_back({entry->second.bytes, it->second->kind});
  }
  const std::vector<uint64_t> host_sums = host_checksums(on_host, pool);
  size_t next_host = 0;
  for (size_t k = 0; k < whole_.size(); ++k) {
    const std::string& name = whole_[k]->first;
    HeldTensor& held = whole_[k]->second;
    const WholeSum& want = *wanted[k];
    const uint64_t now = held.memory == MemoryKind::kHost ? host_sums[next_host++] : held.checksum(want.kind, gpu());
    if (now != want.checksum)
      fail(ErrorKind::kIntegrity,
           "'{}' as it arrived whole from {} does not match the source's checksum of what it sent: the refit "
           "delivered other bytes",
           name, who);
  }
  version_ = new_version_;
}

}  // namespace refit
