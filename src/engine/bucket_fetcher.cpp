#include "engine/bucket_fetcher.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include "core/fail.h"
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
  changed_.notify_all();
}

bool BucketFetcher::fetch(uint64_t seq, std::string& phase) {
  const auto deadline = deadline_after(Seconds(context_.timeout_s));
  const int local = static_cast<int>(seq % 2);
  // Wait until the engine has loaded bucket seq - 2 (its buffer is ours again) and taken seq - 1.
  phase = fmt::format("wait for the loader to finish bucket {}", seq >= 2 ? seq - 2 : 0);
  {
    std::unique_lock lock(mutex_);
    auto free = [&] { return stop_ || (!ready_ && (seq < 2 || (released_ && *released_ + 2 >= seq))); };
    if (!changed_.wait_until(lock, deadline, free))
      fail(ErrorKind::kTimeout, "the loader kept bucket {} for more than {} s", seq - 2, context_.timeout_s);
    if (stop_) return false;
  }

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
  protocol::validate(msg.ready, context_.bucket_bytes, context_.peer_label);

  if (context_.verify_checksums != msg.ready.checksum.has_value())
    fail(ErrorKind::kConfig, "verify_checksums differs between {} ({}) and this destination ({})", context_.peer_label,
         msg.ready.checksum.has_value(), context_.verify_checksums);

  phase = fmt::format("read bucket {}", seq);
  const auto read_start = Clock::now();
  const auto& bucket = msg.ready;
  if (bucket.used_bytes > 0)
    context_.transport->read(context_.peer, context_.peer_metadata->buffers, bucket.buffer * context_.bucket_bytes,
                             context_.buffers[local], context_.region, bucket.used_bytes, deadline);
  if (bucket.checksum) {
    phase = fmt::format("verify bucket {}", seq);
    const uint64_t actual = XXH3_64bits(context_.buffers[local], bucket.used_bytes);
    if (actual != *bucket.checksum)
      fail(ErrorKind::kIntegrity, "bucket {} from {} arrived corrupted: checksum {:016x}, sent {:016x} ({} bytes)", seq,
           context_.peer_label, actual, *bucket.checksum, bucket.used_bytes);
  }
  // The source may refill its buffer as soon as the bytes are here.
  context_.transport->send(context_.peer, protocol::encode(protocol::BucketDone{context_.refit, seq}), deadline);
  spdlog::debug("bucket {} from {}: {} bytes read in {:.4f}s", seq, context_.peer_label, bucket.used_bytes,
                Seconds(Clock::now() - read_start).count());
  const bool more = !bucket.is_last;
  {
    std::lock_guard lock(mutex_);
    ready_ = Fetched{std::move(msg.ready), context_.buffers[local]};
  }
  changed_.notify_all();
  return more;
}

BucketFetcher::Fetched BucketFetcher::next(std::string& phase) {
  // The fetch thread ends each of its waits by its own deadline; this one only backs it up.
  const auto deadline = deadline_after(Seconds(2 * context_.timeout_s + 1));
  std::unique_lock lock(mutex_);
  if (!changed_.wait_until(lock, deadline, [&] { return ready_ || error_ || finished_; }))
    fail(ErrorKind::kTimeout, "the fetch thread for {} gave no bucket in time", context_.peer_label);
  if (ready_) {
    Fetched out = std::move(*ready_);
    ready_.reset();
    lock.unlock();
    changed_.notify_all();
    return out;
  }
  if (error_) {
    phase = error_phase_;
    std::rethrow_exception(error_);
  }
  fail(ErrorKind::kInternal, "the fetch thread for {} stopped early", context_.peer_label);
}

void BucketFetcher::release(uint64_t seq) {
  {
    std::lock_guard lock(mutex_);
    released_ = seq;
  }
  changed_.notify_all();
}

}  // namespace refit
