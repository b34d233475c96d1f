#include "baseline.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "refit/memory.h"

namespace refit::tools {
namespace {

double memcpy_rate(uint64_t bytes) {
  HostBuffer src(bytes), dst(bytes);
  std::memset(src.data(), 1, bytes);
  std::memset(dst.data(), 2, bytes);  // fault the pages in before timing
  std::vector<double> rates;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(bytes / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// Runs ucx_perftest server and client on loopback; returns the client's "Final:" line.
std::optional<double> perftest_get(uint64_t bytes, const std::string& tls, std::string& note) {
  const int port = 20000 + static_cast<int>(std::chrono::steady_clock::now().time_since_epoch().count() % 20000);
  const std::string env = tls.empty() ? "" : fmt::format("UCX_TLS={} ", tls);
  const std::string args = fmt::format("-t ucp_get -s {} -n 20 -w 3 -p {}", bytes, port);
  const std::string server = fmt::format("{}timeout 120 ucx_perftest {} >/dev/null 2>&1 &", env, args);
  const std::string client = fmt::format("{}timeout 120 ucx_perftest 127.0.0.1 {} 2>&1", env, args);
  note = client;
  if (std::system(server.c_str()) != 0) {
    note = "could not start ucx_perftest (install ucx-utils)";
    return std::nullopt;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  FILE* pipe = popen(client.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::array<char, 512> line;
  std::optional<double> mb_per_s;
  while (fgets(line.data(), line.size(), pipe) != nullptr) {
    // Final: iterations p50 avg overall bw_avg bw_overall ... (MB/s, MB = 2^20 bytes)
    double fields[7];
    if (std::sscanf(line.data(), " Final: %lf %lf %lf %lf %lf %lf %lf", &fields[0], &fields[1], &fields[2], &fields[3],
                    &fields[4], &fields[5], &fields[6]) == 7)
      mb_per_s = fields[5];
  }
  int rc = pclose(pipe);
  if (!mb_per_s) {
    note = fmt::format("ucx_perftest gave no result (exit {}): {}", rc, client);
    return std::nullopt;
  }
  return *mb_per_s * 1024 * 1024;
}

}  // namespace

Baseline measure_baseline(uint64_t bucket_bytes, const std::string& tls) {
  Baseline b;
  b.ucp_get_bytes_per_s = perftest_get(bucket_bytes, tls, b.ucp_get_note);
  b.memcpy_bytes_per_s = memcpy_rate(bucket_bytes);
  return b;
}

}  // namespace refit::tools
