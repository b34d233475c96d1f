// Turns received buckets back into whole tensors. A tensor that arrives as one chunk is handed
// out as a zero-copy view into the transfer buffer; any other is copied into an owned buffer
// chunk by chunk (each chunk to where its piece lies in the tensor, box_copy.h) and handed out
// when all its bytes are there. Chunks may come in any order and interleaved with other
// tensors' (pieces of one tensor come from several sources at once); every byte arrives once.
//
// Buffers for split tensors are kept from one refit to the next (a refit of the same model
// splits the same tensors), so that only the first refit pays for allocating and faulting in
// their pages; release() frees them. A caller may keep a merged tensor's buffer (owners()): the
// assembler then merges that tensor into a fresh buffer next time. They live where the transfer buffers live (host
// memory or the GPU), and chunks are copied into them on a CopyStream that is synchronized before add_bucket() returns.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/name_index.h"
#include "engine/protocol.h"
#include "refit/deadline.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"
#include "refit/ext/tensor_memory.h"
#include "refit/memory.h"
#include "refit/tensor.h"

namespace refit {

class TensorAssembler {
 public:
  // Where transfer buffers (and so merge buffers) live; host memory until set. Call before the
  // first add_bucket(); changing it frees the merge buffers.
  void set_memory(MemoryKind kind, const Device& device);

  // Returns the tensors completed by this bucket, in bucket order. The list and the views stay
  // valid until the next add_bucket() or reset(). `bytes` says where each entry lies.
  // `repeats_checked`: the bucket's manifest is one this assembler took in the previous refit,
  // which went through whole (a replay). While every bucket of a refit is such, no whole tensor
  // can come twice (that refit checked every name), so their names are recorded only once a
  // bucket is not: a replayed refit of tens of thousands of tensors makes no lookup per tensor.
  std::span<const TensorView> add_bucket(const protocol::BucketReady& bucket, const protocol::BucketBytes& bytes,
                                         const std::string& who, Deadline deadline, bool repeats_checked = false);

  // Delta refit, resharding: merges pieces as their link's delta handed them out (whole, each a
  // view of its own under the name `pieces` knows it by: the tensor and box it is) into tensors,
  // as add_bucket() merges chunks. `owners` is parallel to `views`; `seq` and `who` name the
  // bucket they came in.
  std::span<const TensorView> add_pieces(std::span<const TensorView> views,
                                         std::span<const std::shared_ptr<const void>> owners,
                                         const std::map<std::string, protocol::ManifestEntry, std::less<>>& pieces,
                                         uint64_t seq, const std::string& who, Deadline deadline);

  // Parallel to the views the latest add_bucket() or add_pieces() returned: the buffer of a merged
  // tensor (holding it keeps the tensor's bytes valid after the next add_bucket(), reset() or
  // release()), null for a view into the bucket, or the owner add_pieces() was given.
  const std::vector<std::shared_ptr<const void>>& owners() const { return owners_; }

  // At the end of a refit: throws Error(kProtocol) naming the first incomplete tensor.
  void finish(const std::string& who) const;

  // Forgets the tensors of this refit, keeping the merge buffers for the next.
  void reset();
  // Frees the merge buffers too.
  void release();

  uint64_t tensors_completed() const { return completed_; }

 private:
  // What has arrived of one piece: its chunks' byte ranges in the packed piece, start -> end.
  struct PieceRanges {
    Box box;
    std::map<uint64_t, uint64_t> ranges;
  };
  struct Merge {
    TensorInfo info;
    std::shared_ptr<TensorMemory> buffer;
    uint64_t received = 0;
    // Pieces must be disjoint and a piece's chunks too; then `received` reaching the tensor's size
    // means every byte is here, once (a peer that sent a byte twice and another never is refused).
    std::vector<PieceRanges> pieces;
  };
  void begin_batch();
  // Checks names from here on (replayed buckets' included).
  void stop_deferring();
  // Chunk `e`, whose bytes lie at `chunk`: a whole tensor is handed out as it lies (held by
  // `owner`), another merged.
  void add_chunk(const protocol::ManifestEntry& e, const std::byte* chunk, MemoryKind chunk_kind,
                 std::shared_ptr<const void> owner, uint64_t seq, const std::string& who);
  // Throws Error(kProtocol) unless chunk `e` lies apart from everything `m` has received.
  static void claim(Merge& m, const protocol::ManifestEntry& e, uint64_t seq, const std::string& who);
  MemoryKind kind_ = MemoryKind::kHost;
  Device device_;
  std::unique_ptr<CopyStream> stream_ = std::make_unique<CopyStream>();
  std::map<std::string, Merge, std::less<>> merging_;  // tensors with some, not all, bytes here
  NameIndex names_;                                    // tensors delivered this refit (but the whole ones of deferred_)
  uint64_t completed_ = 0;                             // tensors delivered this refit
  // Every bucket of this refit so far repeated a checked one; their manifests, whose whole
  // tensors' names names_ does not have yet.
  bool deferring_ = true;
  std::vector<std::shared_ptr<const protocol::Manifest>> deferred_;
  // By tensor name, kept across refits unless a caller holds one; host memory is page-locked
  // when a GPU is usable, so that a loader copies merged tensors to the GPU at PCIe speed.
  std::map<std::string, std::shared_ptr<TensorMemory>> merge_buffers_;
  // Of the latest batch, kept from one bucket to the next: a batch of tens of thousands of small
  // tensors must not allocate (after a caller frees many small blocks, a large malloc first
  // consolidates them all).
  std::vector<TensorView> views_;
  std::vector<std::shared_ptr<const void>> owners_;
  std::deque<TensorInfo> batch_infos_;  // storage behind the merged views of the latest batch
};

}  // namespace refit
