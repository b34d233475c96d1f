// Reads for backends whose copies complete before they return (a memcpy, a CUDA copy, an NCCL
// send/receive pair): post_read does the whole read, so test_read is true at once and
// cancel_read has nothing to stop; the read's error is kept and thrown by test_read/wait_read,
// as an asynchronous backend would. capabilities().async_reads is false for them.
#pragma once

#include <exception>
#include <map>
#include <mutex>

#include "core/fail.h"
#include "refit/ext/transport.h"

namespace refit {

class SynchronousReads : public Transport {
 public:
  ReadId post_read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                   uint64_t length, Deadline deadline) final {
    std::exception_ptr error;
    try {
      read_now(peer, remote, remote_offset, local, local_region, length, deadline);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kInvalidArgument) throw;  // the arguments, not the copy
      error = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    const ReadId id = next_++;
    done_.emplace(id, error);
    return id;
  }
  bool test_read(ReadId read) final {
    take(read);
    return true;
  }
  void wait_read(ReadId read, Deadline) final { take(read); }
  void cancel_read(ReadId read) final {
    std::lock_guard lock(mutex_);
    done_.erase(read);
  }

 protected:
  // The whole read, returning when the bytes are in local memory.
  virtual void read_now(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local,
                        RegionId local_region, uint64_t length, Deadline deadline) = 0;

 private:
  void take(ReadId read) {
    std::exception_ptr error;
    {
      std::lock_guard lock(mutex_);
      auto it = done_.find(read);
      if (it == done_.end()) fail(ErrorKind::kInvalidArgument, "read {} is not a posted read of this transport", read);
      error = it->second;
      done_.erase(it);
    }
    if (error) std::rethrow_exception(error);
  }

  std::mutex mutex_;
  std::map<ReadId, std::exception_ptr> done_;
  ReadId next_ = 1;
};

}  // namespace refit
