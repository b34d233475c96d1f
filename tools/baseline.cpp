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

// What each row of a strided copy costs beyond its bytes: 256-byte rows out of a 512-byte pitch
// (a slice of a tensor's second dim), row by row as the engine copies them on a CPU.
double strided_row_cost(double memcpy_rate) {
  constexpr uint64_t kRow = 256, kRows = 1 << 18;
  HostBuffer src(2 * kRow * kRows), dst(kRow * kRows);
  std::memset(src.data(), 1, 2 * kRow * kRows);
  std::memset(dst.data(), 2, kRow * kRows);
  std::vector<double> costs;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t r = 0; r < kRows; ++r) std::memcpy(dst.data() + r * kRow, src.data() + 2 * r * kRow, kRow);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    costs.push_back(std::max(0.0, s - kRow * kRows / memcpy_rate) / kRows);
  }
  std::sort(costs.begin(), costs.end());
  return costs[costs.size() / 2];
}

// Every core copying its own buffers at once: the node's memory bandwidth for copies.
double all_cores_memcpy_rate(uint64_t bytes, unsigned threads) {
  const uint64_t each = std::max<uint64_t>(bytes / threads, 1 << 20);
  std::vector<double> rates;
  for (int round = 0; round < 3; ++round) {
    std::vector<std::thread> workers;
    std::vector<double> seconds(threads);
    for (unsigned t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        HostBuffer src(each), dst(each);
        std::memset(src.data(), 1, each);
        std::memset(dst.data(), 2, each);
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 3; ++i) std::memcpy(dst.data(), src.data(), each);
        seconds[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      });
    for (auto& w : workers) w.join();
    rates.push_back(3.0 * each * threads / *std::max_element(seconds.begin(), seconds.end()));
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// Runs ucx_perftest server and client on loopback; returns the client's "Final:" fields
// (iterations, typical and average latency in us, overall latency, average and overall bandwidth
// in MB/s of 2^20 bytes, message rate).
std::optional<std::array<double, 7>> perftest(const std::string& test, uint64_t bytes, int iterations,
                                              const std::string& tls, std::string& note) {
  const int port = 20000 + static_cast<int>(std::chrono::steady_clock::now().time_since_epoch().count() % 20000);
  const std::string env = tls.empty() ? "" : fmt::format("UCX_TLS={} ", tls);
  const std::string args = fmt::format("-t {} -s {} -n {} -w 3 -p {}", test, bytes, iterations, port);
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
  std::optional<std::array<double, 7>> out;
  while (fgets(line.data(), line.size(), pipe) != nullptr) {
    std::array<double, 7> f;
    if (std::sscanf(line.data(), " Final: %lf %lf %lf %lf %lf %lf %lf", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5],
                    &f[6]) == 7)
      out = f;
  }
  int rc = pclose(pipe);
  if (!out) note = fmt::format("ucx_perftest gave no result (exit {}): {}", rc, client);
  return out;
}

// ucp_get over TCP on loopback: the median of three runs (one run varies by 20%). None when a run
// gives no result.
std::optional<double> tcp_get_rate(uint64_t bytes) {
  std::vector<double> runs;
  std::string note;
  for (int run = 0; run < 3; ++run) {
    const auto f = perftest("ucp_get", bytes, 40, "tcp", note);
    if (!f) return std::nullopt;
    runs.push_back((*f)[5] * 1024 * 1024);
  }
  std::sort(runs.begin(), runs.end());
  return runs[1];
}

}  // namespace

Baseline measure_baseline(uint64_t bucket_bytes, const std::string& tls) {
  Baseline b;
  if (auto f = perftest("ucp_get", bucket_bytes, 20, tls, b.ucp_get_note))
    b.ucp_get_bytes_per_s = (*f)[5] * 1024 * 1024;
  const uint64_t tcp_bytes = std::min<uint64_t>(bucket_bytes, 16ull << 20);
  b.tcp_get_bytes_per_s = tcp_get_rate(tcp_bytes);
  std::string latency_note;
  if (auto f = perftest("tag_lat", 64, 20000, tls, latency_note)) b.message_latency_s = (*f)[1] * 1e-6;
  b.memcpy_bytes_per_s = memcpy_rate(bucket_bytes);
  b.row_cost_s = strided_row_cost(b.memcpy_bytes_per_s);
  b.cores = std::max(1u, std::thread::hardware_concurrency());
  b.all_cores_memcpy_bytes_per_s = all_cores_memcpy_rate(std::min<uint64_t>(bucket_bytes, 1ull << 30), b.cores);
  return b;
}

}  // namespace refit::tools
