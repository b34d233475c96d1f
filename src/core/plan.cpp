#include "refit/plan.h"

#include <algorithm>

#include "core/fail.h"
#include "core/name_index.h"

namespace refit {
namespace {

uint64_t align_up(uint64_t value, uint64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

}  // namespace

BucketPacker::BucketPacker(uint64_t bucket_bytes) : bucket_bytes_(bucket_bytes), names_(std::make_unique<NameIndex>()) {
  if (bucket_bytes == 0) fail(ErrorKind::kInvalidArgument, "bucket size must be at least 1 byte");
}
BucketPacker::~BucketPacker() = default;
BucketPacker::BucketPacker(BucketPacker&&) noexcept = default;
BucketPacker& BucketPacker::operator=(BucketPacker&&) noexcept = default;

void BucketPacker::check_name(const TensorInfo& tensor) {
  if (!names_->add(tensor.name).added)
    fail(ErrorKind::kInvalidArgument, "tensor '{}' appears twice in one refit", tensor.name);
}

PieceRoute route_piece(SourceAccess access, bool contiguous, uint64_t bytes, bool continues_read) {
  if (!contiguous || bytes == 0) return PieceRoute::kPack;
  if (access == SourceAccess::kMap) return PieceRoute::kMap;
  if (access == SourceAccess::kRead && (bytes >= kMinSourceReadBytes || continues_read)) return PieceRoute::kRead;
  return PieceRoute::kPack;
}

bool BucketPacker::place_in_place(const TensorInfo& tensor, uint64_t bytes) {
  check_name(tensor);
  const bool opens = in_place_ > 0 && in_place_ + bytes > bucket_bytes_;
  if (opens) close_bucket();
  in_place_ += bytes;
  return opens;
}

void BucketPacker::close_bucket() {
  offset_ = 0;
  bucket_has_chunks_ = false;
  in_place_ = 0;
}

void BucketPacker::restart() {
  close_bucket();
  names_->clear();
}

const std::vector<ChunkPlacement>& BucketPacker::place(const TensorInfo& tensor) {
  check_name(tensor);
  const uint64_t element = dtype_size(tensor.dtype);
  const uint64_t total = tensor.nbytes();
  // Whole elements per chunk keep every chunk a typed view; a bucket smaller than one element
  // can only carry bytes.
  const uint64_t chunk_limit = bucket_bytes_ >= element ? bucket_bytes_ / element * element : bucket_bytes_;

  std::vector<ChunkPlacement>& out = placed_;
  out.clear();
  uint64_t tensor_offset = 0;
  do {
    const uint64_t size = std::min(chunk_limit, total - tensor_offset);
    ChunkPlacement chunk{tensor_offset, size, align_up(offset_, element), false};
    if (chunk.bucket_offset + size > bucket_bytes_) {
      chunk.bucket_offset = 0;
      chunk.starts_bucket = bucket_has_chunks_;
      if (chunk.starts_bucket) in_place_ = 0;
    }
    offset_ = chunk.bucket_offset + size;
    bucket_has_chunks_ = true;
    out.push_back(chunk);
    tensor_offset += size;
  } while (tensor_offset < total);
  return out;
}

BucketPlan plan_buckets(std::span<const TensorInfo> tensors, uint64_t bucket_bytes) {
  BucketPacker packer(bucket_bytes);
  BucketPlan plan;
  plan.bucket_bytes = bucket_bytes;
  plan.buckets.emplace_back();
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    plan.payload_bytes += tensors[i].nbytes();
    for (const ChunkPlacement& c : packer.place(tensors[i])) {
      if (c.starts_bucket) plan.buckets.emplace_back();
      PlannedBucket& bucket = plan.buckets.back();
      bucket.chunks.push_back({i, c});
      bucket.used_bytes = c.bucket_offset + c.size;
    }
  }
  for (const auto& b : plan.buckets) plan.transferred_bytes += b.used_bytes;
  return plan;
}

}  // namespace refit
