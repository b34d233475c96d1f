// Micro-benchmarks of delta refit's CPU work per tensor: the source's scan and record
// (encode_delta) and the destination's patch (apply_delta), on a 64 MiB bf16 tensor where a
// share of the elements (the argument, in 1/1000) moved by one unit in the last place, as an
// optimizer step moves them (docs/DELTA.md: 1.7% on the realistic workload); and a destination's
// decoding of a batch of GPU tensors' records into the page-locked arrays they cross to the GPU from.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "delta/codec.h"
#include "memory/host_copy_pool.h"
#include "refit/ext/tensor_memory.h"

namespace {

constexpr size_t kBytes = size_t{64} << 20;

struct Versions {
  std::vector<std::byte> base, now;
  explicit Versions(int64_t per_mille) : base(kBytes), now(kBytes) {
    std::mt19937_64 rng(7);
    for (size_t i = 0; i < kBytes; i += 8) {
      const uint64_t w = rng();
      std::memcpy(base.data() + i, &w, 8);
    }
    now = base;
    std::bernoulli_distribution changed(static_cast<double>(per_mille) / 1000.0);
    for (size_t i = 0; i < kBytes; i += 2)
      if (changed(rng)) {
        uint16_t v;
        std::memcpy(&v, now.data() + i, 2);
        v = static_cast<uint16_t>(v + ((rng() & 1) ? 1 : -1));
        std::memcpy(now.data() + i, &v, 2);
      }
  }
};

void BM_DeltaEncode(benchmark::State& state) {
  Versions v(state.range(0));
  std::vector<std::byte> base(kBytes);
  std::vector<uint8_t> record;
  refit::DeltaScratch scratch;
  for (auto _ : state) {
    state.PauseTiming();
    std::memcpy(base.data(), v.base.data(), kBytes);
    state.ResumeTiming();
    benchmark::DoNotOptimize(refit::encode_delta(base, v.now, 2, record, &scratch));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["record_bytes"] = static_cast<double>(record.size());
}
BENCHMARK(BM_DeltaEncode)->Arg(17)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

// The same scan in 16 MiB parts on this thread, joined (a large host tensor's path, whose parts
// run on the engine's pool): the word hash's cost against xxh3's, per byte of one core.
void BM_DeltaEncodeInParts(benchmark::State& state) {
  Versions v(state.range(0));
  std::vector<std::byte> base(kBytes);
  std::vector<uint8_t> record;
  constexpr size_t kPart = 16 << 20;
  std::vector<refit::DeltaScratch> found(kBytes / kPart);
  refit::DeltaScratch joined;
  for (auto _ : state) {
    state.PauseTiming();
    std::memcpy(base.data(), v.base.data(), kBytes);
    std::vector<refit::DeltaPart> parts;
    for (size_t at = 0; at < kBytes; at += kPart) parts.push_back({at, kPart, &found[at / kPart]});
    state.ResumeTiming();
    for (auto& part : parts)
      refit::scan_delta_part(std::span(base).subspan(part.first_byte, kPart),
                             std::span(v.now).subspan(part.first_byte, kPart), 2, part);
    benchmark::DoNotOptimize(refit::join_delta_parts(base, v.now, 2, parts, record, joined));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["record_bytes"] = static_cast<double>(record.size());
}
BENCHMARK(BM_DeltaEncodeInParts)->Arg(17)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

// The destination's patch: decode and apply. Second argument 1: in parts on a pool of the host's
// size (a destination's embedding or LM head, on a host of 8 cores or more).
void BM_DeltaApply(benchmark::State& state) {
  Versions v(state.range(0));
  std::vector<std::byte> base = v.base;
  std::vector<uint8_t> record;
  refit::encode_delta(base, v.now, 2, record);
  std::vector<std::byte> target(kBytes);
  refit::HostCopyPool pool(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 4));
  refit::DeltaForEach on_pool;
  if (state.range(1) == 1) on_pool = [&](size_t n, const std::function<void(size_t)>& body) { pool.for_each(n, body); };
  for (auto _ : state) {
    state.PauseTiming();
    std::memcpy(target.data(), v.base.data(), kBytes);
    state.ResumeTiming();
    benchmark::DoNotOptimize(refit::apply_delta(target, 2, record, "bench", on_pool));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["threads"] = on_pool ? pool.threads() + 1 : 1;
}
BENCHMARK(BM_DeltaApply)
    ->Args({17, 0})
    ->Args({2, 0})
    ->Args({17, 1})
    ->Args({2, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The record of changes a GPU kernel compacted (index, old and new bits): the host's share of a
// delta refit of GPU tensors.
void BM_DeltaRecordOfChanges(benchmark::State& state) {
  Versions v(state.range(0));
  std::vector<uint64_t> index, before, after;
  for (size_t i = 0; i < kBytes / 2; ++i) {
    uint16_t a, b;
    std::memcpy(&a, v.base.data() + 2 * i, 2);
    std::memcpy(&b, v.now.data() + 2 * i, 2);
    if (a == b) continue;
    index.push_back(i);
    before.push_back(a);
    after.push_back(b);
  }
  std::vector<uint8_t> record;
  for (auto _ : state)
    benchmark::DoNotOptimize(
        refit::encode_delta_changes(kBytes / 2, 2, index, before, after, refit::DeltaChecksum::kWords, 0, record));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["changes"] = static_cast<double>(index.size());
}
BENCHMARK(BM_DeltaRecordOfChanges)->Arg(17)->UseRealTime()->Unit(benchmark::kMillisecond);

// A destination's decoding of a batch of records for GPU tensors (decode_delta_into): the 64 MiB
// as 16 tensors of 4 MiB, each record's positions and new bits written into arrays of 64-bit
// words, on the caller and `threads` pool threads (second argument), into page-locked memory
// (third argument 1; plain host memory where no GPU is usable) or pageable vectors. The counter
// per_change_per_thread is the time each change took of one thread's: on a 16-core H100 host the
// engine's decoding measured about 12 ns; this bench, about 3.1 ns on one core of the 2-core VM
// (docs/DELTA.md). Run there, it separates the decoder's cost from the engine's around it.
void BM_DeltaDecodeInto(benchmark::State& state) {
  constexpr size_t kTensors = 16, kTensorBytes = kBytes / kTensors;
  Versions v(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const bool page_locked = state.range(2) == 1;
  std::vector<std::vector<uint8_t>> records(kTensors);
  uint64_t changes = 0;
  for (size_t t = 0; t < kTensors; ++t) {
    std::vector<std::byte> base(v.base.begin() + t * kTensorBytes, v.base.begin() + (t + 1) * kTensorBytes);
    const std::span<const std::byte> now(v.now.data() + t * kTensorBytes, kTensorBytes);
    refit::encode_delta(base, now, 2, records[t]);
    changes += refit::read_delta_header(records[t], "bench").changed;
  }
  const size_t array_bytes = std::max<uint64_t>(changes, 1) * sizeof(uint64_t);
  refit::TensorMemory locked_index, locked_values;
  std::vector<uint64_t> index, values;
  uint64_t* index_at;
  uint64_t* values_at;
  if (page_locked) {
    locked_index = refit::TensorMemory(refit::MemoryKind::kHost, refit::Device{}, array_bytes, /*pin=*/true);
    locked_values = refit::TensorMemory(refit::MemoryKind::kHost, refit::Device{}, array_bytes, /*pin=*/true);
    index_at = reinterpret_cast<uint64_t*>(locked_index.data());
    values_at = reinterpret_cast<uint64_t*>(locked_values.data());
  } else {
    index.resize(changes);
    values.resize(changes);
    index_at = index.data();
    values_at = values.data();
  }
  refit::HostCopyPool pool(threads);
  const refit::DeltaForEach on_pool = refit::parts_on(pool);
  std::vector<refit::RecordToDecode> batch;
  uint64_t first = 0;
  for (const auto& record : records) {
    const uint64_t n = refit::read_delta_header(record, "bench").changed;
    batch.push_back({record, 2, kTensorBytes, {index_at + first, n}, {values_at + first, n}, "bench", {}});
    first += n;
  }
  for (auto _ : state) refit::decode_delta_into(batch, on_pool);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["changes"] = static_cast<double>(changes);
  // Seconds of one thread per change: the threads' time over the changes decoded.
  state.counters["per_change_per_thread"] =
      benchmark::Counter(static_cast<double>(changes) / (threads + 1),
                         benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_DeltaDecodeInto)->ArgsProduct({{10}, {0, 3, 7, 11}, {0, 1}})->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
