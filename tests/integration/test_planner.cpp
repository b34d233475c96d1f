// The cluster planner end to end: `refit bench --json` records every bucket's events per refit
// and can write a calibration, and `refit plan --cluster` reads a cluster file (with that
// calibration), predicts refit's and the paired path, and writes the same kind of timeline.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "cli_runner.h"
#include "small_models.h"

namespace refit {
namespace {

using testing::kSmallMoe;
using testing::read_json;
using testing::run_cli;
using testing::TempDir;

TEST(Planner, BenchRecordsEveryBucketOfEveryWorkerAndWritesACalibration) {
  TempDir dir;
  const std::string model = dir.write("config.json", kSmallMoe);
  const std::string json = dir.file("run.json"), calibration = dir.file("calibration.json");
  auto r = run_cli({"bench", "--model", model, "--sources", "2", "--destinations", "2", "--refits", "3", "--json", json,
                    "refit_cfg.nixl.bucket_bytes=512KiB", "refit_cfg.nixl.timeout_s=20"},
                   120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto run = read_json(json);
  for (const auto& refit : run.at("refits")) {
    const double seconds = refit.at("seconds").get<double>();
    std::map<std::string, std::map<std::string, int>> phases;  // worker -> phase -> events
    std::set<std::pair<std::string, uint64_t>> announced;      // (source, bucket)
    for (const auto& e : refit.at("timeline")) {
      const double start = e.at("start").get<double>(), end = e.at("end").get<double>();
      EXPECT_LE(0.0, start);
      EXPECT_LE(start, end);
      EXPECT_LE(end, seconds);
      const std::string worker = e.at("worker").get<std::string>(), phase = e.at("phase").get<std::string>();
      ++phases[worker][phase];
      if (phase == "announce") announced.insert({worker, e.at("bucket").get<uint64_t>()});
    }
    ASSERT_EQ(phases.size(), 4u) << "every worker has events";
    for (const auto& [worker, counts] : phases) {
      if (worker.starts_with("source")) {
        EXPECT_GT(counts.at("pack"), 3) << worker;  // 512 KiB buckets of a 5 MiB model
        EXPECT_EQ(counts.at("pack"), counts.at("announce")) << worker;
        EXPECT_EQ(counts.at("pack"), counts.at("release")) << worker;
      } else {
        // Paired sources on the same host: destinations load from the mapped buffers.
        EXPECT_EQ(counts.at("load"), phases.at("source " + worker.substr(12)).at("pack")) << worker;
        EXPECT_EQ(counts.count("read"), 0u) << worker;
      }
    }
  }
  // One bucket larger than the model, on the bucket path: the source packs it, then the destination
  // loads it, so every copy runs alone and the run measures the engine's copy rate on one core.
  // A bench of one 64 MiB bucket per refit that writes the calibration.
  auto calibrate = [&](bool direct_reads) {
    return run_cli({"bench", "--model", model, "--refits", "3", "--calibration-out", calibration,
                    "refit_cfg.nixl.bucket_bytes=64MiB", "refit_cfg.nixl.timeout_s=20",
                    std::string("refit_cfg.nixl.direct_reads=") + (direct_reads ? "true" : "false")},
                   120);
  };
  auto c = calibrate(false);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  const auto cal = read_json(calibration);
  EXPECT_EQ(cal.at("engine_device").get<std::string>(), "cpu");
  EXPECT_GT(cal.at("engine_copy_bytes_per_s").get<double>(), 0) << cal.dump();
  EXPECT_FALSE(cal.contains("engine_node_copy_bytes_per_s")) << cal.dump();
  EXPECT_FALSE(cal.contains("latency_s")) << "one bucket per refit measures no hand-offs: " << cal.dump();
  EXPECT_GT(cal.at("overhead_s").get<double>(), 0);
  EXPECT_GT(cal.at("host_memory_bytes").get<double>(), 0);
  EXPECT_FALSE(cal.contains("host_copy_bytes_per_s"));  // only with --baseline
  EXPECT_FALSE(cal.contains("engine_in_place_copy_bytes_per_s")) << "the bucket path reads nothing in place";

  // The same on the default path: the destination reads every tensor in place, one group per
  // refit, which measures the in-place load rate and leaves the bucket path's values alone.
  auto d = calibrate(true);
  ASSERT_EQ(d.exit_code, 0) << d.output;
  const auto both = read_json(calibration);
  EXPECT_GT(both.at("engine_in_place_copy_bytes_per_s").get<double>(), 0) << both.dump();
  EXPECT_EQ(both.at("engine_copy_bytes_per_s"), cal.at("engine_copy_bytes_per_s"));
  EXPECT_EQ(both.at("overhead_s"), cal.at("overhead_s"));
  EXPECT_FALSE(both.contains("engine_in_place_copy_cost_s")) << "one group per refit measures no per-group cost";

  // A delta refit measures the source's comparing and the destination's patching of the changed
  // share (refits after the first), and leaves the copy rates alone.
  auto delta = [&](std::vector<std::string> extra) {
    std::vector<std::string> args{"bench",     "--model",
                                  model,       "--refits",
                                  "3",         "--changed",
                                  "0.05",      "--calibration-out",
                                  calibration, "refit_cfg.nixl.timeout_s=20"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(args, 120);
  };
  auto e = delta({"refit_cfg.nixl.delta=true"});
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const auto with_delta = read_json(calibration);
  const double model_bytes = with_delta.at("delta_bytes").get<double>();
  EXPECT_GT(model_bytes, 4 << 20);
  // Every tensor of the small MoE is bf16: 5% of its elements, up to one per tensor rounded away.
  EXPECT_NEAR(with_delta.at("delta_changes").get<double>(), 0.05 * model_bytes / 2, 0.001 * model_bytes);
  EXPECT_GT(with_delta.at("delta_compare_s").get<double>(), 0) << with_delta.dump();
  EXPECT_GT(with_delta.at("delta_patch_s").get<double>(), 0) << with_delta.dump();
  EXPECT_EQ(with_delta.at("engine_copy_bytes_per_s"), cal.at("engine_copy_bytes_per_s"));
  EXPECT_EQ(with_delta.at("engine_in_place_copy_bytes_per_s"), both.at("engine_in_place_copy_bytes_per_s"));
  // What cannot measure it is refused, naming why.
  auto whole = delta({"refit_cfg.nixl.delta=false"});
  EXPECT_NE(whole.exit_code, 0);
  EXPECT_NE(whole.output.find("no refit went as changes"), std::string::npos) << whole.output;
  auto many = delta({"refit_cfg.nixl.delta=true", "--sources", "2", "--destinations", "2"});
  EXPECT_NE(many.exit_code, 0);
  EXPECT_NE(many.output.find("one source into one destination"), std::string::npos) << many.output;
}

constexpr const char* kCluster = R"(
name: two-hosts
nodes:
  - {name: train, count: 2, workers: 2, device: cpu, cores: 4, copy: 5GB/s, nic: {rate: 10Gbit}}
  - {name: infer, count: 1, workers: 2, device: cpu, cores: 4, copy: 5GB/s, nic: {rate: 10Gbit}}
sources: {nodes: train, ranks: 4, parallel: {tp: 2, dp: 2}}
destinations: {nodes: infer, ranks: 2, parallel: {tp: 2, shard_dense: true}}
transfer: {bucket: 4MiB, latency: 50us, overhead: 1ms}
)";

TEST(Planner, PredictsBothPathsOfAClusterFileWithTheirTimelines) {
  TempDir dir;
  const std::string model = dir.write("config.json", kSmallMoe);
  const std::string cluster = dir.write("cluster.yaml", kCluster), json = dir.file("plan.json");
  auto r = run_cli({"plan", "--cluster", cluster, "--model", model, "--json", json}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("refit (resharding) path:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("paired (the reference's topology) path:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bound: "), std::string::npos) << r.output;
  const auto plan = read_json(json);
  const auto& refit = plan.at("prediction").at("refit");
  const auto& paired = plan.at("prediction").at("paired");
  EXPECT_GT(refit.at("seconds").get<double>(), 0);
  EXPECT_GT(paired.at("gather_seconds").get<double>(), 0);
  EXPECT_LT(refit.at("seconds").get<double>(), paired.at("seconds").get<double>());
  std::set<std::string> workers, phases;
  for (const auto& e : refit.at("timeline")) {
    workers.insert(e.at("worker").get<std::string>());
    phases.insert(e.at("phase").get<std::string>());
    EXPECT_LE(e.at("end").get<double>(), refit.at("seconds").get<double>());
  }
  EXPECT_EQ(workers.size(), 6u);
  // Across hosts the destinations read; nothing is mapped.
  EXPECT_EQ(phases, (std::set<std::string>{"pack", "announce", "read", "load", "release"}));
  bool gather = false;
  for (const auto& e : paired.at("timeline")) gather = gather || e.at("phase").get<std::string>() == "gather";
  EXPECT_TRUE(gather);
}

TEST(Planner, ABadClusterFileNamesTheKey) {
  TempDir dir;
  const std::string cluster = dir.write("cluster.yaml", std::string(kCluster) + "extra: 1\n");
  auto r = run_cli({"plan", "--cluster", cluster}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("unknown key 'extra'"), std::string::npos) << r.output;
  auto missing = run_cli({"plan", "--cluster", dir.file("nowhere.yaml")}, 60);
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("cannot read cluster file"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace refit
