// What engines say to each other: the metadata blob of prepare(), and the control messages of a
// refit (bucket ready, bucket done, abort). Decoding validates every field; anything malformed
// or inconsistent is Error(kProtocol) naming the peer, the message and the field.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/process_identity.h"
#include "refit/checkpoint_engine.h"
#include "refit/error.h"
#include "refit/tensor.h"
#include "refit/transport.h"

namespace refit::protocol {

inline constexpr uint32_t kVersion = 9;

struct EngineMetadata {
  uint32_t version = kVersion;
  SessionId session{};
  uint64_t model_fingerprint = 0;
  uint64_t bucket_bytes = 0;
  std::string transport_name;
  Bytes transport_address;
  // Both transfer buffers, from one allocation: buffer b is the bucket_bytes at b * bucket_bytes.
  // Empty (length 0) for an engine that only receives and has none.
  RemoteRegion buffers;
  Bytes layout;             // a destination's encoded layout (what it needs); empty: whole tensors
  Bytes holds;              // a source's encoded layout (what it holds); empty: the whole model
  ProcessIdentity process;  // lets a peer on the same host see at once that we are gone
  uint64_t generation = 0;  // random per prepare(): tells one connection from the next
  // A destination that loads tensors straight from its source's own memory wherever it can map
  // it (direct_reads): a source on its host may then send tensors in place.
  bool reads_in_place = false;
  // A destination that reads tensors from its source's own registered memory into its buffers
  // (direct_reads where nothing maps, as across hosts): a source may then skip packing them.
  bool reads_source_memory = false;
  // Delta refit (refit_cfg.nixl.delta, engine/delta.h): both ends must agree. A destination's
  // weights_version is the version of the weights it holds (0: none).
  bool delta = false;
  uint64_t weights_version = 0;
};

// The refit number before the first refit of a connection, the same on both sides: derived from
// both peers' metadata generations, so that messages left over from an earlier connection (or a
// failed refit) never match a refit of this one and are discarded.
uint64_t first_refit(uint64_t source_generation, uint64_t destination_generation);

Bytes encode(const EngineMetadata& metadata);
// `who` names the blob's owner in errors ("metadata of source rank 1").
EngineMetadata decode_metadata(std::span<const uint8_t> blob, const std::string& who);

// One chunk of a bucket, with the destination tensor's description so the receiver can
// reassemble. The chunk is bytes [tensor_offset, +size) of a piece: `box` of the tensor, packed
// (box.h); a whole box makes the piece the tensor itself. It lies at `bucket_offset` of the
// bucket's bytes (region 0), or, sent in place, at that offset of the source's own memory
// described by the bucket's regions[region - 1].
struct ManifestEntry {
  TensorInfo tensor;
  Box box;
  uint64_t tensor_offset = 0;
  uint64_t size = 0;
  uint64_t bucket_offset = 0;
  uint32_t region = 0;
};

// Source memory that a bucket's in-place entries lie in, and what kind of memory it is.
struct SourceRegion {
  RemoteRegion remote;
  MemoryKind memory = MemoryKind::kHost;
};

// A range of a bucket that its destination reads from where the source left it: bytes
// [bucket_offset, +size) of the bucket come from `source_offset` of regions[region - 1] (the
// source's own memory, not packed), or, region 0, from the same offset of the bucket's buffer.
struct BucketSpan {
  uint64_t bucket_offset = 0;
  uint64_t size = 0;
  uint32_t region = 0;
  uint64_t source_offset = 0;
};

enum class MessageType : uint8_t { kBucketReady = 1, kBucketDone = 2, kAbort = 3 };

// What a bucket holds: its chunks, and the source memory of those sent in place. A refit of the
// same model makes the same manifests, so they are shared (never changed once made) and replayed:
// the source sends bucket k's manifest once per connection and afterwards only says it is the
// one of bucket k of the refit before.
// A bucket either names entries in place (region > 0: the destination maps that memory) or, for
// a destination that reads the source's memory, lists spans: then every entry lies in the bucket
// (region 0) and the spans say where its bytes are read from. Without spans the destination
// reads (or maps) the used bytes of the bucket's buffer.
struct Manifest {
  std::vector<SourceRegion> regions;  // of the entries sent in place, or of the spans
  std::vector<ManifestEntry> entries;
  std::vector<BucketSpan> spans;  // in bucket order, not overlapping
};

struct BucketReady {
  uint64_t refit = 0;   // refit number: first_refit() of the connection, plus one per refit
  uint64_t seq = 0;     // bucket number within the refit
  uint64_t offset = 0;  // where the bucket starts in the source's transfer region (metadata `buffers`)
  bool is_last = false;
  uint64_t used_bytes = 0;  // only this prefix of the buffer is read
  // With verify_checksums: xxh3-64 of the used bytes (with spans: of each span's bytes), then of
  // every in-place entry's bytes in entry order.
  std::optional<uint64_t> checksum;
  // Set: the manifest is that of bucket `seq` of refit `replay_of` on this connection (which the
  // destination has), and is not on the wire; `manifest` is then null until the receiver fills it.
  std::optional<uint64_t> replay_of;
  std::shared_ptr<const Manifest> manifest = std::make_shared<const Manifest>();

  const std::vector<ManifestEntry>& entries() const { return manifest->entries; }
  const std::vector<SourceRegion>& regions() const { return manifest->regions; }
  const std::vector<BucketSpan>& spans() const { return manifest->spans; }
  bool has_in_place_entries() const { return !manifest->regions.empty() && manifest->spans.empty(); }
};

// A copy of the bucket's manifest that only `bucket` holds, to change (tests, fuzz seeds).
Manifest& edit_manifest(BucketReady& bucket);

struct BucketDone {
  uint64_t refit = 0;
  uint64_t seq = 0;
};

struct Abort {
  uint64_t refit = 0;
  ErrorKind kind = ErrorKind::kInternal;  // why the sender failed; the receiver fails with the same kind
  std::string reason;
};

struct Message {
  MessageType type;
  BucketReady ready;
  BucketDone done;
  Abort abort;
  uint64_t refit() const;  // the refit the message belongs to, whatever its type
};

Bytes encode(const BucketReady& m);
Bytes encode(const BucketDone& m);
Bytes encode(const Abort& m);
Message decode_message(std::span<const uint8_t> bytes, const std::string& who);

// Throws the error a peer's Abort stands for: its kind, naming the peer and what we waited for.
[[noreturn]] void raise_abort(const Abort& m, const std::string& who, const std::string& waiting_for);

// Checks a bucket against the link's bucket size and the source's region length: where it lies,
// used bytes, and every entry's ranges (box inside the tensor, chunk inside the piece and the
// bucket or its source region, sizes matching dtype x shape), spans (ordered, inside the used
// bytes and their region); every region is used.
void validate(const BucketReady& m, uint64_t bucket_bytes, uint64_t region_bytes, const std::string& who);

}  // namespace refit::protocol
