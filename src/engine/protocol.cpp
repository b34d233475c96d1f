#include "engine/protocol.h"

#include <xxhash.h>

#include "core/fail.h"
#include "core/wire.h"
#include "core/wire_fields.h"

namespace refit::protocol {
namespace {

constexpr uint32_t kMetadataMagic = 0x4d544652;  // "RFTM"
constexpr uint32_t kMessageMagic = 0x47534d52;   // "RMSG"
constexpr uint64_t kMaxRank = 8;                 // dimensions of a tensor shape
static_assert((kTakesByMap | kTakesByRead) == 3, "EngineMetadata::takes is read as a number up to 3");

template <typename Io, typename M>  // M: EngineMetadata, const or not
void metadata_fields(Io& io, M& m) {
  io(m.session, "session");
  io(m.model_fingerprint, "model fingerprint");
  io(m.bucket_bytes, "bucket bytes");
  io(m.transport_name, "transport name");
  io(m.transport_address, "transport address");
  io(m.buffers.address, "buffer address");
  io(m.buffers.length, "buffer length");
  io(m.buffers.key, "buffer key");
  io(m.layout, "layout");
  io(m.holds, "holds");
  process_identity_fields(io, m.process);
  io(m.generation, "generation");
  io(m.takes, "takes", uint8_t{0}, static_cast<uint8_t>(kTakesByMap | kTakesByRead));
  io(m.delta, "delta", DeltaMode::kAuto);
  io.template items<uint32_t>(m.weights_versions, "weights versions", 4 + 8, [&](auto& v) {
    io(v.first, "weights version's source rank");
    io(v.second, "weights version");
  });
}

template <typename Io, typename M>  // M: Manifest, const or not
void manifest_fields(Io& io, M& m) {
  // Smallest region: address, length, an empty key, memory kind.
  io.template items<uint64_t>(m.regions, "regions", 8 + 8 + 8 + 1, [&](auto& region) {
    io(region.remote.address, "region address");
    io(region.remote.length, "region length");
    io(region.remote.key, "region key");
    io(region.memory, "region memory", MemoryKind::kCuda);
  });
  // Smallest entry: empty name, dtype, rank 0, no cuts, three offsets, a region (0: no source offset).
  io.template items<uint64_t>(m.entries, "entries", 8 + 1 + 8 + 1 + 24 + 4, [&](auto& e) {
    io(e.tensor.name, "tensor name");
    io(e.tensor.dtype, "dtype", static_cast<DType>(kDTypeCount - 1));
    io.template items<uint64_t>(
        e.tensor.shape, "shape rank", 8, [&](auto& d) { io(d, "dimension", int64_t{0}, INT64_MAX); }, kMaxRank);
    io(e.box.count, "box cuts", uint8_t{0}, static_cast<uint8_t>(Box::kMaxCuts));
    for (int c = 0; c < e.box.count; ++c) {
      io(e.box.cuts[c].dim, "box dim");
      io(e.box.cuts[c].start, "box start");
      io(e.box.cuts[c].length, "box length");
    }
    io(e.tensor_offset, "tensor offset");
    io(e.size, "chunk size");
    io(e.bucket_offset, "bucket offset");
    io(e.region, "region");
    if (e.region > 0) io(e.source_offset, "source offset");
  });
}

template <typename Io, typename M>  // M: BucketReady, const or not; the manifest follows unless replayed
void ready_fields(Io& io, M& m) {
  io(m.refit, "refit");
  io(m.seq, "seq");
  io(m.offset, "offset");
  io(m.is_last, "is_last");
  io(m.used_bytes, "used bytes");
  io(m.checksum, "checksum");
  io(m.replay_of, "replay of");
}

template <typename Io, typename M>
void done_fields(Io& io, M& m) {
  io(m.refit, "refit");
  io(m.seq, "seq");
}

template <typename Io, typename M>
void abort_fields(Io& io, M& m) {
  io(m.refit, "refit");
  io(m.kind, "kind", ErrorKind::kInternal);
  io(m.reason, "reason");
  io(m.farewell, "farewell");
}

// A control message of `type`: its header, then what `fields` writes.
template <typename F>
Bytes encode_message(MessageType type, F&& fields) {
  ByteWriter w;
  w.put<uint32_t>(kMessageMagic);
  w.put<uint32_t>(kVersion);
  w.put<uint8_t>(static_cast<uint8_t>(type));
  wire::Put put{w};
  fields(put);
  return w.take();
}

// nbytes without overflow: a garbled shape must not wrap around to a small size.
bool checked_nbytes(const TensorInfo& t, uint64_t* out) {
  uint64_t n = dtype_size(t.dtype);
  for (int64_t d : t.shape) {
    if (d != 0 && n > UINT64_MAX / static_cast<uint64_t>(d)) return false;
    n *= static_cast<uint64_t>(d);
  }
  *out = n;
  return true;
}

}  // namespace

Bytes encode(const EngineMetadata& m) {
  ByteWriter w;
  w.put<uint32_t>(kMetadataMagic);
  w.put<uint32_t>(m.version);
  wire::Put put{w};
  metadata_fields(put, m);
  return w.take();
}

EngineMetadata decode_metadata(std::span<const uint8_t> blob, const std::string& who) {
  ByteReader r(blob, who);
  if (r.get<uint32_t>("magic") != kMetadataMagic)
    fail(ErrorKind::kProtocol, "{} is not refit engine metadata (bad magic)", who);
  EngineMetadata m;
  m.version = r.get<uint32_t>("version");
  if (m.version != kVersion)
    fail(ErrorKind::kProtocol, "{} has protocol version {}, this engine speaks {}", who, m.version, kVersion);
  wire::Get get{r};
  metadata_fields(get, m);
  r.expect_end();
  if (m.buffers.length != 0 && (m.bucket_bytes > UINT64_MAX / 2 || m.buffers.length < 2 * m.bucket_bytes))
    fail(ErrorKind::kProtocol, "malformed {}: the transfer buffers hold {} bytes, less than two buckets of {}", who,
         m.buffers.length, m.bucket_bytes);
  return m;
}

Bytes encode(const BucketReady& m) {
  return encode_message(MessageType::kBucketReady, [&](wire::Put& put) {
    ready_fields(put, m);
    if (!m.replay_of) manifest_fields(put, *m.manifest);
  });
}

Bytes encode(const BucketDone& m) {
  return encode_message(MessageType::kBucketDone, [&](wire::Put& put) { done_fields(put, m); });
}

Bytes encode(const Abort& m) {
  return encode_message(MessageType::kAbort, [&](wire::Put& put) { abort_fields(put, m); });
}

Message decode_message(std::span<const uint8_t> bytes, const std::string& who) {
  ByteReader r(bytes, "message from " + who);
  if (r.get<uint32_t>("magic") != kMessageMagic) fail(ErrorKind::kProtocol, "garbled message from {} (bad magic)", who);
  auto version = r.get<uint32_t>("version");
  if (version != kVersion)
    fail(ErrorKind::kProtocol, "message from {} has protocol version {}, expected {}", who, version, kVersion);
  Message msg{};
  wire::Get get{r};
  get(msg.type, "type", MessageType::kAbort);
  switch (msg.type) {
    case MessageType::kBucketReady: {
      ready_fields(get, msg.ready);
      msg.ready.manifest = nullptr;  // a replay's is the one it repeats
      if (msg.ready.replay_of) break;
      auto manifest = std::make_shared<Manifest>();
      manifest_fields(get, *manifest);
      msg.ready.manifest = std::move(manifest);
      break;
    }
    case MessageType::kBucketDone:
      done_fields(get, msg.done);
      break;
    case MessageType::kAbort:
      abort_fields(get, msg.abort);
      break;
    default:
      fail(ErrorKind::kProtocol, "garbled message from {}: unknown message type {}", who, static_cast<int>(msg.type));
  }
  r.expect_end();
  return msg;
}

uint64_t first_refit(uint64_t source_generation, uint64_t destination_generation) {
  // splitmix64 finalizer over both: any change in either gives an unrelated number.
  uint64_t z = source_generation * 0x9E3779B97F4A7C15ull ^ destination_generation;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

SourceAccess link_access(uint8_t takes, bool same_host, const TransportCapabilities& caps) {
  if ((takes & kTakesByMap) != 0 && same_host && caps.maps_peer_memory) return SourceAccess::kMap;
  if ((takes & kTakesByRead) != 0 && caps.reads_registered_memory) return SourceAccess::kRead;
  return SourceAccess::kNone;
}

bool continues(const BucketRead& last, uint32_t region, uint64_t source_offset, uint64_t bucket_offset) {
  // Neighbours this close are read as one (the bytes between, alignment padding, come along).
  constexpr uint64_t kJoinGap = 4 << 10;
  const uint64_t end = last.bucket_offset + last.size;
  const uint64_t gap = bucket_offset - end;
  return last.size > 0 && last.region == region && bucket_offset >= end && gap <= kJoinGap &&
         source_offset == last.source_offset + last.size + gap;
}

std::vector<BucketRead> bucket_reads(const Manifest& manifest, SourceAccess access) {
  std::vector<BucketRead> reads;
  for (const ManifestEntry& e : manifest.entries) {
    if (e.size == 0 || (e.region > 0 && access == SourceAccess::kMap)) continue;
    const uint64_t from = e.region == 0 ? e.bucket_offset : e.source_offset;
    if (!reads.empty() && continues(reads.back(), e.region, from, e.bucket_offset)) {
      BucketRead& last = reads.back();
      last.size = e.bucket_offset + e.size - last.bucket_offset;
      continue;
    }
    reads.push_back({e.region, from, e.bucket_offset, e.size});
  }
  return reads;
}

uint64_t Message::refit() const {
  switch (type) {
    case MessageType::kBucketReady:
      return ready.refit;
    case MessageType::kBucketDone:
      return done.refit;
    case MessageType::kAbort:
      return abort.refit;
  }
  return 0;
}

bool concerns(const Message& m, uint64_t refit, uint64_t first_refit) {
  // A connection's refit numbers are first_refit + k, first_refit random per pair of metadata: one
  // that lies 2^32 refits from it is another connection's.
  constexpr uint64_t kRefitsOfAConnection = uint64_t{1} << 32;
  if (m.refit() == refit) return true;
  return m.type == MessageType::kAbort && m.abort.farewell && m.abort.refit - first_refit < kRefitsOfAConnection;
}

void raise_abort(const Abort& m, const std::string& who, const std::string& waiting_for) {
  if (m.farewell) fail(m.kind, "{} left this connection while we waited for {}: {}", who, waiting_for, m.reason);
  fail(m.kind, "{} aborted the refit while we waited for {}: {}", who, waiting_for, m.reason);
}

uint64_t bucket_checksum(const Manifest& m, const std::function<const std::byte*(size_t entry)>& at) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (size_t k = 0; k < m.entries.size(); ++k) XXH3_64bits_update(state, at(k), m.entries[k].size);
  const uint64_t sum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return sum;
}

Manifest& edit_manifest(BucketReady& bucket) {
  auto copy = std::make_shared<Manifest>(bucket.manifest ? *bucket.manifest : Manifest{});
  bucket.manifest = copy;
  return *copy;
}

void validate(const BucketReady& b, uint64_t bucket_bytes, uint64_t region_bytes, SourceAccess access,
              const std::string& who) {
  if (b.used_bytes > bucket_bytes)
    fail(ErrorKind::kProtocol, "bucket {} from {} uses {} bytes, more than the bucket size {}", b.seq, who,
         b.used_bytes, bucket_bytes);
  if (b.offset > region_bytes || b.used_bytes > region_bytes - b.offset)
    fail(ErrorKind::kProtocol, "bucket {} from {} at [{}, +{}) lies outside its {}-byte transfer buffers", b.seq, who,
         b.offset, b.used_bytes, region_bytes);
  if (!b.manifest) return;  // replayed: checked when it first came
  const Manifest& m = *b.manifest;
  std::vector<bool> used(m.regions.size(), false);
  uint64_t bucket_end = 0;  // of the chunk before that lies in the bucket
  for (const auto& e : m.entries) {
    uint64_t nbytes = 0;
    if (!checked_nbytes(e.tensor, &nbytes))
      fail(ErrorKind::kProtocol, "bucket {} from {}: tensor '{}' has an impossible shape {}", b.seq, who, e.tensor.name,
           shape_string(e.tensor.shape));
    const auto rank = static_cast<int32_t>(e.tensor.shape.size());
    for (int c = 0; c < e.box.count; ++c) {
      const Slice& cut = e.box.cuts[c];
      if (cut.dim < 0 || cut.dim >= rank || (c > 0 && cut.dim <= e.box.cuts[c - 1].dim) || cut.start < 0 ||
          cut.length < 0 || cut.start > e.tensor.shape[cut.dim] || cut.length > e.tensor.shape[cut.dim] - cut.start)
        fail(ErrorKind::kProtocol, "bucket {} from {}: the piece {} of tensor '{}' does not fit its shape {}", b.seq,
             who, to_string(e.box), e.tensor.name, shape_string(e.tensor.shape));
    }
    if (e.box.count > 0) nbytes = e.box.nbytes_in(e.tensor);  // the chunk lies in the piece
    if (e.size > nbytes || e.tensor_offset > nbytes - e.size)
      fail(ErrorKind::kProtocol, "bucket {} from {}: chunk [{}, +{}) lies outside tensor '{}' of {} bytes", b.seq, who,
           e.tensor_offset, e.size, e.tensor.name, nbytes);
    if (e.region > m.regions.size())
      fail(ErrorKind::kProtocol, "bucket {} from {}: chunk of '{}' names region {} of {}", b.seq, who, e.tensor.name,
           e.region, m.regions.size());
    if (e.region > 0) {
      if (access == SourceAccess::kNone)
        fail(ErrorKind::kProtocol,
             "bucket {} from {}: chunk of '{}' is in place (source region {}), but this link takes nothing from the "
             "source's memory",
             b.seq, who, e.tensor.name, e.region);
      used[e.region - 1] = true;
      const uint64_t limit = m.regions[e.region - 1].remote.length;
      if (e.source_offset > limit || e.size > limit - e.source_offset)
        fail(ErrorKind::kProtocol,
             "bucket {} from {}: chunk of '{}' at [{}, +{}) lies outside the {} bytes of source region {}", b.seq, who,
             e.tensor.name, e.source_offset, e.size, limit, e.region);
    }
    const bool in_bucket = e.region == 0 || access == SourceAccess::kRead;
    if (!in_bucket && e.bucket_offset != 0)
      fail(ErrorKind::kProtocol, "bucket {} from {}: chunk of '{}' is mapped in place but has bucket offset {}", b.seq,
           who, e.tensor.name, e.bucket_offset);
    if (in_bucket && (e.bucket_offset > b.used_bytes || e.size > b.used_bytes - e.bucket_offset))
      fail(ErrorKind::kProtocol, "bucket {} from {}: chunk of '{}' at [{}, +{}) lies outside the {} used bytes", b.seq,
           who, e.tensor.name, e.bucket_offset, e.size, b.used_bytes);
    // In bucket order, apart: each byte of the bucket is one chunk's (and is read once).
    if (in_bucket && e.size > 0) {
      if (e.bucket_offset < bucket_end)
        fail(ErrorKind::kProtocol,
             "bucket {} from {}: chunk of '{}' at [{}, +{}) overlaps the chunk before (ending at {})", b.seq, who,
             e.tensor.name, e.bucket_offset, e.size, bucket_end);
      bucket_end = e.bucket_offset + e.size;
    }
  }
  for (size_t k = 0; k < used.size(); ++k)
    if (!used[k])
      fail(ErrorKind::kProtocol, "bucket {} from {}: source region {} is used by no chunk", b.seq, who, k + 1);
}

}  // namespace refit::protocol
