#include "core/host_threads.h"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/fail.h"

namespace refit {

int host_copy_threads() {
  constexpr int kMaxEnvThreads = 64;
  if (const char* env = std::getenv("REFIT_HOST_COPY_THREADS")) {
    int threads = -1;
    const char* end = env + std::strlen(env);
    const auto [at, error] = std::from_chars(env, end, threads);
    if (error != std::errc() || at != end || threads < 0 || threads > kMaxEnvThreads)
      fail(ErrorKind::kConfig, "REFIT_HOST_COPY_THREADS='{}': expected a number of threads from 0 to {}", env,
           kMaxEnvThreads);
    return threads;
  }
  return host_pool_threads(static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace refit
