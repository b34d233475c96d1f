#include "delta/device_delta.h"

#include "core/fail.h"
#include "delta/bits.h"
#include "memory/host_copy_pool.h"

#ifdef REFIT_HAVE_CUDA
#include <cstring>
#include <numeric>

#include "delta/kernels.h"
#include "memory/cuda/cuda_util.h"
#include "refit/ext/tensor_memory.h"
#endif

namespace refit {

#ifdef REFIT_HAVE_CUDA

namespace {

// Our own kernels on our own stream: seconds at most for the largest tensor; past this the GPU
// is not answering.
constexpr auto kKernelTimeout = std::chrono::seconds(120);

int device_of(const void* pointer, const char* what) {
  cudaPointerAttributes attributes{};
  cuda::check(cudaPointerGetAttributes(&attributes, pointer), "cudaPointerGetAttributes", what);
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
    fail(ErrorKind::kInvalidArgument, "{}: {} is not GPU memory", what, pointer);
  return attributes.device;
}

uint64_t rounded(size_t bytes) { return (bytes + 7) / 8 * 8; }

// A device array that keeps its largest size.
template <typename T>
struct Scratch {
  DeviceBuffer buffer;
  T* at_least(int device, uint64_t count) {
    if (buffer.size() < count * sizeof(T) || buffer.device_index() != device)
      buffer = DeviceBuffer(Device{Device::Kind::kCuda, device}, std::max<uint64_t>(count, 1) * sizeof(T));
    return reinterpret_cast<T*>(buffer.data());
  }
};

// A page-locked host array that keeps its largest size: copies to and from it are asynchronous
// (a pageable one makes each copy wait for the stream and go through a staging buffer).
template <typename T>
struct Pinned {
  TensorMemory memory;
  uint64_t size = 0;
  T* data() const { return reinterpret_cast<T*>(memory.data()); }
  // Keeps what the array holds (patches queued one after another decode into it).
  T* resize(uint64_t count) {
    if (count * sizeof(T) > memory.size()) {
      TensorMemory larger(MemoryKind::kHost, Device{}, std::max<uint64_t>(count, 2 * size) * sizeof(T), /*pin=*/true);
      if (size > 0) std::memcpy(larger.data(), memory.data(), size * sizeof(T));
      memory = std::move(larger);
    }
    size = count;
    return data();
  }
  std::span<const T> view() const { return {data(), size}; }
};

}  // namespace

struct DeviceDelta::State {
  int device = -1;
  cudaStream_t stream = nullptr;
  Scratch<uint32_t> counts;
  Scratch<uint64_t> sums, offsets, index, before, after;
  Pinned<uint32_t> host_counts;
  Pinned<uint64_t> host_sums, host_offsets, host_index, host_before, host_after;
  Pinned<uint8_t> host_records;  // read()'s
  // Patches queued (queue_patch), their changes at `first` of host_index and host_after.
  struct Queued {
    DeviceBuffer* target;
    size_t bytes;
    size_t element_size;
    DeltaHeader header;
    uint64_t first = 0;
  };
  std::vector<Queued> queued;

  // Binds to `device` (a stream there). The caller holds a DeviceGuard for it: the calling
  // thread's current GPU is the caller's own business again afterwards.
  void use(int d) {
    if (stream != nullptr && device != d) {
      cudaStreamDestroy(stream);
      stream = nullptr;
    }
    device = d;
    if (stream == nullptr)
      cuda::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                  "delta refit");
  }
  void launched(int status, const char* kernel) {
    cuda::check(static_cast<cudaError_t>(status), kernel, "delta refit");
  }
  void wait(const char* what) { cuda::wait_stream(stream, Clock::now() + kKernelTimeout, what); }
  template <typename T>
  void to_host(Pinned<T>& out, const T* from, uint64_t count) {
    out.resize(count);
    if (count > 0)
      cuda::check(cudaMemcpyAsync(out.data(), from, count * sizeof(T), cudaMemcpyDeviceToHost, stream),
                  "cudaMemcpyAsync", "delta refit: the changes to the host");
  }
  template <typename T>
  void to_device(T* to, std::span<const T> from) {
    if (!from.empty())
      cuda::check(cudaMemcpyAsync(to, from.data(), from.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync", "delta refit: the changes to the GPU");
  }

  // Launches the count of each block's changed elements (none without a base) and the hash of
  // `now`, and their copy to host_counts and host_sums; wait() before reading them.
  void count(const void* base, const void* now, size_t bytes, size_t element_size) {
    const uint64_t blocks = cuda::delta_blocks(bytes);
    launched(cuda::launch_delta_count(base, now, bytes, static_cast<uint32_t>(element_size),
                                      counts.at_least(device, blocks), sums.at_least(device, blocks), stream),
             "the delta count kernel");
    to_host(host_counts, counts.at_least(device, blocks), blocks);
    to_host(host_sums, sums.at_least(device, blocks), blocks);
  }
  // After count() and wait(): the changed elements, and the checksum of `bytes` bytes.
  uint64_t changed() const {
    const auto c = host_counts.view();
    return std::accumulate(c.begin(), c.end(), uint64_t{0});
  }
  uint64_t checksum(size_t bytes) const {
    const auto sums = host_sums.view();
    return word_hash::finish(std::accumulate(sums.begin(), sums.end(), uint64_t{0}), bytes);
  }

  ~State() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

DeviceDelta::DeviceDelta() : state_(std::make_unique<State>()) {}
DeviceDelta::~DeviceDelta() = default;

DeviceBuffer DeviceDelta::copy_of(const std::byte* data, size_t bytes) {
  if (bytes == 0) return {};
  const int device = device_of(data, "delta refit: keeping a copy of a tensor");
  const cuda::DeviceGuard guard(device);
  state_->use(device);
  DeviceBuffer copy(Device{Device::Kind::kCuda, device}, rounded(bytes));  // zero-filled
  assign(copy, data, bytes);
  return copy;
}

void DeviceDelta::assign(DeviceBuffer& base, const std::byte* data, size_t bytes) {
  if (base.size() != rounded(bytes))
    fail(ErrorKind::kInternal, "delta refit: a copy of {} bytes cannot hold {}", base.size(), bytes);
  if (bytes == 0) return;
  const cuda::DeviceGuard guard(base.device_index());
  state_->use(base.device_index());
  cuda::check(cudaMemcpyAsync(base.data(), data, bytes, cudaMemcpyDefault, state_->stream), "cudaMemcpyAsync",
              "delta refit: copying a tensor");
  state_->wait("copying a tensor for delta refit");
}

DeltaResult DeviceDelta::encode(DeviceBuffer& base, const std::byte* now, size_t bytes, size_t element_size,
                                std::vector<uint8_t>& out) {
  EncodeJob job{&base, now, bytes, element_size, &out, {}};
  encode_batch({&job, 1});
  return job.result;
}

void DeviceDelta::encode_batch(std::span<EncodeJob> jobs, HostCopyPool* pool) {
  if (jobs.empty()) return;
  const int device = jobs.front().base->device_index();
  for (const EncodeJob& j : jobs) {
    if (j.base->size() != rounded(j.bytes) || j.element_size == 0 || j.element_size > 8 || 8 % j.element_size != 0 ||
        j.bytes % j.element_size != 0)
      fail(ErrorKind::kInternal, "DeviceDelta::encode: a base of {} bytes, {} bytes of {}-byte elements",
           j.base->size(), j.bytes, j.element_size);
    if (j.base->device_index() != device)
      fail(ErrorKind::kInternal, "DeviceDelta::encode_batch: tensors on GPUs {} and {} in one batch", device,
           j.base->device_index());
  }
  State& s = *state_;
  const cuda::DeviceGuard guard(device);
  s.use(device);
  // Every tensor's count and hash, their blocks one tensor after another; one wait.
  std::vector<uint64_t> first_block(jobs.size() + 1, 0);
  for (size_t k = 0; k < jobs.size(); ++k) first_block[k + 1] = first_block[k] + cuda::delta_blocks(jobs[k].bytes);
  const uint64_t blocks = first_block.back();
  uint32_t* counts = s.counts.at_least(device, blocks);
  uint64_t* sums = s.sums.at_least(device, blocks);
  for (size_t k = 0; k < jobs.size(); ++k)
    s.launched(cuda::launch_delta_count(jobs[k].base->data(), jobs[k].now, jobs[k].bytes,
                                        static_cast<uint32_t>(jobs[k].element_size), counts + first_block[k],
                                        sums + first_block[k], s.stream),
               "the delta count kernel");
  s.to_host(s.host_counts, counts, blocks);
  s.to_host(s.host_sums, sums, blocks);
  s.wait("waiting for the delta count kernels");
  // Per tensor: whole (dense changes), no change, or its changes collected after the others'.
  std::vector<uint64_t> first_change(jobs.size() + 1, 0);
  std::vector<size_t> collected;
  uint64_t* host_offsets = s.host_offsets.resize(blocks);
  for (size_t k = 0; k < jobs.size(); ++k) {
    EncodeJob& j = jobs[k];
    const auto block_counts = s.host_counts.view().subspan(first_block[k], first_block[k + 1] - first_block[k]);
    const auto block_sums = s.host_sums.view().subspan(first_block[k], block_counts.size());
    const uint64_t changed = std::accumulate(block_counts.begin(), block_counts.end(), uint64_t{0});
    const uint64_t checksum =
        word_hash::finish(std::accumulate(block_sums.begin(), block_sums.end(), uint64_t{0}), j.bytes);
    const uint64_t elements = j.bytes / j.element_size;
    first_change[k + 1] = first_change[k];
    j.result = {};
    // The smallest a record of `changed` changes can be: a byte per position (or the bitmap) and
    // per value. Past the tensor's size it goes whole, without collecting anything.
    if (kDeltaHeaderBytes + std::min(changed, (elements + 7) / 8) + changed >= j.bytes) {
      if (j.bytes > 0)
        cuda::check(cudaMemcpyAsync(j.base->data(), j.now, j.bytes, cudaMemcpyDefault, s.stream), "cudaMemcpyAsync",
                    "delta refit: copying a tensor");
    } else if (changed == 0) {  // the base is the tensor already
      j.result = {encode_delta_changes(elements, j.element_size, {}, {}, {}, DeltaChecksum::kWords, checksum, *j.out),
                  checksum};
    } else {
      std::exclusive_scan(block_counts.begin(), block_counts.end(), host_offsets + first_block[k], uint64_t{0});
      first_change[k + 1] += changed;
      j.result.checksum = checksum;
      collected.push_back(k);
    }
  }
  const uint64_t changes = first_change.back();
  if (changes > 0) {
    uint64_t* offsets = s.offsets.at_least(s.device, blocks);
    s.to_device(offsets, s.host_offsets.view());
    uint64_t* index = s.index.at_least(s.device, changes);
    uint64_t* before = s.before.at_least(s.device, changes);
    uint64_t* after = s.after.at_least(s.device, changes);
    for (size_t k : collected)
      s.launched(cuda::launch_delta_collect(jobs[k].base->data(), jobs[k].now, jobs[k].bytes,
                                            static_cast<uint32_t>(jobs[k].element_size), counts + first_block[k],
                                            offsets + first_block[k], index + first_change[k], before + first_change[k],
                                            after + first_change[k], s.stream),
                 "the delta collect kernel");
    s.to_host(s.host_index, index, changes);
    s.to_host(s.host_before, before, changes);
    s.to_host(s.host_after, after, changes);
  }
  s.wait("waiting for the delta collect kernels");  // and the copies of tensors that go whole
  // The records, on the pool's threads (passes over their changes on the host), every tensor's in
  // parts together.
  std::vector<ChangesToEncode> records;
  for (size_t k : collected) {
    const EncodeJob& j = jobs[k];
    const uint64_t first = first_change[k], n = first_change[k + 1] - first;
    records.push_back({j.bytes / j.element_size, j.element_size, s.host_index.view().subspan(first, n),
                       s.host_before.view().subspan(first, n), s.host_after.view().subspan(first, n),
                       DeltaChecksum::kWords, j.result.checksum, j.out});
  }
  encode_delta_changes(records, pool != nullptr ? parts_on(*pool) : DeltaForEach{});
  for (size_t c = 0; c < collected.size(); ++c) {
    EncodeJob& j = jobs[collected[c]];
    j.result.encoded = records[c].encoded;
    if (!j.result.encoded) j.result = {};  // whole after all (the base is the tensor now)
  }
}

DeltaHeader DeviceDelta::apply(DeviceBuffer& target, size_t bytes, size_t element_size, std::span<const uint8_t> record,
                               const std::string& what, uint64_t* checksum) {
  try {
    queue_record(target, bytes, element_size, record, what);
    const Patched patched = patch_queued().front();
    *checksum = patched.checksum;
    return patched.header;
  } catch (...) {
    drop_queued();
    throw;
  }
}

size_t DeviceDelta::queue_patch(DeviceBuffer& target, size_t bytes, size_t element_size, const DeltaHeader& header) {
  if (target.size() != rounded(bytes))
    fail(ErrorKind::kInternal, "DeviceDelta::queue_patch: a copy of {} bytes for {} bytes", target.size(), bytes);
  State& s = *state_;
  if (!s.queued.empty() && s.queued.front().target->device_index() != target.device_index())
    fail(ErrorKind::kInternal, "DeviceDelta::queue_patch: patches on GPUs {} and {} in one queue",
         s.queued.front().target->device_index(), target.device_index());
  const uint64_t first = s.queued.empty() ? 0 : s.queued.back().first + s.queued.back().header.changed;
  s.host_index.resize(first + header.changed);
  s.host_after.resize(first + header.changed);
  s.queued.push_back({&target, bytes, element_size, header, first});
  return s.queued.size() - 1;
}

DeviceDelta::Changes DeviceDelta::changes_of(size_t k) {
  State& s = *state_;
  if (k >= s.queued.size()) fail(ErrorKind::kInternal, "DeviceDelta::changes_of({}) of {} queued", k, s.queued.size());
  const State::Queued& q = s.queued[k];
  return {{s.host_index.data() + q.first, q.header.changed}, {s.host_after.data() + q.first, q.header.changed}};
}

void DeviceDelta::queue_record(DeviceBuffer& target, size_t bytes, size_t element_size, std::span<const uint8_t> record,
                               const std::string& what) {
  const size_t k = queue_patch(target, bytes, element_size, read_delta_header(record, what));
  try {
    const Changes changes = changes_of(k);
    RecordToDecode r{record, element_size, bytes, changes.index, changes.values, what, {}};
    decode_delta_into({&r, 1});  // all checked first
  } catch (...) {
    State& s = *state_;  // unqueued: the page-locked arrays end where the patches before it end
    s.host_index.size = s.host_after.size = s.queued.back().first;
    s.queued.pop_back();
    throw;
  }
}

void DeviceDelta::drop_queued() {
  State& s = *state_;
  s.queued.clear();
  s.host_index.size = s.host_after.size = 0;
}

std::vector<DeviceDelta::Patched> DeviceDelta::patch_queued() {
  State& s = *state_;
  std::vector<Patched> out;
  if (s.queued.empty()) return out;
  const cuda::DeviceGuard guard(s.queued.front().target->device_index());
  s.use(s.queued.front().target->device_index());
  // Every patch's changes cross in one copy each of positions and values.
  const uint64_t count = s.queued.back().first + s.queued.back().header.changed;
  if (s.host_index.size != count || s.host_after.size != count)
    fail(ErrorKind::kInternal, "DeviceDelta::patch_queued: {} changes queued, {} and {} decoded", count,
         s.host_index.size, s.host_after.size);
  uint64_t* index = s.index.at_least(s.device, count);
  uint64_t* values = s.after.at_least(s.device, count);
  s.to_device(index, s.host_index.view());
  s.to_device(values, s.host_after.view());
  // Then each patch, and the word hash of each patched tensor whose record carries one (its blocks
  // at their own place in the counts and sums), all before one wait.
  uint64_t blocks = 0;
  std::vector<uint64_t> first_block;
  for (const auto& q : s.queued) {
    first_block.push_back(blocks);
    if (q.header.checksum_kind == DeltaChecksum::kWords) blocks += cuda::delta_blocks(q.bytes);
  }
  uint32_t* counts = s.counts.at_least(s.device, blocks);
  uint64_t* sums = s.sums.at_least(s.device, blocks);
  for (size_t k = 0; k < s.queued.size(); ++k) {
    const auto& q = s.queued[k];
    s.launched(
        cuda::launch_delta_patch(q.target->data(), static_cast<uint32_t>(q.element_size), index + q.first,
                                 values + q.first, q.header.changed, q.header.values == DeltaValues::kSteps, s.stream),
        "the delta patch kernel");
    if (q.header.checksum_kind == DeltaChecksum::kWords)
      s.launched(cuda::launch_delta_count(nullptr, q.target->data(), q.bytes, 1, counts + first_block[k],
                                          sums + first_block[k], s.stream),
                 "the hash kernel");
  }
  s.to_host(s.host_sums, sums, blocks);
  s.wait("waiting for the delta patch kernels");
  for (size_t k = 0; k < s.queued.size(); ++k) {
    const auto& q = s.queued[k];
    uint64_t checksum = 0;
    if (q.header.checksum_kind == DeltaChecksum::kWords) {
      const uint64_t* at = s.host_sums.data() + first_block[k];
      checksum = word_hash::finish(std::accumulate(at, at + cuda::delta_blocks(q.bytes), uint64_t{0}), q.bytes);
    } else {
      checksum = this->checksum(q.target->data(), q.bytes, q.header.checksum_kind);
    }
    out.push_back({q.header, checksum});
  }
  drop_queued();
  return out;
}

void DeviceDelta::read(std::span<const Range> ranges, std::span<std::span<const uint8_t>> out) {
  if (out.size() != ranges.size())
    fail(ErrorKind::kInternal, "DeviceDelta::read: {} ranges, {} places for them", ranges.size(), out.size());
  uint64_t total = 0;
  const std::byte* any = nullptr;  // a range's memory, to tell its GPU
  for (const Range& r : ranges) {
    total += r.bytes;
    if (r.bytes > 0) any = r.data;
  }
  if (total == 0) return;
  State& s = *state_;
  const int device = device_of(any, "delta refit: a record that arrived in GPU memory");
  const cuda::DeviceGuard guard(device);
  s.use(device);
  uint8_t* host = s.host_records.resize(total);
  for (size_t k = 0; k < ranges.size(); ++k) {
    if (ranges[k].bytes == 0) continue;
    // cudaMemcpyDefault: a batch's ranges may lie in a mapped buffer of another process.
    cuda::check(cudaMemcpyAsync(host, ranges[k].data, ranges[k].bytes, cudaMemcpyDefault, s.stream), "cudaMemcpyAsync",
                "delta refit: records in GPU memory to the host");
    out[k] = {host, ranges[k].bytes};
    host += ranges[k].bytes;
  }
  s.wait("waiting for the copies of records to the host");
}

uint64_t DeviceDelta::checksum(const std::byte* data, size_t bytes, DeltaChecksum kind) {
  if (kind == DeltaChecksum::kXxh3) {
    std::vector<std::byte> host(bytes);
    if (bytes > 0)
      cuda::check(cudaMemcpy(host.data(), data, bytes, cudaMemcpyDefault), "cudaMemcpy",
                  "delta refit: a GPU tensor to the host for its xxh3 checksum");
    return delta_checksum(host, kind);
  }
  if (bytes == 0) return word_hash::finish(0, 0);
  State& s = *state_;
  const int device = device_of(data, "delta refit: hashing a tensor");
  const cuda::DeviceGuard guard(device);
  s.use(device);
  s.count(nullptr, data, bytes, 1);
  s.wait("waiting for the hash kernel");
  return s.checksum(bytes);
}

#else  // no CUDA in this build: no GPU tensors reach here

struct DeviceDelta::State {};
DeviceDelta::DeviceDelta() = default;
DeviceDelta::~DeviceDelta() = default;

namespace {
[[noreturn]] void no_cuda() {
  fail(ErrorKind::kUnsupported, "delta refit of GPU tensors: this build has no CUDA support (REFIT_WITH_CUDA)");
}
}  // namespace

DeviceBuffer DeviceDelta::copy_of(const std::byte*, size_t) { no_cuda(); }
void DeviceDelta::assign(DeviceBuffer&, const std::byte*, size_t) { no_cuda(); }
DeltaResult DeviceDelta::encode(DeviceBuffer&, const std::byte*, size_t, size_t, std::vector<uint8_t>&) { no_cuda(); }
void DeviceDelta::encode_batch(std::span<EncodeJob>, HostCopyPool*) { no_cuda(); }
DeltaHeader DeviceDelta::apply(DeviceBuffer&, size_t, size_t, std::span<const uint8_t>, const std::string&, uint64_t*) {
  no_cuda();
}
void DeviceDelta::read(std::span<const Range>, std::span<std::span<const uint8_t>>) { no_cuda(); }
uint64_t DeviceDelta::checksum(const std::byte*, size_t, DeltaChecksum) { no_cuda(); }
std::vector<DeviceDelta::Patched> DeviceDelta::patch_queued() { no_cuda(); }
size_t DeviceDelta::queue_patch(DeviceBuffer&, size_t, size_t, const DeltaHeader&) { no_cuda(); }
DeviceDelta::Changes DeviceDelta::changes_of(size_t) { no_cuda(); }
void DeviceDelta::queue_record(DeviceBuffer&, size_t, size_t, std::span<const uint8_t>, const std::string&) {
  no_cuda();
}
void DeviceDelta::drop_queued() {}

#endif  // REFIT_HAVE_CUDA

}  // namespace refit
