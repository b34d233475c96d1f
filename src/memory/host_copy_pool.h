// Large host-to-host copies on several cores. One core copies at a fraction of what the memory
// system gives (about 10 GB/s where all cores give 40+), and a destination that merges a tensor
// split over buckets, or a source packing host tensors, copies hundreds of megabytes at a time.
// A pool splits such a copy into parts, runs them on its threads and the caller's, and returns
// once all are done. Other work that goes in independent parts runs on it too (for_each: a delta
// destination's checksums of the tensors it holds). Its threads start on the first large copy; on small hosts (fewer
// than 8 cores, where the other processes of a refit need the cores) there are none and copies stay on the caller.
// REFIT_HOST_COPY_THREADS overrides the count (0: none).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace refit {

class HostCopyPool {
 public:
  // `threads`: the pool's threads besides the caller's; -1: from the host's cores (see above).
  // Throws Error(kConfig) naming REFIT_HOST_COPY_THREADS when it is set to anything but 0-64.
  explicit HostCopyPool(int threads = -1);
  ~HostCopyPool();  // joins the threads
  HostCopyPool(const HostCopyPool&) = delete;
  HostCopyPool& operator=(const HostCopyPool&) = delete;

  // memcpy(dst, src, bytes), split over the threads when it is large.
  void copy(void* dst, const void* src, size_t bytes);
  // body(k) for every k in [0, count), on the threads and the caller's, in no order; returns when
  // all are done, rethrowing the exception of the lowest k that threw.
  void for_each(size_t count, const std::function<void(size_t)>& body);
  int threads() const { return threads_; }

  // Copies smaller than this stay on the caller: splitting them costs more than it saves.
  static constexpr size_t kMinParallelBytes = size_t{32} << 20;

 private:
  void run();

  int threads_ = 0;
  std::vector<std::thread> workers_;  // started on the first large copy
  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::vector<std::function<void()>> parts_;  // waiting for a thread
  size_t unfinished_ = 0;                     // parts of the copy in progress not done yet
  bool stop_ = false;
};

}  // namespace refit
