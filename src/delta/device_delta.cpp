#include "delta/device_delta.h"

#include "core/fail.h"
#include "delta/bits.h"

#ifdef REFIT_HAVE_CUDA
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
  T* resize(uint64_t count) {
    if (count * sizeof(T) > memory.size())
      memory = TensorMemory(MemoryKind::kHost, Device{}, std::max<uint64_t>(count, 2 * size) * sizeof(T), /*pin=*/true);
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
  // Patches queued (queue_patch): their changes one after another in queued_index/values.
  struct Queued {
    DeviceBuffer* target;
    size_t bytes;
    size_t element_size;
    DeltaHeader header;
    uint64_t first;  // of its changes in queued_index
    uint64_t count;
  };
  std::vector<Queued> queued;
  std::vector<uint64_t> queued_index, queued_values;
  DeltaChanges changes;  // the record being decoded

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
  if (base.size() != rounded(bytes) || element_size == 0 || element_size > 8 || 8 % element_size != 0 ||
      bytes % element_size != 0)
    fail(ErrorKind::kInternal, "DeviceDelta::encode: a base of {} bytes, {} bytes of {}-byte elements", base.size(),
         bytes, element_size);
  State& s = *state_;
  const cuda::DeviceGuard guard(base.device_index());
  s.use(base.device_index());
  const uint64_t elements = bytes / element_size;
  s.count(base.data(), now, bytes, element_size);
  s.wait("waiting for the delta count kernel");
  const uint64_t changed = s.changed(), checksum = s.checksum(bytes);
  // The smallest a record of `changed` changes can be: a byte per position (or the bitmap) and
  // per value. Past the tensor's size it goes whole, without collecting anything.
  if (kDeltaHeaderBytes + std::min(changed, (elements + 7) / 8) + changed >= bytes) {
    assign(base, now, bytes);
    return {};
  }
  if (changed == 0)  // the base is the tensor already
    return {encode_delta_changes(elements, element_size, {}, {}, {}, DeltaChecksum::kWords, checksum, out), checksum};
  const uint64_t blocks = s.host_counts.size;
  const auto counted = s.host_counts.view();
  std::exclusive_scan(counted.begin(), counted.end(), s.host_offsets.resize(blocks), uint64_t{0});
  uint64_t* offsets = s.offsets.at_least(s.device, blocks);
  s.to_device(offsets, s.host_offsets.view());
  uint64_t* index = s.index.at_least(s.device, changed);
  uint64_t* before = s.before.at_least(s.device, changed);
  uint64_t* after = s.after.at_least(s.device, changed);
  s.launched(cuda::launch_delta_collect(base.data(), now, bytes, static_cast<uint32_t>(element_size),
                                        s.counts.at_least(s.device, blocks), offsets, index, before, after, s.stream),
             "the delta collect kernel");
  s.to_host(s.host_index, index, changed);
  s.to_host(s.host_before, before, changed);
  s.to_host(s.host_after, after, changed);
  s.wait("waiting for the delta collect kernel");
  if (!encode_delta_changes(elements, element_size, s.host_index.view(), s.host_before.view(), s.host_after.view(),
                            DeltaChecksum::kWords, checksum, out))
    return {};
  return {true, checksum};
}

DeltaHeader DeviceDelta::apply(DeviceBuffer& target, size_t bytes, size_t element_size, std::span<const uint8_t> record,
                               const std::string& what, uint64_t* checksum) {
  try {
    queue_patch(target, bytes, element_size, record, what);
    const Patched patched = patch_queued().front();
    *checksum = patched.checksum;
    return patched.header;
  } catch (...) {
    drop_queued();
    throw;
  }
}

void DeviceDelta::queue_patch(DeviceBuffer& target, size_t bytes, size_t element_size, std::span<const uint8_t> record,
                              const std::string& what) {
  if (target.size() != rounded(bytes))
    fail(ErrorKind::kInternal, "DeviceDelta::queue_patch: a copy of {} bytes for {} bytes", target.size(), bytes);
  State& s = *state_;
  if (!s.queued.empty() && s.queued.front().target->device_index() != target.device_index())
    fail(ErrorKind::kInternal, "DeviceDelta::queue_patch: patches on GPUs {} and {} in one queue",
         s.queued.front().target->device_index(), target.device_index());
  decode_delta(record, element_size, bytes, s.changes, what);  // all of it checked before any write
  s.queued.push_back({&target, bytes, element_size, s.changes.header, s.queued_index.size(), s.changes.index.size()});
  s.queued_index.insert(s.queued_index.end(), s.changes.index.begin(), s.changes.index.end());
  s.queued_values.insert(s.queued_values.end(), s.changes.values.begin(), s.changes.values.end());
}

void DeviceDelta::drop_queued() {
  State& s = *state_;
  s.queued.clear();
  s.queued_index.clear();
  s.queued_values.clear();
}

std::vector<DeviceDelta::Patched> DeviceDelta::patch_queued() {
  State& s = *state_;
  std::vector<Patched> out;
  if (s.queued.empty()) return out;
  const cuda::DeviceGuard guard(s.queued.front().target->device_index());
  s.use(s.queued.front().target->device_index());
  // Every patch's changes cross in one copy each of positions and values.
  const uint64_t count = s.queued_index.size();
  std::copy(s.queued_index.begin(), s.queued_index.end(), s.host_index.resize(count));
  std::copy(s.queued_values.begin(), s.queued_values.end(), s.host_after.resize(count));
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
    s.launched(cuda::launch_delta_patch(q.target->data(), static_cast<uint32_t>(q.element_size), index + q.first,
                                        values + q.first, q.count, q.header.values == DeltaValues::kSteps, s.stream),
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

void DeviceDelta::read(const std::byte* data, size_t bytes, std::vector<uint8_t>& out) {
  out.resize(bytes);
  if (bytes > 0)
    cuda::check(cudaMemcpy(out.data(), data, bytes, cudaMemcpyDefault), "cudaMemcpy",
                "delta refit: a record in GPU memory to the host");
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
DeltaHeader DeviceDelta::apply(DeviceBuffer&, size_t, size_t, std::span<const uint8_t>, const std::string&, uint64_t*) {
  no_cuda();
}
void DeviceDelta::read(const std::byte*, size_t, std::vector<uint8_t>&) { no_cuda(); }
uint64_t DeviceDelta::checksum(const std::byte*, size_t, DeltaChecksum) { no_cuda(); }
void DeviceDelta::queue_patch(DeviceBuffer&, size_t, size_t, std::span<const uint8_t>, const std::string&) {
  no_cuda();
}
std::vector<DeviceDelta::Patched> DeviceDelta::patch_queued() { no_cuda(); }
void DeviceDelta::drop_queued() {}

#endif  // REFIT_HAVE_CUDA

}  // namespace refit
