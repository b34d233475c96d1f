// Chunk planning: how a stream of tensors is laid out in fixed-size buckets.
//
// Rules (the reference's, with its quirks fixed):
//  - a tensor larger than what is left of the bucket starts a new bucket; one larger than a
//    bucket is split into chunks of whole elements (byte-granular only when a bucket is smaller
//    than one element);
//  - a chunk's offset inside its bucket is aligned to its element size, so the receiver can view
//    it as typed memory;
//  - a zero-byte tensor gets a zero-byte chunk, so its name is delivered;
//  - a name seen twice in one refit is an error, not an overwrite.
// The packer is incremental so that a source can pack while it iterates; plan_buckets runs the
// same packer over a whole list (for `refit plan` and tests). Same input, same plan: a refit of
// the same model replays the same manifests.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "refit/tensor.h"

namespace refit {

struct ChunkPlacement {
  uint64_t tensor_offset = 0;  // byte offset of this chunk within its tensor
  uint64_t size = 0;           // bytes
  uint64_t bucket_offset = 0;  // byte offset within the bucket
  bool starts_bucket = false;  // the bucket before this chunk must be flushed first
};

class NameIndex;

// A destination that reads its source's memory gets a piece read where it lies only if it is at
// least this large (or continues the read before it): a read per small tensor costs more than
// packing it. The engine's rule, which the planner models too.
inline constexpr uint64_t kMinSourceReadBytes = 64 << 10;

// How a destination takes the pieces its source leaves in its own memory (direct_reads): it maps
// them (a source on its host) and loads them from there, or reads them into its buffer, or neither
// (the source packs everything).
enum class SourceAccess : uint8_t { kNone = 0, kMap = 1, kRead = 2 };

// Where a source puts a piece (or a chunk of one) of `bytes` on a link whose destination takes
// source memory by `access`: packed into the bucket; left in its memory and mapped (it takes no
// room in the bucket); or left there and read into the bucket. `contiguous`: it is one range of
// the source's registered memory; `continues_read`: it lies right after the chunk before, which is
// read, so both are one read. The engine's rule (LinkSender), which the planner follows too.
enum class PieceRoute : uint8_t { kPack, kMap, kRead };
PieceRoute route_piece(SourceAccess access, bool contiguous, uint64_t bytes, bool continues_read = false);

class BucketPacker {
 public:
  explicit BucketPacker(uint64_t bucket_bytes);  // throws Error(kInvalidArgument) for 0
  ~BucketPacker();
  BucketPacker(BucketPacker&&) noexcept;
  BucketPacker& operator=(BucketPacker&&) noexcept;

  // Places the next tensor; throws Error(kInvalidArgument) for a repeated name. The placements
  // are valid until the next call.
  const std::vector<ChunkPlacement>& place(const TensorInfo& tensor);
  // A tensor that goes without being placed (read in place from the source's memory): its name is
  // checked and recorded, and its `bytes` count against what the open bucket holds in place: at
  // most bucket_bytes besides its chunks, so that batches keep their size (one larger tensor goes
  // alone). True when it opens a new bucket: announce the open one first.
  bool place_in_place(const TensorInfo& tensor, uint64_t bytes);
  // The bucket was sent early: the next chunk starts a fresh one, with no flush before it.
  void close_bucket();
  // Starts the next refit's stream: every name may come again, the first chunk at offset 0.
  void restart();

  uint64_t bucket_bytes() const { return bucket_bytes_; }

 private:
  uint64_t bucket_bytes_;
  void check_name(const TensorInfo& tensor);

  uint64_t offset_ = 0;
  bool bucket_has_chunks_ = false;
  uint64_t in_place_ = 0;  // bytes of the open bucket that go in place
  std::unique_ptr<NameIndex> names_;
  std::vector<ChunkPlacement> placed_;  // of the latest place()
};

struct PlannedChunk {
  uint32_t tensor = 0;  // index into the planned tensor list
  ChunkPlacement placement;
};

struct PlannedBucket {
  std::vector<PlannedChunk> chunks;
  uint64_t used_bytes = 0;
};

struct BucketPlan {
  uint64_t bucket_bytes = 0;
  std::vector<PlannedBucket> buckets;  // an empty stream has one empty bucket
  uint64_t payload_bytes = 0;          // sum of tensor sizes
  uint64_t transferred_bytes = 0;      // sum of used bucket bytes (padding included)
};

BucketPlan plan_buckets(std::span<const TensorInfo> tensors, uint64_t bucket_bytes);

}  // namespace refit
