#include "memory/host_copy_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>

#include "core/host_threads.h"

namespace refit {
namespace {

constexpr size_t kPartAlignment = 4096;

}  // namespace

HostCopyPool::HostCopyPool(int threads) : threads_(threads < 0 ? host_copy_threads() : threads) {}

HostCopyPool::~HostCopyPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  for (auto& t : workers_) t.join();
}

void HostCopyPool::run() {
  std::unique_lock lock(mutex_);
  while (true) {
    work_.wait(lock, [&] { return stop_ || !parts_.empty(); });
    if (stop_) return;
    auto part = std::move(parts_.back());
    parts_.pop_back();
    lock.unlock();
    part();
    lock.lock();
    if (--unfinished_ == 0) done_.notify_all();
  }
}

void HostCopyPool::copy(void* dst, const void* src, size_t bytes) {
  if (threads_ == 0 || bytes < kMinParallelBytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const size_t ways = static_cast<size_t>(threads_) + 1;
  const size_t part = (bytes / ways + kPartAlignment - 1) / kPartAlignment * kPartAlignment;
  auto* out = static_cast<std::byte*>(dst);
  const auto* in = static_cast<const std::byte*>(src);
  for_each((bytes + part - 1) / part, [&](size_t k) {
    const size_t begin = k * part;
    std::memcpy(out + begin, in + begin, std::min(part, bytes - begin));
  });
}

void HostCopyPool::for_each(size_t count, const std::function<void(size_t)>& body) {
  if (threads_ == 0 || count <= 1) {
    for (size_t k = 0; k < count; ++k) body(k);
    return;
  }
  if (workers_.empty())
    for (int i = 0; i < threads_; ++i) workers_.emplace_back([this] { run(); });
  std::atomic<size_t> next{0};
  std::mutex failed_mutex;
  size_t failed_at = count;
  std::exception_ptr failure;
  auto work = [&] {
    for (size_t k; (k = next++) < count;) {
      try {
        body(k);
      } catch (...) {
        std::lock_guard lock(failed_mutex);
        if (k < failed_at) {
          failed_at = k;
          failure = std::current_exception();
        }
      }
    }
  };
  const size_t helpers = std::min<size_t>(static_cast<size_t>(threads_), count - 1);
  {
    std::lock_guard lock(mutex_);
    for (size_t t = 0; t < helpers; ++t) parts_.push_back(work);
    unfinished_ += helpers;
  }
  work_.notify_all();
  work();
  // The parts end on their own (copies, hashes): no deadline is needed here.
  {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return unfinished_ == 0; });
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace refit
