#include "transport/ucx/ucx_progress.h"

#include <poll.h>

#include "core/fail.h"

namespace refit {
namespace {

// Bounds a sleep even if an event is missed; also the cadence of keepalive checks when idle. Each
// wake costs a few microseconds: at 1 ms, 128 idle processes on one host took half a core.
constexpr int kSleepMs = 20;

}  // namespace

ProgressThread::ProgressThread(ucp_worker_h worker) : worker_(worker) {
  ucs_status_t status = ucp_worker_get_efd(worker_, &event_fd_);
  if (status != UCS_OK)
    fail(ErrorKind::kTransport, "cannot get the UCX worker's event fd: {}", ucs_status_string(status));
  thread_ = std::thread([this] { run(); });
}

ProgressThread::~ProgressThread() {
  stop_.store(true, std::memory_order_release);
  ucp_worker_signal(worker_);
  thread_.join();
}

ProgressThread::Busy::Busy(ProgressThread& thread) : thread_(thread) {
  if (thread_.busy_.fetch_add(1, std::memory_order_acq_rel) == 0) ucp_worker_signal(thread_.worker_);
}

ProgressThread::Busy::~Busy() { thread_.busy_.fetch_sub(1, std::memory_order_acq_rel); }

// Spins only while an operation of ours is in flight. It used to spin 200 us after any traffic too,
// to catch the next message of a burst without a wake-up: that bought nothing measurable on one
// link (refit bench 1 -> 1, in place and staged, 8 -> 1, 50,000 tensors: all within run-to-run
// spread) and with 256 sources into one destination on 2 cores the spinning processes starved the
// one with work (8-20 s a refit against 0.8-3 s).
void ProgressThread::run() {
  while (!stop_.load(std::memory_order_acquire)) {
    if (ucp_worker_progress(worker_) != 0) continue;
    if (busy_.load(std::memory_order_acquire) > 0) {
      // Yield so that the engine thread (or another process) gets the core and UCX's worker lock.
      std::this_thread::yield();
      continue;
    }
    // Arming fails with BUSY when events are pending: progress them first. Should it fail
    // otherwise, the poll timeout still bounds the sleep.
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    pollfd fd{event_fd_, POLLIN, 0};
    poll(&fd, 1, kSleepMs);
  }
}

}  // namespace refit
