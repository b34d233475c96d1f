// Delta refit of tensors in GPU memory: the kernels' diff, compaction, hash and patch against the
// host's encoder (the same record but for the checksum's kind), every byte checked.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "delta/codec.h"
#include "delta/device_delta.h"
#include "delta/link_delta.h"
#include "gpu_test_util.h"
#include "memory/host_copy_pool.h"
#include "refit/ext/device_memory.h"

namespace refit::gpu_test {
namespace {

const Device kGpu{Device::Kind::kCuda, 0};

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

// `count` changes of elements drawn at random: most step by a unit in the last place, some get
// any other bits.
std::vector<std::byte> changed(std::vector<std::byte> v, size_t element_size, size_t count, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const size_t elements = v.size() / element_size;
  for (size_t k = 0; k < count; ++k) {
    std::byte* e = v.data() + (rng() % elements) * element_size;
    if (k % 5 == 0)
      e[rng() % element_size] ^= static_cast<std::byte>(1 + rng() % 255);
    else
      e[0] = static_cast<std::byte>(static_cast<uint8_t>(e[0]) + 1);
  }
  return v;
}

// `bytes` at `offset` bytes into a fresh GPU buffer (an offset makes the words unaligned).
struct OnGpu {
  DeviceBuffer buffer;
  std::byte* data = nullptr;
  OnGpu(const std::vector<std::byte>& bytes, size_t offset) : buffer(kGpu, bytes.size() + offset + 8) {
    data = buffer.data() + offset;
    cuda_ok(cudaMemcpy(data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
};

std::vector<std::byte> download(const std::byte* data, size_t bytes) {
  std::vector<std::byte> out(bytes);
  cuda_ok(cudaMemcpy(out.data(), data, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return out;
}

TEST(DeviceDelta, RecordsAreTheHostsAndApplyBitwiseOnEitherSide) {
  REFIT_REQUIRE_GPUS(1);
  DeviceDelta gpu;
  for (size_t element_size : {1, 2, 4, 8}) {
    // Several kernel blocks (16 KiB each), a size that is not a whole number of words.
    const size_t elements = 300007 / element_size;
    const auto old = random_bytes(elements * element_size, 1);
    const OnGpu old_gpu(old, 0);
    for (size_t count : {size_t{0}, size_t{1}, size_t{2000}, elements / 20}) {
      const auto now = changed(old, element_size, count, 2);
      const OnGpu now_gpu(now, element_size);  // unaligned unless 8-byte elements
      SCOPED_TRACE(::testing::Message() << element_size << "-byte elements, " << count << " changes");

      DeviceBuffer base = gpu.copy_of(old_gpu.data, old.size());
      std::vector<uint8_t> record;
      const DeltaResult result = gpu.encode(base, now_gpu.data, now.size(), element_size, record);
      ASSERT_TRUE(result.encoded);
      EXPECT_EQ(download(base.data(), now.size()), now) << "the base follows the tensor";
      EXPECT_EQ(result.checksum, delta_checksum(now, DeltaChecksum::kWords));

      std::vector<std::byte> host_base = old;
      std::vector<uint8_t> host;
      ASSERT_TRUE(encode_delta(host_base, now, element_size, host).encoded);
      ASSERT_EQ(record.size(), host.size());
      for (size_t b = 0; b < record.size(); ++b) {
        if (b == 7 || (b >= 24 && b < 32)) continue;  // checksum kind and value
        ASSERT_EQ(record[b], host[b]) << "byte " << b;
      }

      DeviceBuffer target = gpu.copy_of(old_gpu.data, old.size());
      uint64_t patched = 0;
      const DeltaHeader h = gpu.apply(target, now.size(), element_size, record, "record", &patched);
      EXPECT_EQ(download(target.data(), now.size()), now) << "patched on the GPU";
      EXPECT_EQ(patched, h.checksum) << "the checksum of the patched tensor, with the patch";
      EXPECT_EQ(gpu.checksum(target.data(), now.size(), h.checksum_kind), h.checksum);
      EXPECT_EQ(gpu.checksum(target.data(), now.size(), DeltaChecksum::kXxh3), delta_checksum(now));

      std::vector<std::byte> on_host = old;
      apply_delta(on_host, element_size, record, "record");
      EXPECT_EQ(on_host, now) << "a GPU record patches host memory too";
      // A host record patches GPU memory.
      DeviceBuffer from_host = gpu.copy_of(old_gpu.data, old.size());
      const DeltaHeader xxh3 = gpu.apply(from_host, now.size(), element_size, host, "host record", &patched);
      EXPECT_EQ(download(from_host.data(), now.size()), now);
      EXPECT_EQ(patched, xxh3.checksum) << "a host record's checksum (xxh3) of the patched tensor";
    }
  }
}

TEST(DeviceDelta, ATensorThatChangedEverywhereGoesWholeAndTheBaseFollows) {
  REFIT_REQUIRE_GPUS(1);
  DeviceDelta gpu;
  const auto old = random_bytes(1 << 20, 3), now = random_bytes(1 << 20, 4);
  const OnGpu old_gpu(old, 0), now_gpu(now, 0);
  // 2-byte elements: collected, then the record is found larger than the tensor; 1-byte elements:
  // refused before anything is collected. Either way the base follows.
  for (size_t element_size : {2, 1}) {
    DeviceBuffer base = gpu.copy_of(old_gpu.data, old.size());
    std::vector<uint8_t> record{1, 2, 3};
    EXPECT_FALSE(gpu.encode(base, now_gpu.data, now.size(), element_size, record).encoded);
    EXPECT_EQ(record, (std::vector<uint8_t>{1, 2, 3}));
    EXPECT_EQ(download(base.data(), now.size()), now);
  }
}

TEST(DeviceDelta, AMalformedRecordWritesNothing) {
  REFIT_REQUIRE_GPUS(1);
  DeviceDelta gpu;
  const auto old = random_bytes(4096, 6);
  const auto now = changed(old, 2, 50, 7);
  const OnGpu old_gpu(old, 0), now_gpu(now, 0);
  DeviceBuffer base = gpu.copy_of(old_gpu.data, old.size());
  std::vector<uint8_t> record;
  ASSERT_TRUE(gpu.encode(base, now_gpu.data, now.size(), 2, record).encoded);
  record.push_back(0);
  DeviceBuffer target = gpu.copy_of(old_gpu.data, old.size());
  try {
    uint64_t patched = 0;
    gpu.apply(target, old.size(), 2, record, "changes to 'w' from source rank 0", &patched);
    FAIL() << "applied a record with a byte past its values";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    EXPECT_NE(std::string(e.what()).find("changes to 'w' from source rank 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(download(target.data(), old.size()), old);
}

// A destination's batch: patches queued for several tensors cross to the GPU and are checked in
// one go, each with its own record's checksum; a malformed record in a batch leaves nothing
// queued once the batch is dropped, and writes nothing.
TEST(DeviceDelta, QueuedPatchesApplyTogetherEachWithItsChecksum) {
  REFIT_REQUIRE_GPUS(1);
  DeviceDelta gpu;
  struct Case {
    size_t element_size, bytes, changes;
  };
  const std::vector<Case> cases = {{2, 1 << 20, 3000}, {4, 300004, 0}, {1, 70001, 500}, {8, 1 << 16, 40}};
  std::vector<std::vector<std::byte>> olds, nows;
  std::vector<DeviceBuffer> targets;
  std::vector<std::vector<uint8_t>> records;
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    olds.push_back(random_bytes(c.bytes, 10 + k));
    nows.push_back(changed(olds.back(), c.element_size, c.changes, 20 + k));
    const OnGpu old_gpu(olds.back(), 0), now_gpu(nows.back(), 0);
    DeviceBuffer base = gpu.copy_of(old_gpu.data, c.bytes);
    records.emplace_back();
    ASSERT_TRUE(gpu.encode(base, now_gpu.data, c.bytes, c.element_size, records.back()).encoded) << k;
    targets.push_back(gpu.copy_of(old_gpu.data, c.bytes));
  }
  // Record 2 as the host writes it (xxh3): a batch may mix checksum kinds.
  std::vector<std::byte> host_base = olds[2];
  records[2].clear();
  ASSERT_TRUE(encode_delta(host_base, nows[2], cases[2].element_size, records[2]).encoded);
  for (size_t k = 0; k < cases.size(); ++k)
    gpu.queue_record(targets[k], cases[k].bytes, cases[k].element_size, records[k], "record");
  const auto patched = gpu.patch_queued();
  ASSERT_EQ(patched.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    EXPECT_EQ(download(targets[k].data(), cases[k].bytes), nows[k]) << k;
    EXPECT_EQ(patched[k].checksum, patched[k].header.checksum) << k;
    DeltaChanges decoded;
    decode_delta(records[k], cases[k].element_size, cases[k].bytes, decoded, "record");
    EXPECT_EQ(patched[k].header.changed, decoded.header.changed) << k;
    EXPECT_EQ(patched[k].header.checksum_kind, k == 2 ? DeltaChecksum::kXxh3 : DeltaChecksum::kWords) << k;
  }
  EXPECT_TRUE(gpu.patch_queued().empty()) << "the queue is empty after a batch";
  // A batch with a malformed record: queueing it throws; dropped, nothing was written.
  DeviceBuffer untouched = gpu.copy_of(OnGpu(olds[0], 0).data, cases[0].bytes);
  gpu.queue_record(untouched, cases[0].bytes, 2, records[0], "record 0");
  std::vector<uint8_t> bad = records[0];
  bad.push_back(0);
  DeviceBuffer other = gpu.copy_of(OnGpu(olds[0], 0).data, cases[0].bytes);
  EXPECT_THROW(gpu.queue_record(other, cases[0].bytes, 2, bad, "bad record"), Error);
  gpu.drop_queued();
  EXPECT_TRUE(gpu.patch_queued().empty());
  EXPECT_EQ(download(untouched.data(), cases[0].bytes), olds[0]);
  EXPECT_EQ(download(other.data(), cases[0].bytes), olds[0]);
}

// A source's batch: tensors of every element size, sparse, unchanged, dense (whole) and empty of
// change, compared in one encode_batch, give each the record and base that encode() gives alone.
TEST(DeviceDelta, ABatchEncodesEachTensorAsAloneAndLeavesEveryBaseTheTensor) {
  REFIT_REQUIRE_GPUS(1);
  DeviceDelta gpu;
  struct Case {
    size_t element_size, bytes, changes;
  };
  const std::vector<Case> cases = {{2, 1 << 20, 3000}, {4, 300004, 0},    {1, 70001, 500},
                                   {8, 1 << 16, 40},   {2, 40002, 40000}, {2, 6, 1}};
  std::vector<std::vector<std::byte>> nows;
  std::vector<OnGpu> now_gpu;
  std::vector<DeviceBuffer> batch_bases, alone_bases;
  for (size_t k = 0; k < cases.size(); ++k) {
    const auto old = random_bytes(cases[k].bytes, 30 + k);
    nows.push_back(changed(old, cases[k].element_size, cases[k].changes, 40 + k));
    const OnGpu old_gpu(old, 0);
    now_gpu.emplace_back(nows.back(), k % 3);  // some unaligned
    batch_bases.push_back(gpu.copy_of(old_gpu.data, cases[k].bytes));
    alone_bases.push_back(gpu.copy_of(old_gpu.data, cases[k].bytes));
  }
  std::vector<std::vector<uint8_t>> batch_records(cases.size()), alone_records(cases.size());
  std::vector<DeviceDelta::EncodeJob> jobs;
  for (size_t k = 0; k < cases.size(); ++k)
    jobs.push_back({&batch_bases[k], now_gpu[k].data, cases[k].bytes, cases[k].element_size, &batch_records[k], {}});
  gpu.encode_batch(jobs);
  size_t encoded = 0, whole = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    const DeltaResult alone =
        gpu.encode(alone_bases[k], now_gpu[k].data, cases[k].bytes, cases[k].element_size, alone_records[k]);
    EXPECT_EQ(jobs[k].result.encoded, alone.encoded) << k;
    EXPECT_EQ(jobs[k].result.checksum, alone.checksum) << k;
    if (alone.encoded) {
      EXPECT_EQ(batch_records[k], alone_records[k]) << k;
    }
    EXPECT_EQ(download(batch_bases[k].data(), cases[k].bytes), nows[k]) << k;
    encoded += alone.encoded ? 1 : 0;
    whole += alone.encoded ? 0 : 1;
  }
  EXPECT_GE(encoded, 4u) << "sparse and unchanged tensors go as records";
  EXPECT_GE(whole, 1u) << "a tensor changed everywhere goes whole";
}

TEST(DeviceDelta, RangesOfGpuMemoryReadToTheHostEachItsOwnBytes) {
  REFIT_REQUIRE_GPUS(1);
  DeviceDelta device;
  // A batch's records and markers: odd sizes at odd offsets, an empty one among them; the second
  // batch is larger (the page-locked array grows) and the first's bytes are not in it.
  for (size_t scale : {1, 40}) {
    std::vector<OnGpu> records;
    std::vector<std::vector<std::byte>> want;
    std::vector<DeviceDelta::Range> ranges;
    for (size_t k = 0; k < 5; ++k) {
      want.push_back(random_bytes(k == 2 ? 0 : (k * 1000 + 3) * scale, static_cast<uint32_t>(90 + k + scale)));
      records.emplace_back(want.back(), k);
      ranges.push_back({records.back().data, want.back().size()});
    }
    std::vector<std::span<const uint8_t>> read(ranges.size());
    device.read(ranges, read);
    for (size_t k = 0; k < ranges.size(); ++k) {
      ASSERT_EQ(read[k].size(), want[k].size()) << "range " << k;
      if (want[k].empty()) continue;
      EXPECT_EQ(std::memcmp(read[k].data(), want[k].data(), want[k].size()), 0) << "range " << k;
    }
  }
}

// A source's side of a link with GPU tensors: those that outlive send() wait and go in batches,
// in the order they came, each by a copy of its info (the stream reuses its own); those that do
// not go at once. Every view lives until the next begin().
TEST(SourceDelta, GpuTensorsGoInBatchesInTheirOrderByTheirOwnInfos) {
  REFIT_REQUIRE_GPUS(1);
  constexpr size_t kTensors = 70, kElements = 2048;  // more than a batch's tensors
  std::vector<OnGpu> tensors;
  for (size_t k = 0; k < kTensors; ++k) tensors.emplace_back(random_bytes(kElements * 2, 50 + k), 0);
  SourceDelta source;
  HostCopyPool pool(2);
  CopyStream copies(kGpu);
  // One refit; returns what went, and how many of the adds returned views before the flush.
  auto refit = [&](uint64_t version, bool outlives, size_t& early) {
    std::vector<TensorView> sent{source.begin(version, "destination rank 0")};
    TensorInfo current;  // the stream's info, overwritten tensor by tensor
    early = 0;
    for (size_t k = 0; k < kTensors; ++k) {
      current = TensorInfo{"w." + std::to_string(k), DType::kBFloat16, {static_cast<int64_t>(kElements)}};
      const auto ready =
          source.add({&current, tensors[k].data, MemoryKind::kCuda}, Box::whole(), current, outlives, copies, pool);
      early += ready.empty() ? 0 : 1;
      sent.insert(sent.end(), ready.begin(), ready.end());
    }
    const auto ready = source.flush(pool);
    sent.insert(sent.end(), ready.begin(), ready.end());
    sent.push_back(source.end());
    return sent;
  };
  size_t early = 0;
  const std::vector<TensorView> first = refit(0, true, early);  // the destination holds nothing: all whole
  ASSERT_EQ(first.size(), kTensors + 2);
  EXPECT_GE(early, 1u) << "a batch goes before the stream ends";
  EXPECT_LT(early, kTensors) << "GPU tensors that outlive send() wait for their batch";
  for (size_t k = 0; k < kTensors; ++k) {
    EXPECT_EQ(first[k + 1].info->name, "w." + std::to_string(k));
    EXPECT_EQ(first[k + 1].info->nbytes(), kElements * 2);
    EXPECT_EQ(first[k + 1].data, tensors[k].data) << "whole: the tensor itself";
  }
  const uint64_t version = source.commit(1.0);

  for (size_t k = 0; k < kTensors; k += 2) {  // every other tensor changes in one element
    std::byte* element = tensors[k].data + 2 * k;
    std::vector<std::byte> bumped = download(element, 1);
    bumped[0] = static_cast<std::byte>(static_cast<uint8_t>(bumped[0]) + 1);
    cuda_ok(cudaMemcpy(element, bumped.data(), 1, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  const std::vector<TensorView> second = refit(version, false, early);
  EXPECT_EQ(early, kTensors) << "tensors that may not outlive send() go at once";
  ASSERT_EQ(second.size(), kTensors + 2);
  for (size_t k = 0; k < kTensors; ++k) {
    const TensorView& v = second[k + 1];
    EXPECT_EQ(v.info->name, std::string(kDeltaTensorPrefix) + "w." + std::to_string(k));
    EXPECT_EQ(v.memory, MemoryKind::kHost) << "a record";
  }
  EXPECT_EQ(source.counts().changed_tensors, kTensors);
  EXPECT_GT(second[1].info->nbytes(), second[2].info->nbytes()) << "a change makes the record longer";
}

}  // namespace
}  // namespace refit::gpu_test
