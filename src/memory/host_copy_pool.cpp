#include "memory/host_copy_pool.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>

#include "core/fail.h"

namespace refit {
namespace {

constexpr int kMaxThreads = 8;      // by default
constexpr int kMaxEnvThreads = 64;  // when set
constexpr size_t kPartAlignment = 4096;

int default_threads() {
  if (const char* env = std::getenv("REFIT_HOST_COPY_THREADS")) {
    int threads = -1;
    const char* end = env + std::strlen(env);
    const auto [at, error] = std::from_chars(env, end, threads);
    if (error != std::errc() || at != end || threads < 0 || threads > kMaxEnvThreads)
      fail(ErrorKind::kConfig, "REFIT_HOST_COPY_THREADS='{}': expected a number of threads from 0 to {}", env,
           kMaxEnvThreads);
    return threads;
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return cores < 8 ? 0 : std::min(cores / 4, kMaxThreads);
}

}  // namespace

HostCopyPool::HostCopyPool(int threads) : threads_(threads < 0 ? default_threads() : threads) {}

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
  if (workers_.empty())
    for (int i = 0; i < threads_; ++i) workers_.emplace_back([this] { run(); });
  const size_t ways = static_cast<size_t>(threads_) + 1;
  const size_t part = (bytes / ways + kPartAlignment - 1) / kPartAlignment * kPartAlignment;
  auto* out = static_cast<std::byte*>(dst);
  const auto* in = static_cast<const std::byte*>(src);
  {
    std::lock_guard lock(mutex_);
    for (size_t begin = part; begin < bytes; begin += part) {
      const size_t size = std::min(part, bytes - begin);
      parts_.push_back([out, in, begin, size] { std::memcpy(out + begin, in + begin, size); });
      ++unfinished_;
    }
  }
  work_.notify_all();
  std::memcpy(out, in, std::min(part, bytes));  // the first part on this thread
  // Memory copies end on their own: no deadline is needed here.
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return unfinished_ == 0; });
}

}  // namespace refit
