// Delta refit on tensors in GPU memory (delta/codec.h): the diff against the base, its
// compaction and the patch of a held tensor run as kernels (delta/kernels.cu); only
// the changed elements cross to the host, where the record is written as for host tensors (so a
// record made from GPU memory applies anywhere). Its checksum is the word hash
// (DeltaChecksum::kWords), which each kernel block computes over its own words.
//
// One DeviceDelta per thread that uses it: it owns a stream and scratch buffers that grow to the
// largest tensor seen. Without CUDA in the build every call is Error(kUnsupported).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "delta/codec.h"
#include "refit/ext/device_memory.h"

namespace refit {

class HostCopyPool;

class DeviceDelta {
 public:
  DeviceDelta();
  ~DeviceDelta();
  DeviceDelta(const DeviceDelta&) = delete;
  DeviceDelta& operator=(const DeviceDelta&) = delete;

  // A device copy of `bytes` bytes at `data` (GPU memory) to keep as a base or held version:
  // rounded up to whole 8-byte words, the padding zero, on the device `data` lies on.
  DeviceBuffer copy_of(const std::byte* data, size_t bytes);
  // Makes `base` (from copy_of) equal to `data` again.
  void assign(DeviceBuffer& base, const std::byte* data, size_t bytes);

  // encode_delta for GPU memory: compares `now` with `base` (from copy_of, the same size), makes
  // `base` equal to `now`, and writes the record into `out` when it is smaller than the tensor.
  DeltaResult encode(DeviceBuffer& base, const std::byte* now, size_t bytes, size_t element_size,
                     std::vector<uint8_t>& out);
  // encode() for many tensors (of one GPU) at once, two waits in all instead of two per tensor:
  // every count kernel, then every collect kernel. Each job's `result` and `*out` are encode()'s.
  // Its scratch memory grows with the batch: up to 24 bytes per changed element.
  struct EncodeJob {
    DeviceBuffer* base = nullptr;
    const std::byte* now = nullptr;
    size_t bytes = 0;
    size_t element_size = 0;
    std::vector<uint8_t>* out = nullptr;
    DeltaResult result;
  };
  // `pool`: the records are written on its threads.
  void encode_batch(std::span<EncodeJob> jobs, HostCopyPool* pool = nullptr);

  // apply_delta for GPU memory: decodes and checks `record` (host bytes) on the host, patches
  // `target` (GPU, from copy_of) with a kernel. Returns the header, and in `checksum` the patched
  // tensor's checksum of the header's kind (the word hash within the patch's own wait).
  DeltaHeader apply(DeviceBuffer& target, size_t bytes, size_t element_size, std::span<const uint8_t> record,
                    const std::string& what, uint64_t* checksum);

  // apply() for many tensors (of one GPU) at once, each record's changes decoded straight into the
  // page-locked memory they cross to the GPU from: queue_patch() queues the patch of a record with
  // `header` (read_delta_header) and returns its number k; changes_of(k), once every patch of the
  // batch is queued, is where its changes go (decode_delta_into, on any thread); patch_queued()
  // copies every change to the GPU in one go, patches and hashes each tensor, waits once, and
  // returns each one's header and checksum in queue order. queue_record() does all but the last
  // for one record, on this thread.
  struct Patched {
    DeltaHeader header;
    uint64_t checksum = 0;
  };
  struct Changes {
    std::span<uint64_t> index, values;
  };
  size_t queue_patch(DeviceBuffer& target, size_t bytes, size_t element_size, const DeltaHeader& header);
  Changes changes_of(size_t k);
  void queue_record(DeviceBuffer& target, size_t bytes, size_t element_size, std::span<const uint8_t> record,
                    const std::string& what);
  std::vector<Patched> patch_queued();
  // Forgets the queued patches (their batch failed).
  void drop_queued();

  // Copies ranges of GPU memory (a batch's records and markers that arrived there) to the host,
  // into one page-locked array, asynchronously and with one wait: out[k] is range k there (for
  // each range of one byte or more; the others' are left as they are), valid until the next call.
  struct Range {
    const std::byte* data = nullptr;
    size_t bytes = 0;
  };
  void read(std::span<const Range> ranges, std::span<std::span<const uint8_t>> out);

  // The checksum of `bytes` bytes of GPU memory, of the given kind (xxh3 copies them to the host).
  uint64_t checksum(const std::byte* data, size_t bytes, DeltaChecksum kind);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace refit
