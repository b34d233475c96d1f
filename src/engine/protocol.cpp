#include "engine/protocol.h"

#include "core/fail.h"
#include "core/wire.h"

namespace refit::protocol {
namespace {

constexpr uint32_t kMetadataMagic = 0x4d544652;  // "RFTM"
constexpr uint32_t kMessageMagic = 0x47534d52;   // "RMSG"
constexpr uint64_t kMaxRank = 8;                 // dimensions of a tensor shape

void put_tensor(ByteWriter& w, const TensorInfo& t) {
  w.put_string(t.name);
  w.put<uint8_t>(static_cast<uint8_t>(t.dtype));
  w.put<uint64_t>(t.shape.size());
  for (int64_t d : t.shape) w.put<int64_t>(d);
}

TensorInfo get_tensor(ByteReader& r) {
  TensorInfo t;
  t.name = r.get_string("tensor name");
  auto code = r.get<uint8_t>("dtype");
  if (code >= kDTypeCount)
    fail(ErrorKind::kProtocol, "malformed {}: tensor '{}' has dtype code {}", r.what(), t.name, code);
  t.dtype = static_cast<DType>(code);
  uint64_t rank = r.get_count("shape rank", sizeof(int64_t));
  if (rank > kMaxRank)
    fail(ErrorKind::kProtocol, "malformed {}: tensor '{}' has {} dimensions", r.what(), t.name, rank);
  t.shape.resize(rank);
  for (auto& d : t.shape) {
    d = r.get<int64_t>("shape");
    if (d < 0) fail(ErrorKind::kProtocol, "malformed {}: tensor '{}' has a negative dimension", r.what(), t.name);
  }
  return t;
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

ByteWriter message_writer(MessageType type) {
  ByteWriter w;
  w.put<uint32_t>(kMessageMagic);
  w.put<uint32_t>(kVersion);
  w.put<uint8_t>(static_cast<uint8_t>(type));
  return w;
}

}  // namespace

Bytes encode(const EngineMetadata& m) {
  ByteWriter w;
  w.put<uint32_t>(kMetadataMagic);
  w.put<uint32_t>(m.version);
  w.put_bytes(m.session);
  w.put<uint64_t>(m.model_fingerprint);
  w.put<uint64_t>(m.bucket_bytes);
  w.put_string(m.transport_name);
  w.put_bytes(m.transport_address);
  w.put<uint64_t>(m.buffers.address);
  w.put<uint64_t>(m.buffers.length);
  w.put_bytes(m.buffers.key);
  w.put_bytes(m.layout);
  w.put_bytes(m.holds);
  w.put_string(m.process.boot_id);
  w.put<uint64_t>(m.process.namespaces);
  w.put_string(m.process.hostname);
  w.put<int32_t>(m.process.pid);
  w.put<uint64_t>(m.process.start_time);
  w.put<uint64_t>(m.generation);
  w.put<uint8_t>(m.takes);
  w.put<uint8_t>(static_cast<uint8_t>(m.delta));
  w.put<uint32_t>(static_cast<uint32_t>(m.weights_versions.size()));
  for (const auto& [rank, version] : m.weights_versions) {
    w.put<uint32_t>(rank);
    w.put<uint64_t>(version);
  }
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
  auto session = r.get_bytes("session");
  if (session.size() != m.session.size())
    fail(ErrorKind::kProtocol, "malformed {}: session id of {} bytes", who, session.size());
  std::copy(session.begin(), session.end(), m.session.begin());
  m.model_fingerprint = r.get<uint64_t>("model fingerprint");
  m.bucket_bytes = r.get<uint64_t>("bucket bytes");
  m.transport_name = r.get_string("transport name");
  auto address = r.get_bytes("transport address");
  m.transport_address.assign(address.begin(), address.end());
  m.buffers.address = r.get<uint64_t>("buffer address");
  m.buffers.length = r.get<uint64_t>("buffer length");
  auto key = r.get_bytes("buffer key");
  m.buffers.key.assign(key.begin(), key.end());
  if (m.buffers.length != 0 && (m.bucket_bytes > UINT64_MAX / 2 || m.buffers.length < 2 * m.bucket_bytes))
    fail(ErrorKind::kProtocol, "malformed {}: the transfer buffers hold {} bytes, less than two buckets of {}", who,
         m.buffers.length, m.bucket_bytes);
  auto layout = r.get_bytes("layout");
  m.layout.assign(layout.begin(), layout.end());
  auto holds = r.get_bytes("holds");
  m.holds.assign(holds.begin(), holds.end());
  m.process.boot_id = r.get_string("boot id");
  m.process.namespaces = r.get<uint64_t>("namespaces");
  m.process.hostname = r.get_string("hostname");
  m.process.pid = r.get<int32_t>("pid");
  m.process.start_time = r.get<uint64_t>("start time");
  m.generation = r.get<uint64_t>("generation");
  m.takes = r.get<uint8_t>("takes");
  if ((m.takes & ~(kTakesByMap | kTakesByRead)) != 0)
    fail(ErrorKind::kProtocol, "malformed {}: takes source memory in ways {:#x}", who, m.takes);
  const auto delta = r.get<uint8_t>("delta");
  if (delta > static_cast<uint8_t>(DeltaMode::kAuto))
    fail(ErrorKind::kProtocol, "malformed {}: delta = {}", who, delta);
  m.delta = static_cast<DeltaMode>(delta);
  const auto versions = r.get<uint32_t>("weights versions");
  for (uint32_t k = 0; k < versions; ++k) {
    const auto rank = r.get<uint32_t>("weights version's source rank");
    m.weights_versions.emplace_back(rank, r.get<uint64_t>("weights version"));
  }
  r.expect_end();
  return m;
}

Bytes encode(const BucketReady& m) {
  ByteWriter w = message_writer(MessageType::kBucketReady);
  w.put<uint64_t>(m.refit);
  w.put<uint64_t>(m.seq);
  w.put<uint64_t>(m.offset);
  w.put<uint8_t>(m.is_last ? 1 : 0);
  w.put<uint64_t>(m.used_bytes);
  w.put<uint8_t>(m.checksum ? 1 : 0);
  w.put<uint64_t>(m.checksum.value_or(0));
  w.put<uint8_t>(m.replay_of ? 1 : 0);
  w.put<uint64_t>(m.replay_of.value_or(0));
  if (m.replay_of) return w.take();
  const Manifest& manifest = *m.manifest;
  w.put<uint64_t>(manifest.regions.size());
  for (const auto& region : manifest.regions) {
    w.put<uint64_t>(region.remote.address);
    w.put<uint64_t>(region.remote.length);
    w.put_bytes(region.remote.key);
    w.put<uint8_t>(static_cast<uint8_t>(region.memory));
  }
  w.put<uint64_t>(manifest.entries.size());
  for (const auto& e : manifest.entries) {
    put_tensor(w, e.tensor);
    w.put<uint8_t>(e.box.count);
    for (int c = 0; c < e.box.count; ++c) {
      w.put<int32_t>(e.box.cuts[c].dim);
      w.put<int64_t>(e.box.cuts[c].start);
      w.put<int64_t>(e.box.cuts[c].length);
    }
    w.put<uint64_t>(e.tensor_offset);
    w.put<uint64_t>(e.size);
    w.put<uint64_t>(e.bucket_offset);
    w.put<uint32_t>(e.region);
    if (e.region > 0) w.put<uint64_t>(e.source_offset);
  }
  return w.take();
}

Bytes encode(const BucketDone& m) {
  ByteWriter w = message_writer(MessageType::kBucketDone);
  w.put<uint64_t>(m.refit);
  w.put<uint64_t>(m.seq);
  return w.take();
}

Bytes encode(const Abort& m) {
  ByteWriter w = message_writer(MessageType::kAbort);
  w.put<uint64_t>(m.refit);
  w.put<uint8_t>(static_cast<uint8_t>(m.kind));
  w.put_string(m.reason);
  return w.take();
}

Message decode_message(std::span<const uint8_t> bytes, const std::string& who) {
  ByteReader r(bytes, "message from " + who);
  if (r.get<uint32_t>("magic") != kMessageMagic) fail(ErrorKind::kProtocol, "garbled message from {} (bad magic)", who);
  auto version = r.get<uint32_t>("version");
  if (version != kVersion)
    fail(ErrorKind::kProtocol, "message from {} has protocol version {}, expected {}", who, version, kVersion);
  Message msg{};
  auto type = r.get<uint8_t>("type");
  switch (static_cast<MessageType>(type)) {
    case MessageType::kBucketReady: {
      msg.type = MessageType::kBucketReady;
      auto& m = msg.ready;
      m.refit = r.get<uint64_t>("refit");
      m.seq = r.get<uint64_t>("seq");
      m.offset = r.get<uint64_t>("offset");
      auto last = r.get<uint8_t>("is_last");
      if (last > 1) fail(ErrorKind::kProtocol, "garbled message from {}: is_last = {}", who, last);
      m.is_last = last == 1;
      m.used_bytes = r.get<uint64_t>("used bytes");
      auto has_checksum = r.get<uint8_t>("has checksum");
      if (has_checksum > 1) fail(ErrorKind::kProtocol, "garbled message from {}: has_checksum = {}", who, has_checksum);
      auto checksum = r.get<uint64_t>("checksum");
      if (has_checksum == 1) m.checksum = checksum;
      auto replayed = r.get<uint8_t>("replayed");
      if (replayed > 1) fail(ErrorKind::kProtocol, "garbled message from {}: replayed = {}", who, replayed);
      auto replay_of = r.get<uint64_t>("replay of");
      if (replayed == 1) {
        m.replay_of = replay_of;
        m.manifest = nullptr;
        break;
      }
      auto manifest = std::make_shared<Manifest>();
      // Smallest region: address, length, an empty key, memory kind.
      const uint64_t regions = r.get_count("region count", 8 + 8 + 8 + 1);
      manifest->regions.resize(regions);
      for (auto& region : manifest->regions) {
        region.remote.address = r.get<uint64_t>("region address");
        region.remote.length = r.get<uint64_t>("region length");
        auto key = r.get_bytes("region key");
        region.remote.key.assign(key.begin(), key.end());
        const auto memory = r.get<uint8_t>("region memory");
        if (memory > static_cast<uint8_t>(MemoryKind::kCuda))
          fail(ErrorKind::kProtocol, "garbled message from {}: memory kind {}", who, memory);
        region.memory = static_cast<MemoryKind>(memory);
      }
      // Smallest entry: empty name, dtype, rank 0, no cuts, three offsets, a region (0: no source offset).
      uint64_t n = r.get_count("entry count", 8 + 1 + 8 + 1 + 24 + 4);
      manifest->entries.reserve(n);
      for (uint64_t i = 0; i < n; ++i) {
        ManifestEntry e;
        e.tensor = get_tensor(r);
        e.box.count = r.get<uint8_t>("box cuts");
        if (e.box.count > Box::kMaxCuts)
          fail(ErrorKind::kProtocol, "garbled message from {}: tensor '{}' has a box of {} cuts", who, e.tensor.name,
               e.box.count);
        for (int c = 0; c < e.box.count; ++c) {
          e.box.cuts[c].dim = r.get<int32_t>("box dim");
          e.box.cuts[c].start = r.get<int64_t>("box start");
          e.box.cuts[c].length = r.get<int64_t>("box length");
        }
        e.tensor_offset = r.get<uint64_t>("tensor offset");
        e.size = r.get<uint64_t>("chunk size");
        e.bucket_offset = r.get<uint64_t>("bucket offset");
        e.region = r.get<uint32_t>("region");
        if (e.region > 0) e.source_offset = r.get<uint64_t>("source offset");
        manifest->entries.push_back(std::move(e));
      }
      m.manifest = std::move(manifest);
      break;
    }
    case MessageType::kBucketDone:
      msg.type = MessageType::kBucketDone;
      msg.done.refit = r.get<uint64_t>("refit");
      msg.done.seq = r.get<uint64_t>("seq");
      break;
    case MessageType::kAbort:
      msg.type = MessageType::kAbort;
      msg.abort.refit = r.get<uint64_t>("refit");
      {
        auto kind = r.get<uint8_t>("kind");
        if (kind > static_cast<uint8_t>(ErrorKind::kInternal))
          fail(ErrorKind::kProtocol, "garbled message from {}: error kind {}", who, kind);
        msg.abort.kind = static_cast<ErrorKind>(kind);
      }
      msg.abort.reason = r.get_string("reason");
      break;
    default:
      fail(ErrorKind::kProtocol, "garbled message from {}: unknown message type {}", who, type);
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

void raise_abort(const Abort& m, const std::string& who, const std::string& waiting_for) {
  fail(m.kind, "{} aborted the refit while we waited for {}: {}", who, waiting_for, m.reason);
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
