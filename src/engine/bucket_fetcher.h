// The destination's reading side of one link (one source), on a thread of its own: it waits for
// each bucket's announcement, validates it and hands the bucket's bytes to the engine's thread,
// which reassembles and loads them. A destination reading from several sources runs one fetcher
// per source, all reading at once; every fetcher wakes the same FetchSignal, so the engine's
// thread takes buckets from whichever link has one. Two ways:
//   - staged: the used bytes are read into one of the two local buffers and the bucket is
//     acknowledged at once, so the destination reads bucket k+1 while it loads bucket k, and the
//     source packs k+2 meanwhile;
//   - mapped (`mapped` is the source's buffers, mapped here by the transport): the engine loads
//     straight from the source's buffer, and the bucket is acknowledged once the engine released
//     it; the source packs k+1 while the destination loads k. One copy fewer per byte.
// Entries a source sent in place lie in its own memory: the fetcher maps those regions (once per
// link, kept across refits) and the bucket is acknowledged once loaded, whichever way. A bucket of
// spans (a source that lets us read its memory) is read span by span, all at once, into the
// local buffer, from the source's buffer or its memory, and is then like any staged bucket.
// A bucket whose manifest the source replays (BucketReady::replay_of) takes it from the link's
// ManifestCache: the manifests of the latest refit whose every bucket arrived.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/manifest_cache.h"
#include "engine/protocol.h"
#include "refit/timeline.h"
#include "refit/transport.h"

namespace refit {

// Wakes the engine's thread when any of its fetchers has news (a bucket, an error, the end).
class FetchSignal {
 public:
  void notify() {
    {
      std::lock_guard lock(mutex_);
      ++version_;
    }
    changed_.notify_all();
  }
  uint64_t version() {
    std::lock_guard lock(mutex_);
    return version_;
  }
  // Waits until the version moves past `seen` or the deadline passes.
  void wait(uint64_t seen, Deadline deadline) {
    std::unique_lock lock(mutex_);
    changed_.wait_until(lock, deadline, [&] { return version_ != seen; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t version_ = 0;
};

struct FetchContext {
  Transport* transport = nullptr;
  PeerId peer = 0;
  std::string peer_label;
  uint32_t peer_rank = 0;  // the source's rank, for timeline events
  const protocol::EngineMetadata* peer_metadata = nullptr;
  std::byte* buffers[2] = {};  // both inside `region`
  RegionId region = 0;
  const std::byte* mapped = nullptr;  // the source's transfer region, mapped; null: staged reads
  uint64_t bucket_bytes = 0;          // of this link (both sides derive it)
  uint64_t refit = 0;
  double timeout_s = 0;
  bool verify_checksums = false;
  FetchSignal* signal = nullptr;
  // The link's mappings of its source's memory for in-place entries, by (address, key); they
  // outlive the fetcher, which alone uses them while it runs.
  std::map<std::pair<uint64_t, Bytes>, const std::byte*>* in_place_maps = nullptr;
  ManifestCache* manifests = nullptr;  // the link's; only the fetcher uses it while it runs
};

class BucketFetcher {
 public:
  struct Fetched {
    protocol::BucketReady bucket;  // with its manifest (a replayed one's from the cache)
    // Where each region of the bucket's entries starts: [0] the used bytes (in a local buffer
    // until release()), [k] the source's memory of bucket.regions[k - 1], mapped.
    std::vector<const std::byte*> bases;
  };

  explicit BucketFetcher(FetchContext context);
  ~BucketFetcher();  // stops the thread; never waits longer than one poll slice
  BucketFetcher(const BucketFetcher&) = delete;
  BucketFetcher& operator=(const BucketFetcher&) = delete;

  // The next bucket, in order, if one is here; nothing when none is yet or after the last.
  // Rethrows the thread's error, setting `phase` to where it failed.
  std::optional<Fetched> try_next(std::string& phase);
  // The engine is done with bucket `seq`: its buffer may be refilled.
  void release(uint64_t seq);
  // After release() of the last bucket: waits until the thread has acknowledged everything and
  // stopped; rethrows its error.
  void finish(std::string& phase);
  const std::string& peer_label() const { return context_.peer_label; }
  // The reads of this refit (staged only); complete after finish().
  const std::vector<TimelineEvent>& events() const { return events_; }

 private:
  void run();
  // Fetches bucket `seq`; returns false after the last bucket or when stopped.
  bool fetch(uint64_t seq, std::string& phase);
  // Wait until the engine has taken the bucket handed out last, or has released bucket `seq`;
  // false when stopped.
  bool wait_taken(Deadline deadline);
  bool wait_released(uint64_t seq, Deadline deadline);
  void acknowledge(uint64_t seq, Deadline deadline);
  // Acknowledges bucket `seq` once the engine released it; false when stopped.
  bool acknowledge_released(uint64_t seq, std::string& phase);
  // Reads a bucket of spans into `local`, each from the source's buffer or its memory; returns the
  // bytes read.
  uint64_t read_spans(const protocol::BucketReady& bucket, std::byte* local, Deadline deadline);
  // Maps the bucket's source regions; returns every region's start (Fetched::bases).
  std::vector<const std::byte*> map_regions(const protocol::BucketReady& bucket, const std::byte* data);
  // Under mutex_: rethrows the thread's error, if any, setting `phase` to where it failed.
  void rethrow_error(std::string& phase) const;
  void notify();  // changed_ and the engine's signal

  FetchContext context_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<Fetched> ready_;      // fetched, not yet taken by next()
  std::optional<uint64_t> released_;  // highest bucket the engine is done with
  std::exception_ptr error_;
  std::string error_phase_;
  bool stop_ = false;
  bool finished_ = false;                   // the last bucket was fetched, or an error happened
  std::optional<uint64_t> unacknowledged_;  // thread only: handed out, acknowledged once released
  std::vector<TimelineEvent> events_;       // written by the thread only, read after finish()
  std::thread thread_;
};

}  // namespace refit
