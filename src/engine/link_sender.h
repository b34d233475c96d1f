// The send path of one link (a source and one destination it serves): the pieces asked of the
// source are gathered from its tensors straight into the link's two buffers (box_copy.h: a
// strided copy per block, on the GPU for GPU tensors), packed into bucket-sized chunks
// (plan.h), and each full bucket is announced; before a buffer is refilled the destination must
// have said it is done with it. A source serving several destinations has one LinkSender per
// destination, all fed from one pass over its weights.
// Sent in place (a destination on this host that maps our memory, and a piece that lies
// contiguous in registered memory, source_regions.h): the piece is not copied but named in the
// bucket's manifest, where it lies in our own memory, and the destination loads it from there. A
// bucket holds up to bucket_bytes of packed bytes and as much again of pieces sent in place, so
// that batches keep their size; the destination acknowledges such a bucket once it has loaded it.
// Read from our memory (a destination that reads the source's memory but cannot map it, as on
// another host): the bucket is laid out as if packed, but a piece lying contiguous in registered
// memory is not copied; its entries say where it lies in our memory, and the destination reads it
// from there into its buffer (protocol::bucket_reads). One copy fewer per byte, and no packing
// work here.
// Replay: a refit of the same model makes the same manifests, so while a refit's buckets match
// the previous refit's (checked entry by entry as they are packed, no copy made), a bucket goes as
// "the manifest of bucket k of refit r", which the destination kept: neither side encodes,
// decodes or validates a manifest again (docs/ARCHITECTURE.md, "Manifest replay").
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/link.h"
#include "engine/protocol.h"
#include "engine/source_regions.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"
#include "refit/ext/transport.h"
#include "refit/plan.h"
#include "refit/tensor.h"
#include "refit/timeline.h"

namespace refit {

class LinkSender {
 public:
  // `link` outlives the sender. `stream` (the engine's, shared by its links) copies into the
  // buffers, of kind `buffers`. `in_place`: the engine's registrations of its own memory; null:
  // nothing is sent in place on this link.
  LinkSender(const Link& link, CopyStream& stream, MemoryKind buffers, SourceRegions* in_place)
      : link_(link), stream_(stream), buffer_kind_(buffers), in_place_regions_(in_place) {}

  // Starts refit `refit` (the wire number of this link); `in_place`: the weight stream's views
  // outlive the refit, so they may be sent in place where the link allows.
  void begin(uint64_t refit, bool in_place);
  // Packs `box` of `view` (box in the view's coordinates) as the piece `piece` of the destination's
  // tensor `tensor` (its name, dtype and shape at the destination). `phase` says where a failure
  // happened.
  void add(const TensorView& view, const Box& box, const TensorInfo& tensor, const Box& piece, std::string& phase);
  // Announces the open bucket now, if it holds at least `bytes`, so that the destination works on
  // it while the next one fills (delta refit: change records are small, and each stands for a
  // scan of a whole tensor here and a patch of it there).
  void send_early(uint64_t bytes, std::string& phase);
  // Announces the last bucket; then wait_done() waits until the destination has every bucket.
  void flush_last(std::string& phase);
  void wait_done(std::string& phase);

  // The bucket being packed; as many were announced before it.
  uint64_t bucket() const { return bucket_.seq; }
  uint64_t replayed_buckets() const { return replayed_; }  // of those announced, sent as a replay
  uint64_t payload_bytes() const { return payload_bytes_; }
  uint64_t in_place_bytes() const { return in_place_bytes_; }  // of payload_bytes(), sent in place
  // This refit's pack, announce and release events, so far.
  const std::vector<TimelineEvent>& events() const { return events_; }

 private:
  // Bucket bucket_.seq starts, empty, in buffer buffer_.
  void open_bucket();
  void flush(bool is_last, std::string& phase);
  // Waits for the oldest announced bucket's acknowledgement and forgets it.
  void acknowledged_oldest(std::string& phase);
  // Names the piece in the open bucket if it can go in place; false when it must be packed.
  bool add_in_place(const TensorView& view, const Box& box, const TensorInfo& tensor, const Box& piece,
                    std::string& phase);
  // Where the piece lies in registered memory, if it is one contiguous range of it there.
  std::optional<SourceRegions::Found> find_in_place(const TensorView& view, const Box& box, uint64_t size,
                                                    SourceAccess access, const std::byte** data,
                                                    bool register_new = true) const;
  // The open bucket's index of our region (adding it to the bucket's regions).
  uint32_t bucket_region(const SourceRegions::Found& found);
  // Where a chunk of a piece lies: a manifest entry but for its tensor and piece, which record()
  // copies only when the entry is new (not while a refit replays the one before).
  struct Chunk {
    uint64_t tensor_offset = 0, size = 0, bucket_offset = 0;
    uint32_t region = 0;
    uint64_t source_offset = 0;
  };
  // Adds an entry to the open bucket's manifest (its bytes lie at `data` here); while replaying,
  // checks it against the previous refit's instead.
  void record(const TensorInfo& tensor, const Box& piece, const Chunk& chunk, const std::byte* data);
  // The open bucket differs from its counterpart of the previous refit: from here on this refit's
  // manifests are made, starting with the entries the open bucket had in common with it.
  void stop_replaying();

  const Link& link_;
  CopyStream& stream_;
  const MemoryKind buffer_kind_;
  SourceRegions* const in_place_regions_;
  // How this refit sends in place: kNone, or the link's way (when the weight stream allows).
  SourceAccess in_place_ = SourceAccess::kNone;
  std::optional<BucketPacker> packer_;
  protocol::BucketReady bucket_;                        // the open bucket's announcement, but for its manifest
  std::shared_ptr<protocol::Manifest> manifest_;        // of the open bucket, unless replaying
  std::vector<protocol::SourceRegion> bucket_regions_;  // of the open bucket (few; made even while replaying)
  uint64_t buffer_bytes_ = 0;                           // of the open bucket: packed into the buffer
  protocol::BucketRead last_entry_;                     // of the open bucket, where the latest entry lies
  std::vector<const std::byte*> entry_data_;            // by entry of the open bucket: where it lies here (checksums)
  std::string pack_phase_;                              // "pack bucket k for ...", made once per bucket
  // Replay. A bucket's manifest and used bytes, as sent; previous_: the last refit on this link
  // whose every bucket the destination acknowledged (so it has them all), numbered previous_refit_.
  struct Sent {
    std::shared_ptr<const protocol::Manifest> manifest;
    uint64_t used_bytes = 0;
  };
  std::vector<Sent> previous_, sent_;
  uint64_t previous_refit_ = 0;
  bool completed_ = false;  // the refit begun last went through
  bool replaying_ = false;  // every entry so far equals the previous refit's at the same place
  uint64_t matched_ = 0;    // entries of the open bucket so far (replaying)
  uint64_t replayed_ = 0;
  int buffer_ = 0;  // which of the two buffers the open bucket fills
  // Announced buckets the destination is not done with: at most one per buffer among those that
  // hold bytes in one, and any number of those that do not (all in place). A bucket is announced
  // as soon as it is packed, while the destination still reads the one before, so that its reads
  // follow each other with no round trip between them.
  struct Announced {
    uint64_t seq = 0;
    bool uses_buffer = true;
  };
  std::deque<Announced> unacknowledged_;
  int buffers_held_ = 0;  // of unacknowledged_, those that hold bytes in a buffer
  uint64_t payload_bytes_ = 0, in_place_bytes_ = 0;
  std::map<RegionId, uint32_t> regions_;  // of the open bucket: our region -> its index there
  std::optional<double> pack_start_;      // when the open bucket got its first byte
  std::vector<TimelineEvent> events_;
};

}  // namespace refit
