#include "engine/assembler.h"

#include <cstring>

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
    const bool whole = e.tensor_offset == 0 && e.size == nbytes;
    if (merging_ && (whole || merging_->info.name != e.tensor.name))
      fail(ErrorKind::kProtocol, "bucket {} from {}: tensor '{}' arrived while '{}' had only {} of {} bytes", bucket.seq,
           who, e.tensor.name, merging_->info.name, merging_->received, merging_->info.nbytes());
    if (!merging_ && !whole && e.tensor_offset != 0)
      fail(ErrorKind::kProtocol, "bucket {} from {}: tensor '{}' starts at byte {}, not 0", bucket.seq, who,
           e.tensor.name, e.tensor_offset);
    if (!merging_ && names_.count(e.tensor.name))
      fail(ErrorKind::kProtocol, "bucket {} from {}: tensor '{}' delivered twice in one refit", bucket.seq, who,
           e.tensor.name);

    if (whole) {
      names_.insert(e.tensor.name);
      out.push_back({&e.tensor, data + e.bucket_offset, kind_});
      continue;
    }
    if (!merging_) {
      TensorMemory& buffer = merge_buffers_[e.tensor.name];
      if (buffer.size() != nbytes) {
        buffer = TensorMemory();  // the old one goes before the new one is allocated
        buffer = TensorMemory(kind_, device_, nbytes, /*pin=*/true);
      }
      merging_ = Merge{e.tensor, &buffer, 0};
    } else if (merging_->info != e.tensor) {
      fail(ErrorKind::kProtocol, "bucket {} from {}: chunks of '{}' disagree on dtype or shape", bucket.seq, who,
           e.tensor.name);
    }
    if (e.tensor_offset != merging_->received)
      fail(ErrorKind::kProtocol, "bucket {} from {}: chunk of '{}' at byte {}, expected byte {}", bucket.seq, who,
           e.tensor.name, e.tensor_offset, merging_->received);
    stream_->copy(merging_->buffer->data() + e.tensor_offset, data + e.bucket_offset, e.size, kind_, kind_);
    merging_->received += e.size;
    if (merging_->received == nbytes) {
      names_.insert(e.tensor.name);
      batch_infos_.push_back(std::move(merging_->info));
      out.push_back({&batch_infos_.back(), merging_->buffer->data(), kind_});
      merging_.reset();
    }
  }
  // The loader reads merged tensors, and the fetcher refills this bucket's buffer, after we return.
  if (stream_->pending()) stream_->synchronize(deadline);
  return out;
}

void TensorAssembler::finish(const std::string& who) const {
  if (merging_)
    fail(ErrorKind::kProtocol, "refit from {} ended with tensor '{}' incomplete ({} of {} bytes)", who,
         merging_->info.name, merging_->received, merging_->info.nbytes());
}

void TensorAssembler::reset() {
  merging_.reset();
  names_.clear();
  batch_infos_.clear();
}

void TensorAssembler::release() {
  reset();
  merge_buffers_.clear();
}

}  // namespace refit
