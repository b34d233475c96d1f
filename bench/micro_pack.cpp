// Micro-benchmarks of the CPU work a refit does per byte besides the transfer itself: packing
// (memcpy into a bucket), reassembly copies, and the per-tensor hash `refit bench` verifies with.
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <cstring>

#include "refit/memory.h"
#include "refit/plan.h"

namespace {

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  refit::HostBuffer src(bytes), dst(bytes);
  std::memset(src.data(), 1, bytes);
  std::memset(dst.data(), 2, bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_Memcpy)->Arg(1 << 20)->Arg(64 << 20)->Arg(256 << 20)->UseRealTime();

void BM_Xxh3(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  refit::HostBuffer src(bytes);
  std::memset(src.data(), 3, bytes);
  for (auto _ : state) benchmark::DoNotOptimize(XXH3_64bits(src.data(), bytes));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_Xxh3)->Arg(64 << 20)->UseRealTime();

// Planning the default-sized DeepSeek-V3 stream (45k tensors) must stay negligible.
void BM_PlanManyTensors(benchmark::State& state) {
  std::vector<refit::TensorInfo> tensors;
  for (int i = 0; i < 45000; ++i)
    tensors.push_back({"model.layers." + std::to_string(i / 700) + ".mlp.experts." + std::to_string(i % 700) + ".w",
                       refit::DType::kBFloat16,
                       {2048, 7168}});
  for (auto _ : state) benchmark::DoNotOptimize(refit::plan_buckets(tensors, 4ull << 30));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * tensors.size()));
}
BENCHMARK(BM_PlanManyTensors)->Unit(benchmark::kMillisecond);

}  // namespace
