// The destination's reading side of one link (one source). It has no thread: the engine's one
// receive loop advances every link's reader in turn (advance() never waits), takes buckets from
// whichever has one, and sleeps on the transport's activity count when none moved; while the
// loader holds a batch, LinkProgress's one thread does the same. So a destination reading from
// hundreds of sources runs two threads, and reads stay in flight on all of them while the loader
// works. For each bucket, in order, a reader
//   - waits for its buffer (staged: bucket k goes where bucket k - 2 was, which must be released);
//   - takes the announcement, validates it, and replays its manifest from the link's
//     ManifestCache when the source names a bucket of the refit before;
//   - reads the bucket's entries from the source's buffer, and from its memory those it leaves in
//     place on a link that reads them, into the local buffer (protocol::bucket_reads), all at once;
//     or nothing from the buffer when it is mapped (the engine loads straight from it); on a link
//     that maps, it maps the source memory of entries sent in place (once per link);
//   - verifies the checksum and hands the bucket out (at most two ahead of the engine);
//   - acknowledges it: at once when its bytes are here (staged, so the source refills that buffer
//     while the destination loads), or once released when the engine loads from the source's
//     memory (mapped, in place).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/link.h"
#include "engine/protocol.h"
#include "refit/ext/transport.h"
#include "refit/timeline.h"

namespace refit {

// The longest the receive loop sleeps (on either thread) before it looks at its links again,
// when no news woke it first: readers' deadlines and liveness, and stopping LinkProgress.
inline constexpr auto kReceiveSlice = std::chrono::milliseconds(20);

class LinkReader {
 public:
  struct Fetched {
    protocol::BucketReady bucket;  // with its manifest (a replayed one's from the cache)
    protocol::BucketBytes bytes;   // where its entries lie (a local buffer: until release())
  };

  // Reads refit `refit` (its wire number) of `link`, which outlives the reader.
  LinkReader(Link& link, uint64_t refit);
  ~LinkReader();  // cancels reads still in flight: nothing lands in the buffers afterwards
  LinkReader(const LinkReader&) = delete;
  LinkReader& operator=(const LinkReader&) = delete;

  // Moves on as far as it can without waiting; true when anything changed. Throws the link's
  // error (phase() says where).
  bool advance();
  // The next bucket, in order, once it is here and checked; nothing when none is yet.
  std::optional<Fetched> take();
  // The engine is done with bucket `seq`, the one it took last.
  void release(uint64_t seq);
  // Throws Error(kTimeout) when what the reader waits for (an announcement, a read) is overdue,
  // Error(kPeerLost) when the source's process on this host is gone.
  void check();
  // The deadline of what the reader waits for, if it waits for its source.
  std::optional<Deadline> deadline() const { return wait_deadline_; }
  // The last bucket was released and acknowledged.
  bool done() const { return done_; }
  const std::string& phase() const { return phase_; }
  // The reads of this refit.
  const std::vector<TimelineEvent>& events() const { return events_; }

 private:
  // A bucket whose announcement is here and whose reads are in flight.
  struct Reading {
    protocol::BucketReady bucket;
    const std::byte* data = nullptr;  // the bucket's bytes: a local buffer, or the source's mapped
    std::vector<ReadId> posted;       // not yet complete
    uint64_t bytes = 0;               // read in all
    double started = 0;               // on the timeline
  };

  // Takes the next message if one is here; false when none is.
  bool take_announcement();
  // Posts the reads of an announced bucket.
  void start_reading(protocol::BucketReady bucket);
  // True once every read of the bucket in flight is complete.
  bool reads_complete();
  // Maps, verifies and hands out the bucket whose bytes are here.
  void complete();
  // The source memory of the bucket's entries in place, mapped (cached for the link).
  std::vector<const std::byte*> map_regions(const protocol::BucketReady& bucket);
  // Whether the engine loads the bucket from the source's memory (so it is acknowledged once released).
  bool loads_from_source(const protocol::BucketBytes& bytes) const {
    return link_.mapped != nullptr || !bytes.mapped_regions.empty();
  }
  void acknowledge(uint64_t seq);

  Link& link_;
  const uint64_t refit_;
  std::string phase_ = "wait for bucket 0";
  uint64_t next_ = 0;               // the bucket to fetch next
  bool last_fetched_ = false;       // the last bucket was announced
  std::optional<Reading> reading_;  // bucket next_, announced
  std::deque<Fetched> ready_;       // fetched, not yet taken
  struct Held {
    uint64_t seq = 0;
    bool acknowledge = false;  // once released (the engine loads from the source's memory)
    bool last = false;
  };
  std::optional<Held> held_;               // taken, not yet released
  uint64_t released_ = 0;                  // one past the latest bucket the engine is done with
  std::optional<Deadline> wait_deadline_;  // of bucket next_'s announcement and reads
  Clock::time_point last_liveness_check_{};
  bool done_ = false;
  std::vector<TimelineEvent> events_;
};

// Moves the links on while the engine's thread is away in the loader: one thread per engine
// (however many links it has) advances every reader between resume() and pause(), so that reads
// complete and are acknowledged (the source refills its buffer meanwhile) and the next ones are
// posted. Only one of the two threads touches the readers at a time: this one between resume()
// and pause(), the engine's otherwise.
class LinkProgress {
 public:
  explicit LinkProgress(Transport& transport);
  ~LinkProgress();  // stops the thread
  LinkProgress(const LinkProgress&) = delete;
  LinkProgress& operator=(const LinkProgress&) = delete;

  // Hands `readers` to the thread until pause().
  void resume(std::span<const std::unique_ptr<LinkReader>> readers);
  // Takes them back; once it returns the thread no longer touches them. Rethrows what a reader
  // threw meanwhile, setting `phase` to where.
  void pause(std::string& phase);

 private:
  void run();

  Transport& transport_;
  std::mutex mutex_;  // held while the thread advances the readers
  std::condition_variable resumed_;
  std::span<const std::unique_ptr<LinkReader>> readers_;  // empty while paused
  bool stop_ = false;
  std::exception_ptr error_;
  std::string error_phase_;
  std::thread thread_;
};

}  // namespace refit
