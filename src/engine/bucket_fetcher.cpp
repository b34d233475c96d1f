#include "engine/bucket_fetcher.h"

#include <spdlog/spdlog.h>

#include "core/fail.h"
#include "engine/bucket_checksum.h"
#include "engine/peer_wait.h"

namespace refit {
namespace {

using Seconds = std::chrono::duration<double>;

}  // namespace

BucketFetcher::BucketFetcher(FetchContext context) : context_(std::move(context)) {
  thread_ = std::thread([this] { run(); });
}

BucketFetcher::~BucketFetcher() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void BucketFetcher::run() {
  std::string phase;
  try {
    for (uint64_t seq = 0; fetch(seq, phase); ++seq) {
    }
    std::lock_guard lock(mutex_);
    finished_ = true;
  } catch (...) {
    std::lock_guard lock(mutex_);
    error_ = std::current_exception();
    error_phase_ = phase;
    finished_ = true;
  }
  notify();
}

void BucketFetcher::notify() {
  changed_.notify_all();
  if (context_.signal) context_.signal->notify();
}

bool BucketFetcher::wait_taken(Deadline deadline) {
  std::unique_lock lock(mutex_);
  if (!changed_.wait_until(lock, deadline, [&] { return stop_ || !ready_; }))
    fail(ErrorKind::kTimeout, "the loader did not take bucket {} within {} s", ready_ ? ready_->bucket.seq : 0,
         context_.timeout_s);
  return !stop_;
}

bool BucketFetcher::wait_released(uint64_t seq, Deadline deadline) {
  std::unique_lock lock(mutex_);
  if (!changed_.wait_until(lock, deadline, [&] { return stop_ || (released_ && *released_ >= seq); }))
    fail(ErrorKind::kTimeout, "the loader kept bucket {} for more than {} s", seq, context_.timeout_s);
  return !stop_;
}

void BucketFetcher::acknowledge(uint64_t seq, Deadline deadline) {
  context_.transport->send(context_.peer, protocol::encode(protocol::BucketDone{context_.refit, seq}), deadline);
}

std::vector<const std::byte*> BucketFetcher::map_regions(const protocol::BucketReady& bucket, const std::byte* data) {
  std::vector<const std::byte*> bases{data};
  if (!bucket.has_in_place_entries()) return bases;  // a bucket of spans has read its regions
  const auto& regions = bucket.regions();
  for (size_t k = 0; k < regions.size(); ++k) {
    const RemoteRegion& remote = regions[k].remote;
    auto [it, fresh] = context_.in_place_maps->try_emplace({remote.address, remote.key}, nullptr);
    if (fresh) {
      try {
        it->second = context_.transport->map(context_.peer, remote);
      } catch (...) {
        context_.in_place_maps->erase(it);
        throw;
      }
      if (it->second == nullptr) {
        context_.in_place_maps->erase(it);
        fail(ErrorKind::kTransport,
             "{} sent tensors in place (its own memory, {} bytes at 0x{:x}), but {} cannot map that memory here; set "
             "refit_cfg.nixl.direct_reads=false on the source",
             context_.peer_label, remote.length, remote.address, context_.transport->name());
      }
    }
    bases.push_back(it->second);
  }
  return bases;
}

uint64_t BucketFetcher::read_spans(const protocol::BucketReady& bucket, std::byte* local, Deadline deadline) {
  uint64_t bytes = 0;
  auto source_of = [&](const protocol::BucketSpan& span) {
    const bool own = span.region == 0;
    return Transport::ReadRange{own ? &context_.peer_metadata->buffers : &bucket.regions()[span.region - 1].remote,
                                own ? bucket.offset + span.bucket_offset : span.source_offset,
                                local + span.bucket_offset, span.size};
  };
  if (context_.transport->capabilities().batched_reads) {
    // One backend call for the whole bucket.
    std::vector<Transport::ReadRange> ranges;
    ranges.reserve(bucket.spans().size());
    for (const protocol::BucketSpan& span : bucket.spans()) {
      ranges.push_back(source_of(span));
      bytes += span.size;
    }
    context_.transport->wait_read(context_.transport->post_reads(context_.peer, ranges, context_.region, deadline),
                                  deadline);
    return bytes;
  }
  // Every span's read is in flight at once; one that fails stops the others.
  std::vector<ReadId> posted;
  posted.reserve(bucket.spans().size());
  size_t waited = 0;  // posted[waited..] are still in flight
  try {
    for (const protocol::BucketSpan& span : bucket.spans()) {
      const Transport::ReadRange r = source_of(span);
      posted.push_back(context_.transport->post_read(context_.peer, *r.remote, r.remote_offset, r.local,
                                                     context_.region, r.length, deadline));
      bytes += span.size;
    }
    while (waited < posted.size()) context_.transport->wait_read(posted[waited++], deadline);
  } catch (...) {
    for (size_t k = waited; k < posted.size(); ++k) {
      try {
        context_.transport->cancel_read(posted[k]);
      } catch (const std::exception& e) {
        spdlog::debug("cancelling a read from {}: {}", context_.peer_label, e.what());
      }
    }
    throw;
  }
  return bytes;
}

bool BucketFetcher::fetch(uint64_t seq, std::string& phase) {
  const auto deadline = deadline_after(Seconds(context_.timeout_s));
  const int local = static_cast<int>(seq % 2);
  const uint64_t region_bytes = context_.peer_metadata->buffers.length;
  const bool mapped = context_.mapped != nullptr;
  // Staged: the read refills the local buffer of bucket seq - 2, which the engine must have loaded.
  if (!mapped && seq >= 2) {
    phase = fmt::format("wait for the loader to finish bucket {}", seq - 2);
    if (!wait_released(seq - 2, deadline)) return false;
  }

  // The announcement is taken, checked, read or mapped while the engine still loads the bucket
  // before, so that the engine goes on to this one the moment it is done with that.
  phase = fmt::format("wait for bucket {}", seq);
  protocol::Message msg;
  while (true) {
    auto bytes = receive_watching(*context_.transport, context_.peer, context_.peer_label,
                                  context_.peer_metadata->process, deadline, [this] {
                                    std::lock_guard lock(mutex_);
                                    return stop_;
                                  });
    if (!bytes) return false;
    msg = protocol::decode_message(*bytes, context_.peer_label);
    if (msg.refit() == context_.refit) break;
    spdlog::debug("discarding a message of an earlier refit from {}", context_.peer_label);  // left by a failure
  }
  if (msg.type == protocol::MessageType::kAbort)
    protocol::raise_abort(msg.abort, context_.peer_label, fmt::format("bucket {}", seq));
  if (msg.type != protocol::MessageType::kBucketReady || msg.ready.seq != seq)
    fail(ErrorKind::kProtocol, "{} sent an unexpected message (type {}, bucket {}) instead of bucket {}",
         context_.peer_label, static_cast<int>(msg.type), msg.ready.seq, seq);
  protocol::validate(msg.ready, context_.bucket_bytes, region_bytes, context_.peer_label);
  context_.manifests->fill(msg.ready, context_.peer_label);
  context_.manifests->arrived(context_.refit, msg.ready);

  if (context_.verify_checksums != msg.ready.checksum.has_value())
    fail(ErrorKind::kConfig, "verify_checksums differs between {} ({}) and this destination ({})", context_.peer_label,
         msg.ready.checksum.has_value(), context_.verify_checksums);

  const auto read_start = Clock::now();
  const auto& bucket = msg.ready;
  const std::byte* data = context_.buffers[local];
  if (mapped && !bucket.spans().empty()) {
    fail(ErrorKind::kProtocol, "{} sent bucket {} to be read from its memory, but this destination maps its buffers",
         context_.peer_label, seq);
  } else if (mapped) {
    data = context_.mapped + bucket.offset;
  } else if (bucket.used_bytes > 0) {
    phase = bucket.spans().empty() ? fmt::format("read bucket {}", seq)
                                   : fmt::format("read bucket {} from the source's memory", seq);
    const double started = timeline_now();
    uint64_t bytes = bucket.used_bytes;
    if (bucket.spans().empty())
      context_.transport->read(context_.peer, context_.peer_metadata->buffers, bucket.offset, context_.buffers[local],
                               context_.region, bucket.used_bytes, deadline);
    else
      bytes = read_spans(bucket, context_.buffers[local], deadline);
    events_.push_back({TimelinePhase::kRead, context_.peer_rank, seq, started, timeline_now(), bytes,
                       static_cast<uint32_t>(bucket.entries().size())});
  }
  if (bucket.has_in_place_entries()) phase = fmt::format("map the source memory of bucket {}", seq);
  std::vector<const std::byte*> bases = map_regions(bucket, data);
  if (bucket.checksum) {
    phase = fmt::format("verify bucket {}", seq);
    const uint64_t actual = bucket_checksum(
        bucket, data, [&](size_t k) { return bases[bucket.entries()[k].region] + bucket.entries()[k].bucket_offset; });
    if (actual != *bucket.checksum)
      fail(ErrorKind::kIntegrity, "bucket {} from {} arrived corrupted: checksum {:016x}, sent {:016x} ({} bytes)", seq,
           context_.peer_label, actual, *bucket.checksum, bucket.used_bytes);
  }
  const bool acknowledge_once_loaded = mapped || bucket.has_in_place_entries();
  if (!acknowledge_once_loaded) {
    // The source may refill its buffer as soon as the bytes are here.
    acknowledge(seq, deadline);
    spdlog::debug("bucket {} from {}: {} bytes read in {:.4f}s", seq, context_.peer_label, bucket.used_bytes,
                  Seconds(Clock::now() - read_start).count());
  }
  const bool last = bucket.is_last;
  phase = fmt::format("wait for the loader to take bucket {}", seq);
  if (!wait_taken(deadline)) return false;
  {
    std::lock_guard lock(mutex_);
    ready_ = Fetched{std::move(msg.ready), std::move(bases)};
  }
  notify();
  // A bucket acknowledged only once loaded (mapped, or with entries in place) is acknowledged
  // after the engine released it, so that the source refills its buffer (or changes its tensors)
  // only then: the one before this, now, and the last before the refit ends (its source waits).
  if (unacknowledged_ && !acknowledge_released(*unacknowledged_, phase)) return false;
  if (acknowledge_once_loaded) unacknowledged_ = seq;
  if (!last) return true;
  if (unacknowledged_) acknowledge_released(*unacknowledged_, phase);
  return false;
}

bool BucketFetcher::acknowledge_released(uint64_t seq, std::string& phase) {
  phase = fmt::format("wait for the loader to finish bucket {}", seq);
  const auto deadline = deadline_after(Seconds(context_.timeout_s));  // a phase of its own
  if (!wait_released(seq, deadline)) return false;
  phase = fmt::format("acknowledge bucket {}", seq);
  acknowledge(seq, deadline);
  unacknowledged_.reset();
  return true;
}

std::optional<BucketFetcher::Fetched> BucketFetcher::try_next(std::string& phase) {
  std::unique_lock lock(mutex_);
  if (ready_) {
    Fetched out = std::move(*ready_);
    ready_.reset();
    lock.unlock();
    changed_.notify_all();
    return out;
  }
  rethrow_error(phase);
  return std::nullopt;
}

void BucketFetcher::finish(std::string& phase) {
  const auto deadline = deadline_after(Seconds(context_.timeout_s + 1));
  std::unique_lock lock(mutex_);
  if (!changed_.wait_until(lock, deadline, [&] { return finished_; }))
    fail(ErrorKind::kTimeout, "the fetch thread for {} did not finish in time", context_.peer_label);
  rethrow_error(phase);
}

void BucketFetcher::rethrow_error(std::string& phase) const {
  if (!error_) return;
  phase = error_phase_;
  std::rethrow_exception(error_);
}

void BucketFetcher::release(uint64_t seq) {
  {
    std::lock_guard lock(mutex_);
    released_ = seq;
  }
  notify();
}

}  // namespace refit
