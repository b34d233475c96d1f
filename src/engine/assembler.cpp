#include "engine/assembler.h"

#include <cstring>

#include "core/box_copy.h"
#include "core/fail.h"

namespace refit {

void TensorAssembler::set_memory(MemoryKind kind, const Device& device) {
  if (kind == kind_ && device == device_) return;
  release();
  kind_ = kind;
  device_ = device;
  stream_ = std::make_unique<CopyStream>(device);
}

std::vector<TensorView> TensorAssembler::add_bucket(const protocol::BucketReady& bucket, const std::byte* data,
                                                    const std::string& who, Deadline deadline) {
  batch_infos_.clear();
  std::vector<TensorView> out;
  for (const auto& e : bucket.entries) {
    const uint64_t nbytes = e.tensor.nbytes();
    const bool whole = e.box.is_whole() && e.tensor_offset == 0 && e.size == nbytes;
    auto merge = merging_.find(e.tensor.name);
    if (names_.count(e.tensor.name) || (whole && merge != merging_.end()))
      fail(ErrorKind::kProtocol, "bucket {} from {}: tensor '{}' delivered twice in one refit", bucket.seq, who,
           e.tensor.name);
    if (whole) {
      names_.insert(e.tensor.name);
      out.push_back({&e.tensor, data + e.bucket_offset, kind_});
      continue;
    }
    if (merge == merging_.end()) {
      TensorMemory& buffer = merge_buffers_[e.tensor.name];
      if (buffer.size() != nbytes) {
        buffer = TensorMemory();  // the old one goes before the new one is allocated
        buffer = TensorMemory(kind_, device_, nbytes, /*pin=*/true);
      }
      merge = merging_.emplace(e.tensor.name, Merge{e.tensor, &buffer, 0}).first;
    } else if (merge->second.info != e.tensor) {
      fail(ErrorKind::kProtocol, "bucket {} from {}: chunks of '{}' disagree on dtype or shape", bucket.seq, who,
           e.tensor.name);
    }
    Merge& m = merge->second;
    if (e.size > nbytes - m.received)
      fail(ErrorKind::kProtocol, "bucket {} from {}: a chunk of {} bytes of '{}' exceeds its {} bytes ({} here already)",
           bucket.seq, who, e.size, e.tensor.name, nbytes, m.received);
    const std::byte* chunk = data + e.bucket_offset;
    for_each_box_block(e.tensor.shape, dtype_size(e.tensor.dtype), e.box, e.tensor_offset, e.size,
                       [&](const BoxBlock& b) {
                         stream_->copy_2d(m.buffer->data() + b.tensor_offset, b.pitch,
                                          chunk + (b.packed_offset - e.tensor_offset), b.row_bytes, b.row_bytes, b.rows,
                                          kind_, kind_);
                       });
    m.received += e.size;
    if (m.received == nbytes) {
      names_.insert(e.tensor.name);
      batch_infos_.push_back(std::move(m.info));
      out.push_back({&batch_infos_.back(), m.buffer->data(), kind_});
      merging_.erase(merge);
    }
  }
  // The loader reads merged tensors, and the fetcher refills this bucket's buffer, after we return.
  if (stream_->pending()) stream_->synchronize(deadline);
  return out;
}

void TensorAssembler::finish(const std::string& who) const {
  if (!merging_.empty()) {
    const Merge& m = merging_.begin()->second;
    fail(ErrorKind::kProtocol, "refit from {} ended with {} tensor(s) incomplete, among them '{}' ({} of {} bytes)", who,
         merging_.size(), m.info.name, m.received, m.info.nbytes());
  }
}

void TensorAssembler::reset() {
  merging_.clear();
  names_.clear();
  batch_infos_.clear();
}

void TensorAssembler::release() {
  reset();
  merge_buffers_.clear();
}

}  // namespace refit
