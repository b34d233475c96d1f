// The reference's sharded-expert flow end to end over the engine: the destination describes its
// fused expert storage (EP rank 1 of 2), derives its layout from it, the source sends only the
// owned experts, and the direct-copy loader places them; everything else reaches the loader.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>

#include "engine_harness.h"
#include "refit/expert_loader.h"
#include "refit/layout_builders.h"
#include "refit/model.h"

namespace refit {
namespace {

using testing::inproc_options;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::VectorSource;

TEST(ShardedRefit, OwnedExpertsAreSentAndCopiedIntoFusedStorage) {
  const auto dir = std::filesystem::temp_directory_path() / ("refit-sharded-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": false})";
  const ModelInventory inventory = inventory_from_hf_config((dir / "config.json").string());
  std::filesystem::remove_all(dir);

  // EP rank 1 of 2 owns experts 4..7 in local slots 0..3; H = 16, I = 8.
  const int64_t E = 8, H = 16, I = 8;
  std::vector<int64_t> expert_map(E, -1);
  for (int64_t e = 4; e < 8; ++e) expert_map[e] = e - 4;
  std::vector<std::vector<std::byte>> memory;
  std::vector<ExpertStorage> storage;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".mlp.experts.routed_experts.";
    for (auto [name, shape] : {std::pair{prefix + "w13_weight", std::vector<int64_t>{4, 2 * I, H}},
                               std::pair{prefix + "w2_weight", std::vector<int64_t>{4, H, I}}}) {
      memory.emplace_back(4 * shape[1] * shape[2] * 2);
      ExpertStorage s;
      s.name = name;
      s.shape = shape;
      s.data = memory.back().data();
      s.use_ep = true;
      s.expert_map = expert_map;
      storage.push_back(s);
    }
  }
  const int rank = 0;
  CompactLayout compact = expert_layout_from_storage(storage, rank);
  Layout layout = layout_from_compact(compact, inventory, rank);

  auto fabric = make_inproc_fabric();
  auto session = new_session_id();
  auto dop = inproc_options(fabric, 1024, session);
  dop.layout = layout;
  CheckpointEngine source(inproc_options(fabric, 1024, session)), destination(dop);
  std::vector<Metadata> md = {source.prepare(), destination.prepare()};
  source.init_source(0, 1, 1, md);
  destination.init_destination(0, 1, 1, md);

  std::vector<OwnedTensor> weights;
  for (size_t i = 0; i < inventory.tensors.size(); ++i) {
    const auto& t = inventory.tensors[i];
    weights.push_back(make_tensor(t.name, t.dtype, t.shape, static_cast<uint32_t>(i + 1)));
  }
  ExpertLoader experts(inventory, storage, rank);
  std::map<std::string, std::vector<std::byte>> rest;
  uint64_t expert_tensors = 0;
  auto sent = std::async(std::launch::async, [&] {
    VectorSource src(weights);
    return source.send(src);
  });
  destination.receive([&](LoadBatch batch) {
    auto result = experts.load(batch);
    expert_tensors += result.experts;
    for (const auto& v : result.remaining) rest[v.info->name].assign(v.data, v.data + v.info->nbytes());
  });
  const SendStats stats = sent.get();

  // 2 layers x 4 owned experts x 3 projections; the other 4 experts of each layer never left.
  EXPECT_EQ(expert_tensors, 24u);
  EXPECT_EQ(stats.dropped, 24u);
  for (const auto& w : weights) {
    auto expert = parse_hf_expert_name(w.info.name);
    if (!expert) {
      EXPECT_EQ(rest.at(w.info.name), w.data) << w.info.name;
      continue;
    }
    EXPECT_EQ(rest.count(w.info.name), 0u) << w.info.name;
    if (expert->expert_id < 4) continue;
    const int64_t slot = expert->expert_id - 4;
    const int layer = std::stoi(w.info.name.substr(std::string("model.layers.").size()));
    const bool down = expert->shard == ExpertShard::kW2;
    const auto& mem = memory[2 * layer + (down ? 1 : 0)];
    const size_t bytes = w.data.size();
    const size_t slot_bytes = down ? H * I * 2 : 2 * I * H * 2;
    const size_t offset = slot * slot_bytes + (expert->shard == ExpertShard::kW3 ? bytes : 0);
    EXPECT_TRUE(std::equal(w.data.begin(), w.data.end(), mem.begin() + offset)) << w.info.name;
  }
}

}  // namespace
}  // namespace refit
