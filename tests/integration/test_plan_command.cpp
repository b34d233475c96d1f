// `refit plan`: what each destination would receive, sized for a target's memory, identical
// destinations on one row, and totals.
#include <gtest/gtest.h>

#include "cli_runner.h"

namespace refit {
namespace {

using testing::read_json;
using testing::run_cli;
using testing::TempDir;

TEST(PlanCommand, SizesForTheTargetAndCollapsesIdenticalDestinations) {
  TempDir dir;
  const std::string json = dir.file("plan.json");
  // The reference's setup scaled down (DeepSeek-V3's shapes in small: the whole model plans in
  // seconds even under the sanitizers): 8 destinations at TP8, sharded experts, 80 GiB GPUs.
  auto r = run_cli({"plan", "--model", std::string(REFIT_DATA_DIR) + "/models/deepseek-v3-mini", "--sources", "8",
                    "--destinations", "8", "--tp", "8", "refit_cfg.nixl.shard_expert_weights=true",
                    "refit_cfg.nixl.device=cuda", "--target-memory", "80GiB", "--json", json},
                   240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The 358 MiB model caps the 4096 MiB that 5% of an 80 GiB GPU would give.
  EXPECT_NE(r.output.find("Bucket size: 358 MiB per buffer (the model's size; 5.0% of 80.00 GiB minimum total GPU "
                          "memory would be 4096 MiB)"),
            std::string::npos)
      << r.output;
  // Every destination receives the same amounts: one row for all 8, then the totals.
  EXPECT_NE(r.output.find("0-7       0-7         0/0/0..7/0/0       449"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("total"), std::string::npos) << r.output;
  const auto plan = read_json(json);
  ASSERT_EQ(plan.at("destinations").size(), 8u);
  EXPECT_EQ(plan.at("destinations").at(5).at("tp_rank").get<int>(), 5);
  EXPECT_EQ(plan.at("destinations").at(5).at("tensors").get<uint64_t>(), 449u);
  EXPECT_EQ(plan.at("total").at("tensors").get<uint64_t>(), 8u * 449u);
  uint64_t payload = 0;
  for (const auto& d : plan.at("destinations")) payload += d.at("payload_bytes").get<uint64_t>();
  EXPECT_EQ(plan.at("total").at("payload_bytes").get<uint64_t>(), payload);
}

TEST(PlanCommand, StagesThatDifferGetRowsOfTheirOwn) {
  auto r = run_cli({"plan", "--sources", "4", "--destinations", "4", "--tp", "2", "--pp", "2", "--shard-dense"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("0-1       0-1         0/0/0..1/0/0       229"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("2-3       2-3         0/0/1..1/0/1       230"), std::string::npos) << r.output;
}

// As Megatron: without --src-dp the data-parallel size is --sources / (tp x pp), and the plan is
// the one an explicit --src-dp of that size gives (the same source rank order).
TEST(PlanCommand, TheSourceDataParallelSizeIsDerivedFromTheSourceCount) {
  TempDir dir;
  auto plan = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"plan",   "--sources",          "8", "--src-tp", "2", "--src-pp",
                                     "2",      "--destinations",     "2", "--tp",     "2", "--shard-dense",
                                     "--json", dir.file("plan.json")};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = run_cli(args, 60);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    auto transfers = read_json(dir.file("plan.json")).at("transfer_plan");
    transfers.erase("plan_seconds");
    return transfers;
  };
  const auto derived = plan({});
  EXPECT_EQ(derived.at("sources").size(), 8u);
  EXPECT_EQ(derived, plan({"--src-dp", "2"}));
}

TEST(PlanCommand, ABadTargetMemoryIsAnError) {
  auto r = run_cli({"plan", "--target-memory", "lots"}, 30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--target-memory must be a positive byte count"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace refit
