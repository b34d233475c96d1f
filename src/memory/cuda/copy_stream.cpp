// CopyStream: host-to-host copies with memcpy at once; copies with a GPU side on one non-blocking
// stream, created on first use: between GPU memory grouped into batch-copy kernels, else
// cudaMemcpy(2D)Async.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/fail.h"
#include "memory/cuda/batch_copy.h"
#include "memory/cuda/cuda_util.h"
#include "memory/host_copy_pool.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"

namespace refit {
namespace {

// What a copy issued inside copy() may wait for when it must order itself after GPU copies.
constexpr auto kImplicitSyncTimeout = std::chrono::seconds(300);
// How long the destructor waits for copies still in flight before it lets them go.
constexpr auto kDestroyTimeout = std::chrono::seconds(60);
// Beyond this many tracked ranges, they collapse into one bounding range (conservative).
constexpr size_t kMaxRanges = 1024;

struct Range {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  bool overlaps(const Range& other) const { return begin < other.end && other.begin < end; }
};

Range range_of(const void* p, size_t bytes) {
  auto begin = reinterpret_cast<uintptr_t>(p);
  return {begin, begin + bytes};
}

// Memory touched by GPU copies issued since the last synchronize().
class RangeSet {
 public:
  void add(Range r) {
    if (r.begin == r.end) return;
    ranges_.push_back(r);
    if (ranges_.size() > kMaxRanges) {
      Range all = ranges_.front();
      for (const Range& x : ranges_) {
        all.begin = std::min(all.begin, x.begin);
        all.end = std::max(all.end, x.end);
      }
      ranges_.assign(1, all);
    }
  }
  bool overlaps(Range r) const {
    if (r.begin == r.end) return false;
    return std::any_of(ranges_.begin(), ranges_.end(), [&](const Range& x) { return x.overlaps(r); });
  }
  void clear() { ranges_.clear(); }

 private:
  std::vector<Range> ranges_;
};

}  // namespace

struct CopyStream::Impl {
  Device device;
  RangeSet reads;   // sources of GPU copies in flight
  RangeSet writes;  // destinations of GPU copies in flight
  bool pending = false;
  std::unique_ptr<HostCopyPool> host_copies;  // made on the first large host-to-host copy

  void host_copy(void* dst, const void* src, size_t bytes) {
    if (bytes < HostCopyPool::kMinParallelBytes) {
      std::memcpy(dst, src, bytes);
      return;
    }
    if (!host_copies) host_copies = std::make_unique<HostCopyPool>();
    host_copies->copy(dst, src, bytes);
  }
#ifdef REFIT_HAVE_CUDA
  int cuda_device = -1;
  cudaStream_t stream = nullptr;

  void create_stream() {
    std::string reason;
    if (cuda_device_count(&reason) == 0)
      fail(ErrorKind::kUnsupported, "copying GPU memory needs CUDA, which is not available: {}", reason);
    if (device.kind == Device::Kind::kCuda && device.index >= 0) {
      check_device(device);
      cuda_device = device.index;
    } else {
      cuda::check(cudaGetDevice(&cuda_device), "cudaGetDevice", "creating a copy stream");
    }
    cuda::DeviceGuard guard(cuda_device);
    cuda::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                fmt::format("creating a copy stream on cuda:{}", cuda_device));
  }
#endif

  void synchronize(Deadline deadline) {
    if (!pending) return;
#ifdef REFIT_HAVE_CUDA
    launch_group();
    cuda::DeviceGuard guard(cuda_device);
    cuda::wait_stream(stream, deadline, "waiting for GPU copies of the copy stream");
#endif
    pending = false;
    reads.clear();
    writes.clear();
  }

  // A host-to-host copy runs at once; it must wait for GPU copies in flight that touch its memory.
  void order_host_copy(Range dst, Range src) {
    if (pending && (writes.overlaps(dst) || reads.overlaps(dst) || writes.overlaps(src)))
      synchronize(deadline_after(kImplicitSyncTimeout));
  }

#ifdef REFIT_HAVE_CUDA
  // Enqueues a GPU copy: `issue(stream)` returns the cudaMemcpy*Async status; `call` and `what()`
  // name it in errors (made only then: a loader issues a copy per tensor).
  template <typename What, typename Issue>
  void enqueue(Range dst, Range src, std::string_view call, What&& what, Issue&& issue) {
    launch_group();  // copies grouped before this one go first
    if (stream == nullptr) create_stream();
    cuda::DeviceGuard guard(cuda_device);
    const cudaError_t status = issue(stream);
    if (status != cudaSuccess) cuda::check(status, call, what());
    pending = true;
    reads.add(src);
    writes.add(dst);
  }

  // Copies between GPU memory wait here and go as one kernel (launch_group) when the group is
  // full, before any other copy, or at synchronize(): a source packing a hundred strided slices
  // into a bucket launches once instead of a cudaMemcpy2DAsync per slice.
  std::array<cuda::BatchCopy, cuda::kMaxBatchCopies> group;
  size_t grouped = 0;
  RangeSet group_reads, group_writes;

  void add_to_group(const cuda::BatchCopy& c) {
    if (stream == nullptr) create_stream();  // where CUDA is not usable, the copy fails now
    const Range dst = range_of(c.dst, (c.rows - 1) * c.dst_pitch + c.row_bytes);
    const Range src = range_of(c.src, (c.rows - 1) * c.src_pitch + c.row_bytes);
    // One kernel runs its copies in no order: one that depends on another waits for the next launch.
    if (group_writes.overlaps(src) || group_writes.overlaps(dst) || group_reads.overlaps(dst)) launch_group();
    group[grouped++] = c;
    group_reads.add(src);
    group_writes.add(dst);
    pending = true;
    reads.add(src);
    writes.add(dst);
    if (grouped == group.size()) launch_group();
  }

  void launch_group() {
    if (grouped == 0) return;
    const size_t count = grouped;
    grouped = 0;
    group_reads.clear();
    group_writes.clear();
    if (stream == nullptr) create_stream();
    cuda::DeviceGuard guard(cuda_device);
    const auto status = static_cast<cudaError_t>(cuda::launch_batch_copy(group.data(), count, stream));
    if (status != cudaSuccess)
      cuda::check(status, "a batch copy kernel",
                  fmt::format("copying {} GPU ranges at once, the first {} rows of {} bytes to {}", count,
                              group[0].rows, group[0].row_bytes, group[0].dst));
  }
#else
  [[noreturn]] static void no_cuda() {
    fail(ErrorKind::kUnsupported,
         "copying GPU memory needs CUDA: this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON");
  }
#endif
};

CopyStream::CopyStream(Device device) : impl_(std::make_unique<Impl>()) { impl_->device = device; }

CopyStream::~CopyStream() {
#ifdef REFIT_HAVE_CUDA
  if (impl_->stream != nullptr) {
    try {
      if (impl_->pending) synchronize(deadline_after(kDestroyTimeout));
    } catch (const std::exception&) {
      // Destroying the stream below lets the driver finish (or drop) what is left.
    }
    cudaStreamDestroy(impl_->stream);
    cudaGetLastError();
  }
#endif
}

bool CopyStream::pending() const { return impl_->pending; }

void* CopyStream::cuda_stream() const {
#ifdef REFIT_HAVE_CUDA
  impl_->launch_group();  // what the caller enqueues next comes after every copy issued so far
  return impl_->stream;
#else
  return nullptr;
#endif
}

void CopyStream::copy(void* dst, const void* src, size_t bytes, MemoryKind dst_kind, MemoryKind src_kind) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr)
    fail(ErrorKind::kInvalidArgument, "copy of {} bytes with a null {} pointer", bytes,
         dst == nullptr ? "destination" : "source");
  const Range d = range_of(dst, bytes);
  const Range s = range_of(src, bytes);
  if (dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost) {
    impl_->order_host_copy(d, s);
    impl_->host_copy(dst, src, bytes);
    return;
  }
#ifdef REFIT_HAVE_CUDA
  // Between GPU memory, the copy joins the group (one kernel per ~100 copies, as copy_2d's): a
  // destination merging 1,683 FSDP pieces of a bucket spent 12 ms in a launch per piece.
  if (dst_kind == MemoryKind::kCuda && src_kind == MemoryKind::kCuda)
    return impl_->add_to_group({dst, src, bytes, 1, bytes, bytes});
  impl_->enqueue(
      d, s, "cudaMemcpyAsync", [&] { return fmt::format("copying {} bytes from {} to {}", bytes, src, dst); },
      [&](cudaStream_t stream) { return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream); });
#else
  Impl::no_cuda();
#endif
}

void CopyStream::copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes, size_t rows,
                         MemoryKind dst_kind, MemoryKind src_kind) {
  if (rows == 0 || row_bytes == 0) return;
  if (rows == 1 || (dst_pitch == row_bytes && src_pitch == row_bytes))  // one contiguous range
    return copy(dst, src, rows * row_bytes, dst_kind, src_kind);
  if (dst == nullptr || src == nullptr)
    fail(ErrorKind::kInvalidArgument, "2-D copy of {} rows with a null {} pointer", rows,
         dst == nullptr ? "destination" : "source");
  if (dst_pitch < row_bytes || src_pitch < row_bytes)
    fail(ErrorKind::kInvalidArgument, "2-D copy of rows of {} bytes with pitches {} (destination) and {} (source)",
         row_bytes, dst_pitch, src_pitch);
  // The bounding ranges: conservative for the hazard checks.
  const Range d = range_of(dst, (rows - 1) * dst_pitch + row_bytes);
  const Range s = range_of(src, (rows - 1) * src_pitch + row_bytes);
  if (dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost) {
    impl_->order_host_copy(d, s);
    auto* out = static_cast<std::byte*>(dst);
    const auto* in = static_cast<const std::byte*>(src);
    for (size_t r = 0; r < rows; ++r) std::memcpy(out + r * dst_pitch, in + r * src_pitch, row_bytes);
    return;
  }
#ifdef REFIT_HAVE_CUDA
  if (dst_kind == MemoryKind::kCuda && src_kind == MemoryKind::kCuda)
    return impl_->add_to_group({dst, src, row_bytes, rows, dst_pitch, src_pitch});
  impl_->enqueue(
      d, s, "cudaMemcpy2DAsync",
      [&] { return fmt::format("copying {} rows of {} bytes from {} to {}", rows, row_bytes, src, dst); },
      [&](cudaStream_t stream) {
        return cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDefault, stream);
      });
#else
  Impl::no_cuda();
#endif
}

void CopyStream::synchronize(Deadline deadline) { impl_->synchronize(deadline); }

}  // namespace refit
