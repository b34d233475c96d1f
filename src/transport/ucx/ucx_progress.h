// Drives one UCP worker from a dedicated thread. UCX 1.13 emulates RMA over active messages on
// memory it did not allocate, so a read's TARGET must progress even while its engine thread is
// blocked elsewhere; keepalive and peer-failure detection need progress too. The thread spins
// while operations of ours are outstanding and otherwise sleeps on the worker's event fd, so that
// a transport waiting for its peer does not take one of the host's few cores.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <thread>

namespace refit {

class ProgressThread {
 public:
  // The worker must have been created with UCP_FEATURE_WAKEUP and UCS_THREAD_MODE_MULTI.
  explicit ProgressThread(ucp_worker_h worker);
  ~ProgressThread();  // stops and joins the thread
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Keeps the thread spinning while an operation is outstanding: construct it when a post
  // returned a request still in flight.
  class Busy {
   public:
    explicit Busy(ProgressThread& thread);
    ~Busy();
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    ProgressThread& thread_;
  };

 private:
  void run();

  ucp_worker_h worker_;
  int event_fd_ = -1;
  std::atomic<int> busy_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace refit
