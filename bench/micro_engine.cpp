// The engine's cost per tensor: one source and one destination engine over the in-process
// transport refit a model of many small tensors (DeepSeek-V3 ranks hold ~45k), with the loader
// an inference engine has (look the parameter up by name, copy into it), as `refit bench`'s
// destinations do. Reports the time per tensor of a whole refit, both engines' threads
// included; `refit bench` between processes gives the same figure over UCX
// (scripts/many_tensors.py writes such a model).
#include <benchmark/benchmark.h>

#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "core/name_index.h"
#include "refit/checkpoint_engine.h"
#include "transport/inproc/inproc_transport.h"

namespace {

using namespace refit;

struct Model {
  std::vector<TensorInfo> infos;
  std::vector<std::byte> bytes;
  std::vector<TensorView> views;
};

Model many_small_tensors(size_t count, size_t size) {
  Model m;
  m.infos.reserve(count);
  for (size_t i = 0; i < count; ++i)
    m.infos.push_back({"model.layers." + std::to_string(i / 100) + ".t" + std::to_string(i % 100) + ".weight",
                       DType::kUInt8,
                       {static_cast<int64_t>(size)}});
  m.bytes.resize(count * size);
  for (size_t i = 0; i < m.bytes.size(); ++i) m.bytes[i] = static_cast<std::byte>(i * 131 + 7);
  for (size_t i = 0; i < count; ++i) m.views.push_back({&m.infos[i], m.bytes.data() + i * size, MemoryKind::kHost});
  return m;
}

// range(0): tensors; range(1): 1 = direct reads (tensors in place), 0 = through buckets.
void BM_RefitManySmallTensors(benchmark::State& state) {
  const size_t count = static_cast<size_t>(state.range(0));
  const bool direct = state.range(1) != 0;
  constexpr size_t kTensorBytes = 1024;
  constexpr uint64_t kBucket = 16ull << 20;
  Model model = many_small_tensors(count, kTensorBytes);

  auto fabric = make_inproc_fabric();
  const SessionId session = new_session_id();
  auto options = [&] {
    EngineOptions o;
    o.bucket_bytes = kBucket;
    o.session = session;
    o.config.direct_reads = direct;
    o.transport = create_inproc_transport(fabric);
    return o;
  };
  CheckpointEngine source(options()), destination(options());
  std::vector<Metadata> md = {source.prepare(), destination.prepare()};
  source.init_source(0, 1, 1, md);
  destination.init_destination(0, 1, 1, md);
  if (direct) {
    // As a training framework that lets refit place its weights: one registration for all.
    std::byte* placed = source.allocate_weight_memory(model.bytes.size());
    std::memcpy(placed, model.bytes.data(), model.bytes.size());
    for (size_t i = 0; i < count; ++i) model.views[i].data = placed + i * kTensorBytes;
  }

  std::vector<std::byte> params(count * kTensorBytes);
  NameIndex by_name;  // parameter i is by_name's name i
  for (size_t i = 0; i < count; ++i) by_name.add(model.infos[i].name);
  const BatchLoader loader = [&](LoadBatch batch) {
    for (size_t i = 0; i < batch.size(); ++i) {
      if (i + 8 < batch.size()) by_name.prefetch(batch[i + 8].info->name);
      const auto p = by_name.find(batch[i].info->name);
      if (!p) throw std::runtime_error("no parameter " + batch[i].info->name);
      std::memcpy(params.data() + size_t{*p} * kTensorBytes, batch[i].data, batch[i].info->nbytes());
    }
  };

  for (auto _ : state) {
    auto sending = std::async(std::launch::async, [&] {
      ViewSource weights(model.views);
      return source.send(weights);
    });
    destination.receive(loader);
    sending.get();
  }
  if (std::memcmp(params.data(), model.bytes.data(), params.size()) != 0)
    state.SkipWithError("the destination's parameters differ from the source's tensors");
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * count));
  // Seconds per tensor (printed with an SI prefix: 1u is 1 microsecond).
  state.counters["per_tensor"] = benchmark::Counter(static_cast<double>(state.iterations() * count),
                                                    benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_RefitManySmallTensors)
    ->ArgsProduct({{50000}, {1, 0}})
    ->ArgNames({"tensors", "direct"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
