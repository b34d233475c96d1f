// What engines say to each other: the metadata blob of prepare(), and the control messages of a
// refit (bucket ready, bucket done, abort). Decoding validates every field; anything malformed
// or inconsistent is Error(kProtocol) naming the peer, the message and the field.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/process_identity.h"
#include "refit/checkpoint_engine.h"
#include "refit/error.h"
#include "refit/ext/transport.h"
#include "refit/plan.h"
#include "refit/tensor.h"

namespace refit::protocol {

inline constexpr uint32_t kVersion = 13;

// How a destination takes the tensors a source leaves in its own memory (SourceAccess, plan.h):
// a destination says which ways it can (EngineMetadata::takes); link_access() picks one per link,
// alike on both sides.
inline constexpr uint8_t kTakesByMap = 1;   // EngineMetadata::takes: maps a source's memory on its host
inline constexpr uint8_t kTakesByRead = 2;  // ... reads a source's registered memory

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
  // A destination's ways of taking tensors from its sources' own memory (kTakesBy*; 0: none).
  uint8_t takes = 0;
  // Delta refit (refit_cfg.nixl.delta, delta/link_delta.h): both ends must set the same mode. A
  // destination's weights_versions: per source rank, the version of what it holds from that source
  // (sources it holds nothing from are left out).
  DeltaMode delta = DeltaMode::kOff;
  std::vector<std::pair<uint32_t, uint64_t>> weights_versions;
};

// The refit number before the first refit of a connection, the same on both sides: derived from
// both peers' metadata generations, so that messages left over from an earlier connection (or a
// failed refit) never match a refit of this one and are discarded.
uint64_t first_refit(uint64_t source_generation, uint64_t destination_generation);

// The way a destination whose metadata says `takes` takes source memory on one link: map where
// both are on one host and the transport maps, else read where it reads registered memory. Both
// ends call it with the same arguments (same_host is symmetric, and both run the same transport),
// so they agree without another message.
SourceAccess link_access(uint8_t takes, bool same_host, const TransportCapabilities& caps);

Bytes encode(const EngineMetadata& metadata);
// `who` names the blob's owner in errors ("metadata of source rank 1").
EngineMetadata decode_metadata(std::span<const uint8_t> blob, const std::string& who);

// One chunk of a bucket, with the destination tensor's description so the receiver can
// reassemble. The chunk is bytes [tensor_offset, +size) of a piece: `box` of the tensor, packed
// (box.h); a whole box makes the piece the tensor itself. Its bytes lie at `bucket_offset` of the
// bucket (region 0: packed into the source's buffer), or at `source_offset` of the source's own
// memory described by the bucket's regions[region - 1] (sent in place). The destination takes the
// latter as its link says (SourceAccess): mapped, it loads them from there (`bucket_offset` is
// then 0: they take no room in the bucket); read, it reads them to `bucket_offset` of its buffer.
struct ManifestEntry {
  TensorInfo tensor;
  Box box;
  uint64_t tensor_offset = 0;
  uint64_t size = 0;
  uint64_t bucket_offset = 0;
  uint32_t region = 0;
  uint64_t source_offset = 0;
};

// Source memory that a bucket's in-place entries lie in, and what kind of memory it is.
struct SourceRegion {
  RemoteRegion remote;
  MemoryKind memory = MemoryKind::kHost;
  bool operator==(const SourceRegion&) const = default;
};

enum class MessageType : uint8_t { kBucketReady = 1, kBucketDone = 2, kAbort = 3 };

// What a bucket holds: its chunks, in bucket order, and the source memory of those sent in place.
// A refit of the same model makes the same manifests, so they are shared (never changed once made)
// and replayed: the source sends bucket k's manifest once per connection and afterwards only says
// it is the one of bucket k of the refit before.
struct Manifest {
  std::vector<SourceRegion> regions;  // of the entries sent in place
  std::vector<ManifestEntry> entries;
};

// Where a destination finds the bytes of a bucket's entries once it has them.
struct BucketBytes {
  const std::byte* buffer = nullptr;  // the bucket's bytes: a local buffer, or the source's buffer mapped
  // The source memory of the manifest's regions, mapped (a link that maps it); empty where the
  // link reads what lies there into `buffer`.
  std::vector<const std::byte*> mapped_regions;

  bool in_region(const ManifestEntry& e) const { return e.region > 0 && !mapped_regions.empty(); }
  const std::byte* at(const ManifestEntry& e) const {
    return in_region(e) ? mapped_regions[e.region - 1] + e.source_offset : buffer + e.bucket_offset;
  }
};

// The ranges a destination reads for a bucket whose bytes it does not map: each entry's bytes,
// from the source's buffer or memory into `bucket_offset` of its own buffer, neighbours within a
// few KiB of each other (alignment padding, small pieces packed between large ones) joined into
// one read. Entries that the link maps are skipped.
struct BucketRead {
  uint32_t region = 0;  // 0: the source's buffer (at the bucket's offset)
  uint64_t source_offset = 0;
  uint64_t bucket_offset = 0;
  uint64_t size = 0;
};
std::vector<BucketRead> bucket_reads(const Manifest& manifest, SourceAccess access);
// Whether a chunk at `bucket_offset` of the bucket, whose bytes lie at `source_offset` of `region`,
// is read together with `last` (the rule of bucket_reads(), which a source follows to choose).
bool continues(const BucketRead& last, uint32_t region, uint64_t source_offset, uint64_t bucket_offset);

struct BucketReady {
  uint64_t refit = 0;   // refit number: first_refit() of the connection, plus one per refit
  uint64_t seq = 0;     // bucket number within the refit
  uint64_t offset = 0;  // where the bucket starts in the source's transfer region (metadata `buffers`)
  bool is_last = false;
  uint64_t used_bytes = 0;  // only this prefix of the buffer is read
  // With verify_checksums: bucket_checksum() of its entries.
  std::optional<uint64_t> checksum;
  // Set: the manifest is that of bucket `seq` of refit `replay_of` on this connection (which the
  // destination has), and is not on the wire; `manifest` is then null until the receiver fills it.
  std::optional<uint64_t> replay_of;
  std::shared_ptr<const Manifest> manifest = std::make_shared<const Manifest>();

  const std::vector<ManifestEntry>& entries() const { return manifest->entries; }
  const std::vector<SourceRegion>& regions() const { return manifest->regions; }
};

// The checksum a bucket carries with verify_checksums, computed alike by the source before it
// announces the bucket and by the destination before it loads it: xxh3-64 of each entry's bytes, in
// entry order, wherever they lie (`at(k)` gives entry k's): what the destination loads, not what
// happened to travel.
uint64_t bucket_checksum(const Manifest& m, const std::function<const std::byte*(size_t entry)>& at);

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
  // The sender left the connection (finalize, a new init, an init that failed, its engine's end):
  // this refit of it and every later one fail at once, rather than wait for their deadline.
  bool farewell = false;
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

// Whether `m` is for refit `refit` of the connection whose refits are numbered from `first_refit`:
// that refit's own messages, and a farewell sent at any refit of the connection. Anything else was
// left over from an earlier refit or connection.
bool concerns(const Message& m, uint64_t refit, uint64_t first_refit);

// Throws the error a peer's Abort (or farewell) stands for: its kind, naming the peer and what we
// waited for.
[[noreturn]] void raise_abort(const Abort& m, const std::string& who, const std::string& waiting_for);

// Checks a bucket against the link's bucket size, the source's buffer length and the way the link
// takes source memory: where it lies, used bytes, and every entry's ranges (box inside the tensor,
// chunk inside the piece, inside the bucket and its source region, sizes matching dtype x shape);
// entries in place only on a link that takes them; those in the bucket in bucket order, apart;
// every region is used.
void validate(const BucketReady& m, uint64_t bucket_bytes, uint64_t region_bytes, SourceAccess access,
              const std::string& who);

}  // namespace refit::protocol
