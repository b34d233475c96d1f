// The cluster description (cluster.h) and the planner's model of a refit (prediction.h): files are
// read strictly, and the model reproduces what a pipeline of known rates must take.
#include "refit/cluster.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error_of.h"
#include "refit/prediction.h"

namespace refit {
namespace {

using ::testing::AllOf;
using testing::error_of;
using ::testing::HasSubstr;

constexpr const char* kTwoNodes = R"(
name: two-nodes
nodes:
  - name: train
    count: 2
    workers: 2
    device: gpu
    nic: {rails: 2, rate: 400Gbit}
    nvlink: 450GB/s
    copy: 2000GB/s
    memory: 80GiB
  - {name: rollout, count: 1, workers: 4, device: gpu, nic: {rate: 100Gbit}, nvlink: 450GB/s, copy: 2000GB/s}
sources: {nodes: train, ranks: 4, parallel: {tp: 2, dp: 2}}
destinations: {nodes: rollout, ranks: 4, parallel: {tp: 4, shard_dense: true}}
transfer: {bucket: 1GiB, transport: ucx, latency: 20us, overhead: 2ms}
)";

TEST(Cluster, ReadsNodesSidesAndRatesWithUnits) {
  const Cluster c = parse_cluster(kTwoNodes, "test.yaml");
  EXPECT_EQ(c.name, "two-nodes");
  ASSERT_EQ(c.groups.size(), 2u);
  const NodeGroup& train = c.group("train");
  EXPECT_EQ(train.count, 2);
  EXPECT_TRUE(train.gpu);
  EXPECT_EQ(train.gpus, 2);  // default: one per worker
  EXPECT_EQ(train.rails, 2);
  EXPECT_DOUBLE_EQ(train.rail_rate, 50e9);  // 400 Gbit/s
  EXPECT_DOUBLE_EQ(train.nvlink_rate, 450e9);
  EXPECT_EQ(train.memory, 80ull << 30);
  EXPECT_TRUE(train.nic_per_worker);
  EXPECT_EQ(c.sources.parallel.at("tp"), 2);
  EXPECT_EQ(c.sources.parallel.at("dp"), 2);
  EXPECT_TRUE(c.destinations.shard_dense);
  EXPECT_EQ(c.transfer.bucket_bytes, 1ull << 30);
  EXPECT_DOUBLE_EQ(c.transfer.latency_s, 20e-6);
  EXPECT_DOUBLE_EQ(c.transfer.overhead_s, 2e-3);
  EXPECT_EQ(c.sources.first_slot, 0);
  EXPECT_EQ(c.destinations.first_slot, 0);  // another group
}

TEST(Cluster, SidesOnOneGroupArePlacedOneAfterTheOther) {
  const Cluster c = parse_cluster(R"(
nodes: [{name: host, workers: 8, device: cpu}]
sources: {nodes: host, ranks: 3}
destinations: {nodes: host, ranks: 2}
)",
                                  "x");
  EXPECT_EQ(c.destinations.first_slot, 3);
  EXPECT_EQ(c.transfer.transport, "ucx");
  EXPECT_FALSE(c.groups[0].nic_per_worker);  // CPU nodes: one NIC per node
}

TEST(Cluster, MistakesAreNamedWithTheirKey) {
  auto err = [](const std::string& yaml) {
    return error_of(ErrorKind::kConfig, [&] { parse_cluster(yaml, "c.yaml"); });
  };
  const std::string base = "nodes: [{name: n, workers: 4, device: cpu}]\n";
  EXPECT_THAT(
      err(base + "sources: {nodes: n, ranks: 1}\ndestinations: {nodes: n, ranks: 1}\ntransfer: {buckt: 1GiB}\n"),
      AllOf(HasSubstr("c.yaml"), HasSubstr("unknown key 'transfer.buckt'")));
  EXPECT_THAT(err(base + "sources: {nodes: m, ranks: 1}\ndestinations: {nodes: n, ranks: 1}\n"),
              AllOf(HasSubstr("no node group named 'm'"), HasSubstr("groups: n")));
  EXPECT_THAT(err(base + "sources: {nodes: n, ranks: 3}\ndestinations: {nodes: n, ranks: 2}\n"),
              AllOf(HasSubstr("destinations need slots 3..4"), HasSubstr("which has 4")));
  EXPECT_THAT(err(base + "sources: {nodes: n, ranks: 1, parallel: {tp: 0}}\ndestinations: {nodes: n, ranks: 1}\n"),
              HasSubstr("'sources.parallel.tp' must be >= 1, got 0"));
  EXPECT_THAT(
      err(base + "sources: {nodes: n, ranks: 1, parallel: {shard_dense: true}}\ndestinations: {nodes: n, ranks: 1}\n"),
      HasSubstr("unknown key 'sources.parallel.shard_dense'"));
  EXPECT_THAT(err("nodes: [{name: n, workers: 2, nic: {rate: 400}}]\nsources: {nodes: n, ranks: 1}\ndestinations: "
                  "{nodes: n, ranks: 1}\n"),
              AllOf(HasSubstr("nodes[0].nic.rate"), HasSubstr("'400'")));
  EXPECT_THAT(
      err(base + "sources: {nodes: n, ranks: 1}\ndestinations: {nodes: n, ranks: 1}\ntransfer: {latency: 5 parsecs}\n"),
      HasSubstr("'transfer.latency' must be a duration"));
  EXPECT_THAT(err("nodes: {name: n}\n"), HasSubstr("'nodes' must be a list"));
  EXPECT_THAT(err("[unclosed"), HasSubstr("not valid YAML"));
}

TEST(Cluster, RatesParseBitsAndBytes) {
  EXPECT_DOUBLE_EQ(parse_rate("400Gbit", "k"), 50e9);
  EXPECT_DOUBLE_EQ(parse_rate("400Gb/s", "k"), 50e9);
  EXPECT_DOUBLE_EQ(parse_rate("1Gbit/s", "k"), 125e6);
  EXPECT_DOUBLE_EQ(parse_rate("2.1TB/s", "k"), 2.1e12);
  EXPECT_DOUBLE_EQ(parse_rate("900MiB/s", "k"), 900.0 * 1048576);
  EXPECT_THAT(error_of(ErrorKind::kConfig, [] { parse_rate("fast", "nodes[0].copy"); }), HasSubstr("nodes[0].copy"));
  EXPECT_THAT(error_of(ErrorKind::kConfig, [] { parse_rate("-5GB/s", "k"); }), HasSubstr("'-5GB/s'"));
}

TEST(Cluster, CalibrationFillsWhatTheFileLeavesOutAndRoundTrips) {
  Cluster c = parse_cluster(R"(
nodes: [{name: host, workers: 4, device: cpu, copy: 3GB/s}, {name: gpu, workers: 2, device: gpu, copy_cost: 20us}]
sources: {nodes: host, ranks: 1}
destinations: {nodes: gpu, ranks: 1}
)",
                            "x");
  const auto path = std::filesystem::temp_directory_path() / "refit-calibration-test.json";
  Calibration measured;
  measured.engine_device = "cpu";
  measured.engine_copy_rate = 5e9;
  measured.engine_node_copy_rate = 8e9;
  measured.cores = 2;
  measured.host_memory = 24ull << 30;
  measured.device_copy_rate = 2e12;
  measured.peer_copy_rate = 390e9;
  measured.latency_s = 1e-4;
  measured.engine_copy_cost_s = 3e-5;
  save_calibration(path.string(), measured);
  Calibration read;
  load_calibration(path.string(), read);
  std::filesystem::remove(path);
  EXPECT_EQ(read.engine_device, "cpu");
  EXPECT_DOUBLE_EQ(read.engine_copy_rate, 5e9);
  EXPECT_EQ(read.host_memory, 24ull << 30);
  apply_calibration(c, read);
  EXPECT_DOUBLE_EQ(c.group("host").copy_rate, 3e9);  // the file's own value wins
  EXPECT_DOUBLE_EQ(c.group("host").node_copy_rate, 8e9);
  EXPECT_EQ(c.group("host").cores, 2);
  EXPECT_DOUBLE_EQ(c.group("gpu").copy_rate, 2e12);  // the engine's CPU rates are not a GPU's
  EXPECT_DOUBLE_EQ(c.group("gpu").nvlink_rate, 390e9);
  EXPECT_DOUBLE_EQ(c.transfer.latency_s, 1e-4);
  EXPECT_DOUBLE_EQ(c.group("host").copy_cost_s, 3e-5);  // measured on the engine's device kind
  EXPECT_DOUBLE_EQ(c.group("gpu").copy_cost_s, 2e-5);   // the file's

  Cluster bare = parse_cluster(
      "nodes: [{name: g, workers: 2}]\nsources: {nodes: g, ranks: 1}\ndestinations: {nodes: g, ranks: 1}\n",
      "bare.yaml");
  EXPECT_THAT(error_of(ErrorKind::kConfig, [&] { apply_calibration(bare, Calibration{}); }),
              AllOf(HasSubstr("node group 'g'"), HasSubstr("'copy' is not given")));
}

// ---- The model. --------------------------------------------------------------------------------

ModelInventory rows_model(int tensors, int64_t rows, int64_t cols) {
  ModelInventory m;
  m.name = "rows";
  for (int i = 0; i < tensors; ++i)
    m.tensors.push_back({fmt::format("layers.{}.weight", i), DType::kFloat32, {rows, cols}});
  return m;
}

// Source s of n holds rows [s*rows/n, (s+1)*rows/n) of every tensor.
std::vector<Layout> row_shards(const ModelInventory& m, int n) {
  std::vector<Layout> out(n);
  for (int s = 0; s < n; ++s)
    for (const auto& t : m.tensors) out[s].tensors[t.name] = Request::narrow(0, s * t.shape[0] / n, t.shape[0] / n);
  return out;
}

Cluster two_sides(int sources, int destinations, const std::string& nic, const std::string& copy,
                  const std::string& bucket, const std::string& latency = "0s") {
  Cluster c =
      parse_cluster(fmt::format(R"(
nodes:
  - {{name: a, count: {}, workers: 1, device: gpu, nic: {{rate: {}}}, copy: {}}}
  - {{name: b, count: {}, workers: 1, device: gpu, nic: {{rate: {}}}, copy: {}}}
sources: {{nodes: a, ranks: {}}}
destinations: {{nodes: b, ranks: {}}}
transfer: {{bucket: {}, latency: {}, overhead: 0s}}
)",
                                sources, nic, copy, destinations, nic, copy, sources, destinations, bucket, latency),
                    "model.yaml");
  apply_calibration(c, Calibration{});
  EXPECT_EQ(c.groups[0].copy_cost_s, 0.0);  // neither the file nor the calibration gives one
  return c;
}

TEST(Prediction, OneBucketRunsItsStepsOneAfterTheOther) {
  const ModelInventory m = rows_model(4, 1024, 256);  // 4 MiB
  const double bytes = static_cast<double>(m.total_bytes());
  // Copies as fast as the link: pack, read and load of one bucket, in turn.
  const Prediction p = predict_refit(m, {}, std::vector<Layout>(1), two_sides(1, 1, "8Gbit", "1GB/s", "64MiB"));
  EXPECT_NEAR(p.seconds, 3 * bytes / 1e9, 1e-6);
  EXPECT_EQ(p.buckets, 1u);
  ASSERT_EQ(p.destinations.size(), 1u);
  EXPECT_EQ(p.destinations[0].bytes, m.total_bytes());
}

TEST(Prediction, EachPackAndLoadPaysItsCopyCostAndCountsItsPieces) {
  const ModelInventory m = rows_model(4, 1024, 256);  // 4 tensors of 1 MiB, one bucket
  Cluster c = two_sides(1, 1, "8Gbit", "1GB/s", "64MiB");
  const double plain = predict_refit(m, {}, std::vector<Layout>(1), c).seconds;
  for (auto& g : c.groups) g.copy_cost_s = 1e-3;
  const Prediction p = predict_refit(m, {}, std::vector<Layout>(1), c);
  // One pack and one load, each 1 ms more; the read is no copy of the engine's.
  EXPECT_NEAR(p.seconds - plain, 2e-3, 1e-6);
  for (const auto* side : {&p.sources, &p.destinations})
    for (const auto& e : (*side)[0].events)
      if (e.phase == TimelinePhase::kPack || e.phase == TimelinePhase::kLoad) EXPECT_EQ(e.pieces, 4u);
}

TEST(Prediction, ATensorInSeveralChunksIsLoadedWholeWithItsLastChunk) {
  const ModelInventory m = rows_model(1, 4096, 256);  // one tensor of 4 MiB in four 1 MiB buckets
  const Prediction p = predict_refit(m, {}, std::vector<Layout>(1), two_sides(1, 1, "800Gbit", "1GB/s", "1MiB"));
  std::vector<double> loads;
  for (const auto& e : p.destinations[0].events)
    if (e.phase == TimelinePhase::kLoad) loads.push_back(e.end - e.start);
  ASSERT_EQ(loads.size(), 4u);
  // Each chunk is copied into the assembled tensor; the last bucket also loads the whole of it.
  for (int b = 0; b < 3; ++b) EXPECT_NEAR(loads[b], (1 << 20) / 1e9, 1e-6) << b;
  EXPECT_NEAR(loads[3], 5.0 * (1 << 20) / 1e9, 1e-6);
}

TEST(Prediction, SmallBucketsOverlapPackReadAndLoad) {
  const ModelInventory m = rows_model(64, 1024, 256);  // 64 tensors of 1 MiB
  const double bytes = static_cast<double>(m.total_bytes());
  const Prediction p = predict_refit(m, {}, std::vector<Layout>(1), two_sides(1, 1, "8Gbit", "1GB/s", "1MiB"));
  EXPECT_EQ(p.buckets, 64u);
  // Three stages at one rate: the whole at one stage's time plus two buckets of fill and drain.
  EXPECT_NEAR(p.seconds, bytes / 1e9 + 2 * (1 << 20) / 1e9, 1e-4);
  // Every bucket is on the timeline, in order on each side.
  std::vector<double> loads;
  for (const auto& e : p.destinations[0].events)
    if (e.phase == TimelinePhase::kLoad) loads.push_back(e.start);
  ASSERT_EQ(loads.size(), 64u);
  EXPECT_TRUE(std::is_sorted(loads.begin(), loads.end()));
}

TEST(Prediction, LatencyCostsEveryBucketItsHandOffs) {
  const ModelInventory m = rows_model(16, 1024, 256);
  const Cluster fast = two_sides(1, 1, "800Gbit", "100GB/s", "1MiB", "0s");
  const Cluster slow = two_sides(1, 1, "800Gbit", "100GB/s", "1MiB", "1ms");
  const double extra = predict_refit(m, {}, std::vector<Layout>(1), slow).seconds -
                       predict_refit(m, {}, std::vector<Layout>(1), fast).seconds;
  // Double buffering hides half: at least one announcement per bucket, at most both messages.
  EXPECT_GT(extra, 16 * 1e-3 * 0.9);
  EXPECT_LT(extra, 16 * 2e-3 * 1.1);
}

TEST(Prediction, ManySourcesIntoOneDestinationAreBoundByItsIngress) {
  const ModelInventory m = rows_model(8, 4096, 256);  // 32 MiB
  const auto holds = row_shards(m, 4);
  const Cluster c = two_sides(4, 1, "8Gbit", "100GB/s", "64MiB");
  const Prediction p = predict_refit(m, holds, std::vector<Layout>(1), c);
  const double bound = m.total_bytes() / 1e9;  // 1 GB/s into the destination
  EXPECT_GT(p.seconds, bound);
  EXPECT_LT(p.seconds, bound * 1.1);
  ASSERT_FALSE(p.demands.empty());
  EXPECT_THAT(p.demands.front().name, HasSubstr("NIC in (node b/0)"));
  EXPECT_THAT(p.bound, HasSubstr("NIC in"));
  for (const auto& s : p.sources) EXPECT_EQ(s.bytes, m.total_bytes() / 4);
}

TEST(Prediction, ThePairedPathGathersFirstThenSendsEverything) {
  const ModelInventory m = rows_model(8, 4096, 256);
  const auto holds = row_shards(m, 4);
  // Sources share one node (4 GPUs, NVLink between them); destinations need every tensor whole.
  Cluster c = parse_cluster(R"(
nodes:
  - {name: a, workers: 4, device: gpu, nic: {rate: 8Gbit}, nvlink: 10GB/s, copy: 100GB/s}
  - {name: b, count: 2, workers: 1, device: gpu, nic: {rate: 8Gbit}, copy: 100GB/s}
sources: {nodes: a, ranks: 4}
destinations: {nodes: b, ranks: 2}
transfer: {bucket: 64MiB, latency: 0s, overhead: 0s}
)",
                            "paired.yaml");
  apply_calibration(c, Calibration{});
  const std::vector<Layout> needs(2);
  const Prediction paired = predict_paired(m, holds, needs, c);
  const double bytes = static_cast<double>(m.total_bytes());
  // Each paired rank takes the 3/4 it lacks over NVLink (the node holds everything already).
  EXPECT_NEAR(paired.gather_seconds, 0.75 * bytes / 10e9, 1e-9);
  EXPECT_GT(paired.seconds, paired.gather_seconds + bytes / 1e9);
  bool gathered = false;
  for (const auto& e : paired.sources[0].events) gathered = gathered || e.phase == TimelinePhase::kGather;
  EXPECT_TRUE(gathered);
  // refit's path reads the shards where they are: every source feeds both destinations.
  const Prediction refit = predict_refit(m, holds, needs, c);
  EXPECT_LT(refit.seconds, paired.seconds);
  EXPECT_EQ(refit.sources.size(), 4u);
}

TEST(Prediction, LayoutsMustMatchTheClusterRanks) {
  const ModelInventory m = rows_model(2, 64, 64);
  const Cluster c = two_sides(2, 1, "8Gbit", "1GB/s", "1MiB");
  EXPECT_THAT(error_of(ErrorKind::kConfig, [&] { predict_refit(m, row_shards(m, 2), std::vector<Layout>(3), c); }),
              HasSubstr("3 destination layouts for 1 destination ranks"));
  EXPECT_THAT(error_of(ErrorKind::kConfig, [&] { predict_refit(m, row_shards(m, 1), std::vector<Layout>(1), c); }),
              HasSubstr("1 source layouts for 2 source ranks"));
}

}  // namespace
}  // namespace refit
