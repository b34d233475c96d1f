// The memory layer on a GPU: detection and bad device requests, capacity, DeviceBuffer,
// pinning, and CopyStream in every direction, checked bitwise.
#include <sys/mman.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "refit/ext/device_memory.h"
#include "refit/memory.h"

namespace refit {
namespace {

using namespace gpu_test;
using namespace std::chrono_literals;

Device cuda(int index = -1) { return {Device::Kind::kCuda, index}; }

TEST(GpuDetection, FindsTheGpus) {
  REFIT_REQUIRE_GPUS(1);
  EXPECT_TRUE(cuda_built());
  std::string reason = "unchanged";
  const int count = cuda_device_count(&reason);
  EXPECT_GE(count, 1);
  EXPECT_TRUE(reason.empty()) << reason;
  EXPECT_NO_THROW(check_device(cuda()));
  for (int i = 0; i < count; ++i) EXPECT_NO_THROW(check_device(cuda(i)));
  EXPECT_EQ(resolve_cuda_device(cuda(0)), 0);
}

TEST(GpuDetection, AnOutOfRangeIndexIsAConfigErrorNamingTheRange) {
  REFIT_REQUIRE_GPUS(1);
  const int count = cuda_device_count();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { check_device(cuda(count)); }, &message), ErrorKind::kConfig);
  const std::string expected = "device cuda:" + std::to_string(count) + " requested but this machine has " +
                               std::to_string(count) + (count == 1 ? " GPU" : " GPUs") + " (indices 0.." +
                               std::to_string(count - 1) + ")";
  EXPECT_NE(message.find(expected), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] { DeviceBuffer buffer(cuda(count + 7), 1024); }), ErrorKind::kConfig);
  EXPECT_EQ(error_kind_of([&] { total_device_memory_bytes(cuda(count)); }), ErrorKind::kConfig);
  EXPECT_EQ(error_kind_of([&] {
              create_transport("CUDA_IPC", {{"device", "cuda:" + std::to_string(count)}});
            }),
            ErrorKind::kConfig);
}

TEST(GpuDetection, TotalMemoryIsTheGpusCapacity) {
  REFIT_REQUIRE_GPUS(1);
  size_t free_bytes = 0, total_bytes = 0;
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  cuda_ok(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  const uint64_t total = total_device_memory_bytes(cuda(0));
  EXPECT_GE(total, uint64_t{1} << 30);
  // cudaMemGetInfo's total may leave out memory the driver reserves; the two agree within 5%.
  EXPECT_GE(total, total_bytes);
  EXPECT_LE(total, total_bytes + total_bytes / 20);
  EXPECT_EQ(total_device_memory_bytes(cuda()), total_device_memory_bytes(cuda(resolve_cuda_device(cuda()))));
}

TEST(GpuDetection, TwoBuffersThatDoNotFitAreRefusedBeforeAllocating) {
  REFIT_REQUIRE_GPUS(1);
  const uint64_t total = total_device_memory_bytes(cuda(0));
  std::string message;
  EXPECT_EQ(error_kind_of([&] { check_buffers_fit(cuda(0), total / 2 + (1 << 20), 2); }, &message), ErrorKind::kConfig);
  EXPECT_NE(message.find("device cuda:0 has"), std::string::npos) << message;
  EXPECT_NE(message.find("2 transfer buffers"), std::string::npos) << message;
  EXPECT_NE(message.find("lower update_weights_bucket_memory_ratio or set bucket_bytes"), std::string::npos) << message;
  EXPECT_NO_THROW(check_buffers_fit(cuda(0), 64 << 20, 2));
}

TEST(DeviceBuffer, IsOneZeroedDeviceAllocation) {
  REFIT_REQUIRE_GPUS(1);
  const size_t size = (64 << 20) + 3;
  DeviceBuffer buffer(cuda(0), size);
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), size);
  EXPECT_EQ(buffer.device_index(), 0);
  EXPECT_EQ(memory_kind_of(buffer.data()), MemoryKind::kCuda);
  std::vector<uint8_t> back = read_device(buffer.data(), size);
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](uint8_t b) { return b == 0; }));
  fill_device(buffer.data(), size, 5);
  DeviceBuffer moved = std::move(buffer);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(read_device(moved.data(), size), pattern(size, 5));
  DeviceBuffer empty(cuda(0), 0);
  EXPECT_EQ(empty.data(), nullptr);
}

TEST(DeviceBuffer, TooLargeAnAllocationIsAClearError) {
  REFIT_REQUIRE_GPUS(1);
  const uint64_t total = total_device_memory_bytes(cuda(0));
  std::string message;
  EXPECT_EQ(error_kind_of([&] { DeviceBuffer buffer(cuda(0), total * 2); }, &message), ErrorKind::kTransport);
  EXPECT_NE(message.find("cannot allocate"), std::string::npos) << message;
  EXPECT_NE(message.find("on cuda:0"), std::string::npos) << message;
  EXPECT_NE(message.find("cudaMalloc"), std::string::npos) << message;
  // The failure is not sticky: the next allocation works.
  DeviceBuffer after(cuda(0), 1 << 20);
  EXPECT_NE(after.data(), nullptr);
}

TEST(HostPin, PinsAndUnpinsHostMemory) {
  REFIT_REQUIRE_GPUS(1);
  HostBuffer host(32 << 20);
  {
    HostPin pin = HostPin::pin(host.data(), host.size());
    ASSERT_TRUE(pin.pinned()) << pin.reason();
    unsigned int flags = 0;
    EXPECT_EQ(cudaHostGetFlags(&flags, host.data()), cudaSuccess);
    HostPin moved = std::move(pin);
    EXPECT_TRUE(moved.pinned());
    EXPECT_FALSE(pin.pinned());
  }
  // Unpinned again: pinning twice works.
  HostPin again = HostPin::pin(host.data(), host.size());
  EXPECT_TRUE(again.pinned());
  // Memory the driver cannot page-lock (no access) is an error naming the call.
  void* no_access = mmap(nullptr, 1 << 20, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(no_access, MAP_FAILED);
  std::string message;
  EXPECT_EQ(error_kind_of([&] { pin_host_memory(no_access, 1 << 20); }, &message), ErrorKind::kTransport);
  EXPECT_NE(message.find("cudaHostRegister"), std::string::npos) << message;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  munmap(no_access, 1 << 20);
}

class CopyStreamDirections : public ::testing::TestWithParam<bool> {};  // param: pinned host memory

TEST_P(CopyStreamDirections, CopiesEveryDirectionBitwise) {
  REFIT_REQUIRE_GPUS(1);
  const size_t size = (48 << 20) + 5;
  HostBuffer source(size), back(size);
  std::vector<uint8_t> expected = pattern(size, 11);
  std::memcpy(source.data(), expected.data(), size);
  HostPin pin_source, pin_back;
  if (GetParam()) {
    pin_source = HostPin::pin(source.data(), size);
    pin_back = HostPin::pin(back.data(), size);
    ASSERT_TRUE(pin_source.pinned() && pin_back.pinned());
  }
  DeviceBuffer a(cuda(0), size), b(cuda(0), size);
  CopyStream stream(cuda(0));
  // In chunks, as packing does: host -> device, device -> device, device -> host.
  const size_t chunk = 7 << 20;
  for (size_t off = 0; off < size; off += chunk) {
    size_t n = std::min(chunk, size - off);
    stream.copy(a.data() + off, source.data() + off, n, MemoryKind::kCuda, MemoryKind::kHost);
  }
  EXPECT_TRUE(stream.pending());
  EXPECT_NE(stream.cuda_stream(), nullptr);
  stream.copy(b.data(), a.data(), size, MemoryKind::kCuda, MemoryKind::kCuda);
  stream.copy(back.data(), b.data(), size, MemoryKind::kHost, MemoryKind::kCuda);
  stream.synchronize(deadline_after(60s));
  EXPECT_FALSE(stream.pending());
  EXPECT_EQ(std::memcmp(back.data(), expected.data(), size), 0);
}

INSTANTIATE_TEST_SUITE_P(Host, CopyStreamDirections, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Pinned" : "Pageable"; });

TEST(CopyStream, AHostCopyWaitsForGpuCopiesOfItsMemory) {
  REFIT_REQUIRE_GPUS(1);
  const size_t size = 64 << 20;
  HostBuffer a(size), b(size), c(size);
  HostPin pa = HostPin::pin(a.data(), size), pb = HostPin::pin(b.data(), size);
  std::vector<uint8_t> expected = pattern(size, 3);
  std::memcpy(a.data(), expected.data(), size);
  DeviceBuffer d(cuda(0), size);
  CopyStream stream(cuda(0));
  stream.copy(d.data(), a.data(), size, MemoryKind::kCuda, MemoryKind::kHost);
  stream.copy(b.data(), d.data(), size, MemoryKind::kHost, MemoryKind::kCuda);
  // Reads b, which the GPU copy above writes: it must see the finished bytes.
  stream.copy(c.data(), b.data(), size, MemoryKind::kHost, MemoryKind::kHost);
  EXPECT_EQ(std::memcmp(c.data(), expected.data(), size), 0);
  stream.synchronize(deadline_after(60s));
}

TEST(CopyStream, GathersAStridedSliceFromGpuMemory) {
  REFIT_REQUIRE_GPUS(1);
  // narrow(dim=1, start=3, len=5) of a [64, 16, 1000] uint8 tensor on the GPU, into a host buffer.
  const size_t outer = 64, dim = 16, inner = 1000, start = 3, len = 5;
  const size_t size = outer * dim * inner;
  DeviceBuffer tensor(cuda(0), size);
  fill_device(tensor.data(), size, 17);
  std::vector<uint8_t> all = pattern(size, 17);
  std::vector<uint8_t> expected;
  for (size_t a = 0; a < outer; ++a)
    expected.insert(expected.end(), all.begin() + static_cast<std::ptrdiff_t>((a * dim + start) * inner),
                    all.begin() + static_cast<std::ptrdiff_t>((a * dim + start + len) * inner));
  std::vector<uint8_t> host(expected.size());
  DeviceBuffer device_slice(cuda(0), expected.size());
  CopyStream stream(cuda(0));
  stream.copy_2d(host.data(), len * inner, tensor.data() + start * inner, dim * inner, len * inner, outer,
                 MemoryKind::kHost, MemoryKind::kCuda);
  stream.copy_2d(device_slice.data(), len * inner, tensor.data() + start * inner, dim * inner, len * inner, outer,
                 MemoryKind::kCuda, MemoryKind::kCuda);
  stream.synchronize(deadline_after(60s));
  EXPECT_EQ(host, expected);
  EXPECT_EQ(read_device(device_slice.data(), expected.size()), expected);
}

// A source packing a bucket: strided slices of every row length (1 byte to longer than a kernel
// chunk), pitch and alignment, one after another into one buffer, with a copy that reads what an
// earlier one wrote (it must see the written bytes) and a host copy among them.
TEST(CopyStream, GathersManyStridedSlicesOnTheGpuBitwise) {
  REFIT_REQUIRE_GPUS(1);
  struct Slice {
    size_t src = 0, pitch = 0, row_bytes = 0, rows = 0, dst = 0;
  };
  const std::vector<size_t> row_lengths = {1, 2, 3, 6, 16, 48, 250, 1536, 4096, 32768, 32769, 65536, 200000};
  std::vector<Slice> slices;
  size_t src_total = 0, dst_total = 0;
  for (size_t i = 0; i < 260; ++i) {
    const size_t row = row_lengths[i % row_lengths.size()];
    const size_t rows = row > 60000 ? 1 + i % 3 : 1 + (i * 7) % 97;
    const size_t pitch = row + (i % 4 == 0 ? 0 : 1 + i % 33);  // some contiguous, most strided
    slices.push_back({src_total + i % 3, pitch, row, rows, dst_total + i % 2});
    src_total += pitch * rows + 8;
    dst_total += row * rows + 8;
  }
  DeviceBuffer src(cuda(0), src_total), dst(cuda(0), dst_total), again(cuda(0), dst_total);
  fill_device(src.data(), src_total, 31);
  const std::vector<uint8_t> from = pattern(src_total, 31);
  CopyStream stream(cuda(0));
  std::vector<uint8_t> host_rows(slices[5].row_bytes * slices[5].rows);
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& x = slices[i];
    stream.copy_2d(dst.data() + x.dst, x.row_bytes, src.data() + x.src, x.pitch, x.row_bytes, x.rows, MemoryKind::kCuda,
                   MemoryKind::kCuda);
    if (i == 5)  // with a host side: cudaMemcpy2DAsync, in order with the grouped copies
      stream.copy_2d(host_rows.data(), x.row_bytes, src.data() + x.src, x.pitch, x.row_bytes, x.rows, MemoryKind::kHost,
                     MemoryKind::kCuda);
  }
  // Reads what the copies above wrote: ordered after them although it is grouped too.
  stream.copy_2d(again.data(), dst_total, dst.data(), dst_total, dst_total, 1, MemoryKind::kCuda, MemoryKind::kCuda);
  EXPECT_TRUE(stream.pending());
  stream.synchronize(deadline_after(60s));
  const std::vector<uint8_t> to = read_device(dst.data(), dst_total);
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& x = slices[i];
    for (size_t r = 0; r < x.rows; ++r)
      ASSERT_EQ(std::memcmp(to.data() + x.dst + r * x.row_bytes, from.data() + x.src + r * x.pitch, x.row_bytes), 0)
          << "slice " << i << " (rows of " << x.row_bytes << " bytes, pitch " << x.pitch << "), row " << r;
  }
  EXPECT_EQ(read_device(again.data(), dst_total), to);
  for (size_t r = 0; r < slices[5].rows; ++r)
    ASSERT_EQ(std::memcmp(host_rows.data() + r * slices[5].row_bytes, from.data() + slices[5].src + r * slices[5].pitch,
                          slices[5].row_bytes),
              0);
}

TEST(CopyStream, CopiesAcrossGpus) {
  REFIT_REQUIRE_GPUS(2);
  const size_t size = 32 << 20;
  DeviceBuffer a(cuda(0), size), b(cuda(1), size);
  fill_device(a.data(), size, 21);
  CopyStream stream(cuda(1));
  stream.copy(b.data(), a.data(), size, MemoryKind::kCuda, MemoryKind::kCuda);
  stream.synchronize(deadline_after(60s));
  EXPECT_EQ(read_device(b.data(), size), pattern(size, 21));
}

// A loader's batch: hundreds of GPU ranges of every size and alignment (empty, odd, larger than a
// kernel chunk, larger than a launch's share), and host ones among them, copied at once.
TEST(CopyStream, CopiesABatchOfGpuRangesBitwise) {
  REFIT_REQUIRE_GPUS(1);
  std::vector<size_t> sizes = {0, 1, 7, 16, 255, 4096, 65536, 65537, 3 << 20, (64 << 20) + 100};
  for (int i = 0; i < 300; ++i) sizes.push_back(static_cast<size_t>(i * 37 % 1000) + 1);
  constexpr size_t kHostBytes = 4096;
  struct Placed {
    size_t src = 0, dst = 0, bytes = 0;
  };
  std::vector<Placed> placed;
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    // Some start off any alignment, on either side.
    placed.push_back({total + i % 5, total + (i % 3 == 0 ? 0 : i % 17), sizes[i]});
    total += sizes[i] + 64;
  }
  DeviceBuffer src(cuda(0), total);
  fill_device(src.data(), total, 5);
  DeviceBuffer dst(cuda(0), total + kHostBytes);
  std::vector<uint8_t> host_dst(kHostBytes);
  const std::vector<uint8_t> host_src = pattern(kHostBytes, 6);
  CopyStream stream(cuda(0));
  for (const Placed& p : placed)
    stream.copy(dst.data() + p.dst, src.data() + p.src, p.bytes, MemoryKind::kCuda, MemoryKind::kCuda);
  stream.copy(host_dst.data(), src.data(), kHostBytes, MemoryKind::kHost, MemoryKind::kCuda);
  stream.copy(dst.data() + total, host_src.data(), kHostBytes, MemoryKind::kCuda, MemoryKind::kHost);
  stream.synchronize(deadline_after(60s));
  const std::vector<uint8_t> from = read_device(src.data(), total), to = read_device(dst.data(), total + kHostBytes);
  for (size_t i = 0; i < placed.size(); ++i)
    ASSERT_EQ(std::memcmp(to.data() + placed[i].dst, from.data() + placed[i].src, placed[i].bytes), 0)
        << "copy " << i << " of " << placed[i].bytes << " bytes";
  EXPECT_EQ(host_dst, std::vector<uint8_t>(from.begin(), from.begin() + kHostBytes));
  EXPECT_EQ(std::vector<uint8_t>(to.begin() + total, to.end()), host_src);
}

}  // namespace
}  // namespace refit
