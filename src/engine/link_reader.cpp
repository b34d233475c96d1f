#include "engine/link_reader.h"

#include <spdlog/spdlog.h>

#include "core/fail.h"
#include "engine/peer_wait.h"

namespace refit {

// Buckets a reader fetches ahead of the engine: two buffers.
constexpr size_t kReadAhead = 2;

LinkReader::LinkReader(Link& link, uint64_t refit) : link_(link), refit_(refit) {}

LinkReader::~LinkReader() {
  if (!reading_) return;
  for (ReadId read : reading_->posted) {
    try {
      link_.transport->cancel_read(read);
    } catch (const std::exception& e) {
      spdlog::debug("cancelling a read from {}: {}", link_.label, e.what());
    }
  }
}

bool LinkReader::advance() {
  bool moved = false;
  while (!done_) {
    if (reading_) {
      if (!reads_complete()) return moved;
      complete();
      moved = true;
      continue;
    }
    if (last_fetched_ || ready_.size() >= kReadAhead) return moved;
    // Staged: bucket next_ goes into the local buffer of bucket next_ - 2, which the engine must have loaded.
    if (link_.mapped == nullptr && next_ >= released_ + 2) {
      phase_ = fmt::format("wait for the loader to finish bucket {}", next_ - 2);
      return moved;
    }
    if (!take_announcement()) return moved;
    moved = true;
  }
  return moved;
}

bool LinkReader::take_announcement() {
  phase_ = fmt::format("wait for bucket {}", next_);
  if (!wait_deadline_) wait_deadline_ = link_.next_deadline();
  protocol::Message msg;
  while (true) {
    std::optional<Bytes> bytes = link_.transport->try_receive(link_.peer);
    if (!bytes) return false;
    msg = protocol::decode_message(*bytes, link_.label);
    if (protocol::concerns(msg, refit_, link_.first_refit)) break;
    spdlog::debug("discarding a message of an earlier refit from {}", link_.label);  // left by a failure
  }
  if (msg.type == protocol::MessageType::kAbort)
    protocol::raise_abort(msg.abort, link_.label, fmt::format("bucket {}", next_));
  if (msg.type != protocol::MessageType::kBucketReady || msg.ready.seq != next_)
    fail(ErrorKind::kProtocol, "{} sent an unexpected message (type {}, bucket {}) instead of bucket {}", link_.label,
         static_cast<int>(msg.type), msg.ready.seq, next_);
  protocol::validate(msg.ready, link_.bucket_bytes, link_.metadata.buffers.length, link_.access, link_.label);
  link_.manifests.take(refit_, msg.ready, link_.label);
  if (link_.verify_checksums != msg.ready.checksum.has_value())
    fail(ErrorKind::kConfig, "verify_checksums differs between {} ({}) and this destination ({})", link_.label,
         msg.ready.checksum.has_value(), link_.verify_checksums);
  start_reading(std::move(msg.ready));
  return true;
}

void LinkReader::start_reading(protocol::BucketReady bucket) {
  const uint64_t seq = bucket.seq;
  Reading& r = reading_.emplace();
  const bool mapped = link_.mapped != nullptr;
  r.data = mapped ? link_.mapped + bucket.offset : link_.buffers[seq % 2];
  // Mapped buffers: nothing to read (and a link that maps the buffers maps the source's memory too).
  if (mapped && link_.access == SourceAccess::kRead && !bucket.regions().empty())
    fail(ErrorKind::kProtocol, "{} sent bucket {} to be read from its memory, but this destination maps its buffers",
         link_.label, seq);
  const std::vector<protocol::BucketRead> reads =
      mapped ? std::vector<protocol::BucketRead>{} : protocol::bucket_reads(*bucket.manifest, link_.access);
  if (!reads.empty()) {
    phase_ = bucket.regions().empty() ? fmt::format("read bucket {}", seq)
                                      : fmt::format("read bucket {} from the source's memory", seq);
    r.started = timeline_now();
    std::byte* local = link_.buffers[seq % 2];
    std::vector<Transport::ReadRange> ranges;
    ranges.reserve(reads.size());
    for (const protocol::BucketRead& read : reads) {
      const bool buffer = read.region == 0;
      ranges.push_back({buffer ? &link_.metadata.buffers : &bucket.regions()[read.region - 1].remote,
                        buffer ? bucket.offset + read.source_offset : read.source_offset, local + read.bucket_offset,
                        read.size});
      r.bytes += read.size;
    }
    Transport& transport = *link_.transport;
    if (ranges.size() > 1 && transport.capabilities().batched_reads)  // one backend call for the whole bucket
      r.posted.push_back(transport.post_reads(link_.peer, ranges, link_.region, *wait_deadline_));
    else
      for (const Transport::ReadRange& range : ranges)
        r.posted.push_back(transport.post_read(link_.peer, *range.remote, range.remote_offset, range.local,
                                               link_.region, range.length, *wait_deadline_));
  }
  r.bucket = std::move(bucket);
}

bool LinkReader::reads_complete() {
  // Reads complete in any order; the ones complete leave the list (a read ends once tested true).
  std::erase_if(reading_->posted, [&](ReadId read) { return link_.transport->test_read(read); });
  return reading_->posted.empty();
}

void LinkReader::complete() {
  Reading r = std::move(*reading_);
  reading_.reset();
  const protocol::BucketReady& bucket = r.bucket;
  const uint64_t seq = bucket.seq;
  if (r.bytes > 0)
    events_.push_back({TimelinePhase::kRead, link_.peer_rank, seq, r.started, timeline_now(), r.bytes,
                       static_cast<uint32_t>(bucket.entries().size())});
  protocol::BucketBytes bytes{r.data, {}};
  if (link_.access == SourceAccess::kMap && !bucket.regions().empty()) {
    phase_ = fmt::format("map the source memory of bucket {}", seq);
    bytes.mapped_regions = map_regions(bucket);
  }
  if (bucket.checksum) {
    phase_ = fmt::format("verify bucket {}", seq);
    const uint64_t actual =
        protocol::bucket_checksum(*bucket.manifest, [&](size_t k) { return bytes.at(bucket.entries()[k]); });
    if (actual != *bucket.checksum)
      fail(ErrorKind::kIntegrity, "bucket {} from {} arrived corrupted: checksum {:016x}, sent {:016x} ({} bytes)", seq,
           link_.label, actual, *bucket.checksum, bucket.used_bytes);
  }
  // The source may refill its buffer as soon as the bytes are here, unless the engine loads from it.
  if (!loads_from_source(bytes)) acknowledge(seq);
  last_fetched_ = bucket.is_last;
  wait_deadline_.reset();
  ++next_;
  phase_ = fmt::format("hand bucket {} to the loader", seq);
  ready_.push_back(Fetched{std::move(r.bucket), std::move(bytes)});
}

std::vector<const std::byte*> LinkReader::map_regions(const protocol::BucketReady& bucket) {
  std::vector<const std::byte*> bases;
  for (const protocol::SourceRegion& region : bucket.regions()) {
    const RemoteRegion& remote = region.remote;
    auto it = link_.in_place_maps.find({remote.address, remote.key});
    if (it == link_.in_place_maps.end()) {
      const std::byte* mapped = link_.transport->map(link_.peer, remote);
      if (mapped == nullptr)
        fail(ErrorKind::kTransport,
             "{} sent tensors in place (its own memory, {} bytes at 0x{:x}), but {} cannot map that memory here; set "
             "refit_cfg.nixl.direct_reads=false on the source",
             link_.label, remote.length, remote.address, link_.transport->name());
      it = link_.in_place_maps.emplace(std::pair{remote.address, remote.key}, mapped).first;
    }
    bases.push_back(it->second);
  }
  return bases;
}

std::optional<LinkReader::Fetched> LinkReader::take() {
  if (ready_.empty()) return std::nullopt;
  Fetched out = std::move(ready_.front());
  ready_.pop_front();
  held_ = Held{out.bucket.seq, loads_from_source(out.bytes), out.bucket.is_last};
  return out;
}

void LinkReader::release(uint64_t seq) {
  if (!held_ || held_->seq != seq)
    fail(ErrorKind::kInternal, "released bucket {} from {}, which the engine did not hold", seq, link_.label);
  released_ = seq + 1;
  // The source refills its buffer (or changes its tensors) only once the engine is done with them.
  if (held_->acknowledge) acknowledge(seq);
  done_ = held_->last;
  held_.reset();
}

void LinkReader::acknowledge(uint64_t seq) {
  phase_ = fmt::format("acknowledge bucket {}", seq);
  link_.transport->send(link_.peer, protocol::encode(protocol::BucketDone{refit_, seq}), link_.next_deadline());
}

void LinkReader::check() {
  if (!wait_deadline_) return;
  if (expired(*wait_deadline_)) {
    if (reading_)
      fail(ErrorKind::kTimeout, "reading bucket {} from {} took more than timeout_s={} s", next_, link_.label,
           link_.timeout_s);
    fail(ErrorKind::kTimeout, "timed out waiting for bucket {} from {} (timeout_s={} s)", next_, link_.label,
         link_.timeout_s);
  }
  const auto now = Clock::now();
  if (now - last_liveness_check_ < kLivenessSlice) return;
  last_liveness_check_ = now;
  if (auto gone = gone_peer(link_.label, link_.metadata.process)) throw *gone;
}

LinkProgress::LinkProgress(Transport& transport) : transport_(transport) {
  thread_ = std::thread([this] { run(); });
}

LinkProgress::~LinkProgress() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  resumed_.notify_all();
  thread_.join();
}

void LinkProgress::resume(std::span<const std::unique_ptr<LinkReader>> readers) {
  {
    std::lock_guard lock(mutex_);
    readers_ = readers;
  }
  resumed_.notify_all();
}

void LinkProgress::pause(std::string& phase) {
  std::lock_guard lock(mutex_);
  readers_ = {};
  if (!error_) return;
  std::exception_ptr error = std::exchange(error_, nullptr);
  phase = error_phase_;
  std::rethrow_exception(error);
}

void LinkProgress::run() {
  std::unique_lock lock(mutex_);
  while (true) {
    resumed_.wait(lock, [&] { return stop_ || (!readers_.empty() && !error_); });
    if (stop_) return;
    const uint64_t seen = transport_.activity();
    bool moved = false;
    for (const auto& reader : readers_) {
      if (reader->done()) continue;
      try {
        moved = reader->advance() || moved;
      } catch (...) {
        error_ = std::current_exception();  // the engine's thread reports it at pause()
        error_phase_ = reader->phase();
        break;
      }
    }
    if (moved || error_) continue;
    // Nothing moved: wait for news without holding the readers from the engine's thread.
    lock.unlock();
    transport_.wait_activity(seen, deadline_after(kReceiveSlice));
    lock.lock();
  }
}

}  // namespace refit
