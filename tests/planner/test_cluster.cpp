// The cluster description (cluster.h) and the planner's model of a refit (prediction.h): files are
// read strictly, and the model reproduces what a pipeline of known rates must take.
#include "refit/cluster.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/delta_schedule.h"
#include "core/error_of.h"
#include "core/host_threads.h"
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
  // The bucket path (pack, read, load), which these tests time; with direct_reads a destination on
  // another node reads large tensors from the source's memory instead (see below).
  c.transfer.direct_reads = false;
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

// ---- Reads in place (transfer.direct_reads). ------------------------------------------------------

TEST(Cluster, DirectReadsAndTheInPlaceRatesAreReadStrictly) {
  const std::string sides = "sources: {nodes: n, ranks: 1}\ndestinations: {nodes: n, ranks: 1}\n";
  const std::string base = "nodes: [{name: n, workers: 4, device: cpu}]\n" + sides;
  EXPECT_TRUE(parse_cluster(base, "c.yaml").transfer.direct_reads);  // the engine's default
  EXPECT_FALSE(parse_cluster(base + "transfer: {direct_reads: false}\n", "c.yaml").transfer.direct_reads);
  auto err = [](const std::string& yaml) {
    return error_of(ErrorKind::kConfig, [&] { parse_cluster(yaml, "c.yaml"); });
  };
  EXPECT_THAT(err(base + "transfer: {direct_reads: sometimes}\n"),
              AllOf(HasSubstr("c.yaml"), HasSubstr("'transfer.direct_reads' must be true or false, got 'sometimes'")));
  EXPECT_THAT(err(base + "transfer: {direct_read: true}\n"), HasSubstr("unknown key 'transfer.direct_read'"));
  EXPECT_THAT(err(base + "transfer: {in_place_turnaround: soon}\n"),
              HasSubstr("'transfer.in_place_turnaround' must be a duration"));
  EXPECT_THAT(err("nodes: [{name: n, workers: 4, device: cpu, in_place_copy: quick}]\n" + sides),
              AllOf(HasSubstr("c.yaml"), HasSubstr("nodes[0].in_place_copy"), HasSubstr("'quick'")));
  EXPECT_THAT(err("nodes: [{name: n, workers: 4, device: cpu, in_place_crowded_copy: 0GB/s}]\n" + sides),
              HasSubstr("nodes[0].in_place_crowded_copy"));
  EXPECT_THAT(err("nodes: [{name: n, workers: 4, device: cpu, in_place_cost: -3us}]\n" + sides),
              HasSubstr("'nodes[0].in_place_cost' must be a duration"));
}

TEST(Cluster, TheInPlaceCalibrationFillsTheInPlaceRatesOfItsKindAndRoundTrips) {
  Calibration measured;
  measured.engine_device = "cpu";
  measured.engine_copy_rate = 5e9;
  measured.engine_copy_cost_s = 3e-5;
  measured.turnaround_s = 4e-5;
  measured.engine_in_place_copy_rate = 7e9;
  measured.engine_in_place_copy_cost_s = 1e-5;
  measured.in_place_turnaround_s = 6e-5;
  measured.latency_s = 5e-4;
  measured.in_place_latency_s = 2e-5;
  measured.in_place_ack_latency_s = 3e-5;
  measured.engine_in_place_crowded_copy_rate = 9e9;
  const auto path = std::filesystem::temp_directory_path() / "refit-calibration-in-place-test.json";
  save_calibration(path.string(), measured);
  Calibration read;
  load_calibration(path.string(), read);
  std::filesystem::remove(path);
  EXPECT_DOUBLE_EQ(read.engine_in_place_copy_rate, 7e9);
  EXPECT_DOUBLE_EQ(read.engine_in_place_copy_cost_s, 1e-5);
  EXPECT_DOUBLE_EQ(read.in_place_turnaround_s, 6e-5);
  Cluster c = parse_cluster(R"(
nodes: [{name: host, workers: 4, device: cpu}, {name: gpu, workers: 2, device: gpu, copy: 2TB/s}]
sources: {nodes: host, ranks: 1}
destinations: {nodes: gpu, ranks: 1}
)",
                            "x");
  apply_calibration(c, read);
  EXPECT_DOUBLE_EQ(c.group("host").in_place_copy_rate, 7e9);
  EXPECT_DOUBLE_EQ(c.group("host").in_place_cost_s, 1e-5);
  EXPECT_DOUBLE_EQ(c.group("host").in_place_crowded_rate, 9e9);
  EXPECT_DOUBLE_EQ(c.group("gpu").in_place_crowded_rate, 0);  // CPU nodes only
  EXPECT_DOUBLE_EQ(c.transfer.in_place_turnaround_s, 6e-5);
  EXPECT_DOUBLE_EQ(c.transfer.in_place_latency_s, 2e-5);
  EXPECT_DOUBLE_EQ(c.transfer.in_place_ack_latency_s, 3e-5);
  EXPECT_DOUBLE_EQ(c.transfer.latency_s, 5e-4);  // the bucket path keeps its own
  // A CPU bench's in-place rate is not a GPU's: its own copy rate and copy cost.
  EXPECT_DOUBLE_EQ(c.group("gpu").in_place_copy_rate, 2e12);
  EXPECT_DOUBLE_EQ(c.group("gpu").in_place_cost_s, c.group("gpu").copy_cost_s);
  // Without in-place values the bucket path's stand in.
  Cluster d = parse_cluster(
      "nodes: [{name: host, workers: 4, device: cpu}]\nsources: {nodes: host, ranks: 1}\n"
      "destinations: {nodes: host, ranks: 1}\n",
      "y");
  Calibration bucket_only = measured;
  bucket_only.engine_in_place_copy_rate = 0;
  bucket_only.engine_in_place_copy_cost_s = -1;
  bucket_only.in_place_turnaround_s = -1;
  bucket_only.in_place_latency_s = bucket_only.in_place_ack_latency_s = -1;
  apply_calibration(d, bucket_only);
  EXPECT_DOUBLE_EQ(d.group("host").in_place_copy_rate, 5e9);
  EXPECT_DOUBLE_EQ(d.group("host").in_place_cost_s, 3e-5);
  EXPECT_DOUBLE_EQ(d.transfer.in_place_turnaround_s, 4e-5);
  EXPECT_DOUBLE_EQ(d.transfer.in_place_latency_s, 5e-4);
  EXPECT_DOUBLE_EQ(d.transfer.in_place_ack_latency_s, 5e-4);  // ack latency falls back to the latency
}

// Sources and destinations as processes of one CPU host (4 cores, 1 GB/s per copy), UCX.
Cluster one_host(int sources, int destinations, const std::string& bucket, bool direct_reads,
                 const std::string& extra = "", const std::string& transfer = "") {
  Cluster c =
      parse_cluster(fmt::format(R"(
nodes:
  - {{name: host, workers: 8, device: cpu, cores: 4, copy: 1GB/s, node_copy: 4GB/s{}}}
sources: {{nodes: host, ranks: {}}}
destinations: {{nodes: host, ranks: {}}}
transfer: {{bucket: {}, transport: ucx, direct_reads: {}, latency: 0s, turnaround: 0s, overhead: 0s{}}}
)",
                                extra, sources, destinations, bucket, direct_reads ? "true" : "false", transfer),
                    "one-host.yaml");
  apply_calibration(c, Calibration{});
  return c;
}

uint64_t packed_bytes(const PredictedWorker& source) {
  uint64_t bytes = 0;
  for (const auto& e : source.events)
    if (e.phase == TimelinePhase::kPack) bytes += e.bytes;
  return bytes;
}

TEST(Prediction, ReadsInPlaceSkipThePackAndCopyOnceAtTheInPlaceRate) {
  const ModelInventory m = rows_model(4, 1024, 256);  // 4 tensors of 1 MiB, one bucket
  const double bytes = static_cast<double>(m.total_bytes());
  const std::vector<Layout> whole(1);
  const Prediction buckets = predict_refit(m, {}, whole, one_host(1, 1, "64MiB", false));
  const Prediction in_place = predict_refit(m, {}, whole, one_host(1, 1, "64MiB", true));
  // The bucket path packs, then the destination loads from the mapped buffer: two copies.
  EXPECT_NEAR(buckets.seconds, 2 * bytes / 1e9, 1e-6);
  EXPECT_EQ(buckets.in_place_bytes, 0u);
  // In place: one copy, the destination's, from the source's tensors.
  EXPECT_NEAR(in_place.seconds, bytes / 1e9, 1e-6);
  EXPECT_LT(in_place.seconds, buckets.seconds);
  EXPECT_EQ(in_place.in_place_bytes, m.total_bytes());
  EXPECT_EQ(packed_bytes(in_place.sources[0]), 0u);
  EXPECT_EQ(in_place.destinations[0].bytes, m.total_bytes());
  EXPECT_EQ(in_place.sources[0].bytes, m.total_bytes());
  // That copy runs at the in-place rate, and pays the in-place cost per group, not the bucket's.
  const Prediction slower =
      predict_refit(m, {}, whole, one_host(1, 1, "64MiB", true, ", in_place_copy: 500MB/s, in_place_cost: 2ms"));
  EXPECT_NEAR(slower.seconds, bytes / 0.5e9 + 2e-3, 1e-6);
  const Prediction costly = predict_refit(m, {}, whole, one_host(1, 1, "64MiB", true, ", copy_cost: 5ms"));
  EXPECT_NEAR(costly.seconds, bytes / 1e9 + 5e-3, 1e-6);  // in_place_cost defaults to copy_cost
}

// Groups in place hold nothing in the source's buffers: the source announces them all at once,
// and only the first announcement and the last acknowledgement are on the refit's path, however
// many groups (the bucket path pays hand-offs per bucket, LatencyCostsEveryBucketItsHandOffs).
TEST(Prediction, InPlaceGroupsWaitForNoAcknowledgement) {
  const ModelInventory m = rows_model(16, 1024, 256);  // 16 tensors of 1 MiB
  const double bytes = static_cast<double>(m.total_bytes());
  const std::vector<Layout> whole(1);
  const Prediction p = predict_refit(
      m, {}, whole, one_host(1, 1, "1MiB", true, "", ", in_place_latency: 1ms, in_place_ack_latency: 1ms"));
  EXPECT_EQ(p.buckets, 16u);
  EXPECT_NEAR(p.seconds, bytes / 1e9 + 2e-3, 1e-6);
}

TEST(Prediction, InPlaceGroupsHoldAtMostTheLinkBucketBytesAndOneLargerTensorAlone) {
  ModelInventory m = rows_model(8, 1024, 256);                        // 8 tensors of 1 MiB
  m.tensors.push_back({"big.weight", DType::kFloat32, {4096, 256}});  // 4 MiB
  const Prediction p = predict_refit(m, {}, std::vector<Layout>(1), one_host(1, 1, "3MiB", true));
  std::vector<uint64_t> loads;
  for (const auto& e : p.destinations[0].events)
    if (e.phase == TimelinePhase::kLoad) loads.push_back(e.bytes);
  // 3 + 3 + 2 tensors of 1 MiB, then the 4 MiB tensor in a group of its own.
  EXPECT_THAT(loads, ::testing::ElementsAre(3u << 20, 3u << 20, 2u << 20, 4u << 20));
  EXPECT_EQ(p.buckets, 4u);
  // The destination loads one group at a time, with no pack before any: the time is its copies'.
  EXPECT_NEAR(p.seconds, m.total_bytes() / 1e9, 1e-6);
  // With a turnaround between groups, each hand-over costs it once.
  const Prediction turning =
      predict_refit(m, {}, std::vector<Layout>(1), one_host(1, 1, "3MiB", true, "", ", in_place_turnaround: 1ms"));
  EXPECT_NEAR(turning.seconds - p.seconds, 3e-3, 1e-6);
  // A link that reads in place hands off on its own latencies, not the bucket path's.
  Cluster c = one_host(1, 1, "3MiB", true);
  c.transfer.latency_s = c.transfer.ack_latency_s = 5e-3;
  c.transfer.in_place_latency_s = c.transfer.in_place_ack_latency_s = 0;
  EXPECT_NEAR(predict_refit(m, {}, std::vector<Layout>(1), c).seconds, p.seconds, 1e-9);
  // The first announcement is waited for; the next group is announced before the first is loaded.
  c.transfer.in_place_latency_s = 1e-3;
  EXPECT_NEAR(predict_refit(m, {}, std::vector<Layout>(1), c).seconds - p.seconds, 1e-3, 1e-6);
  // Acknowledgements slower than a group's load hold up the third group and the fourth.
  c.transfer.in_place_latency_s = 0;
  c.transfer.in_place_ack_latency_s = 5e-3;
  const double slow_acks = predict_refit(m, {}, std::vector<Layout>(1), c).seconds;
  EXPECT_GT(slow_acks - p.seconds, 2e-3);
  c.transfer.direct_reads = false;  // the bucket path is held up by its own latencies
  EXPECT_GT(predict_refit(m, {}, std::vector<Layout>(1), c).seconds, slow_acks);
}

TEST(Prediction, AStridedSliceKeepsItsBucketInsideALinkThatReadsInPlace) {
  const ModelInventory m = rows_model(4, 1024, 256);
  const uint64_t tensor = m.tensors[0].nbytes();
  // Paired: the destination keeps half the columns of tensor 0 (strided in the source's memory)
  // and half the rows of tensor 1 (one contiguous range); tensors 2 and 3 whole.
  Layout need;
  need.tensors[m.tensors[0].name] = Request::narrow(1, 0, 128);
  need.tensors[m.tensors[1].name] = Request::narrow(0, 0, 512);
  const Prediction p = predict_refit(m, {}, std::vector<Layout>{need}, one_host(1, 1, "64MiB", true));
  EXPECT_EQ(p.in_place_bytes, tensor / 2 + 2 * tensor);
  EXPECT_EQ(packed_bytes(p.sources[0]), tensor / 2);  // the strided slice, packed
  EXPECT_EQ(p.destinations[0].bytes, tensor + 2 * tensor);
  // Resharding: sources holding column shards send each shard in place (whole in their memory),
  // but to a destination that keeps a column slice of the whole tensor each source's piece is
  // strided: every byte goes through buckets.
  std::vector<Layout> columns(2);
  for (int s = 0; s < 2; ++s)
    for (const auto& t : m.tensors) columns[s].tensors[t.name] = Request::narrow(1, s * 128, 128);
  const Prediction shards = predict_refit(m, columns, std::vector<Layout>(1), one_host(2, 1, "64MiB", true));
  EXPECT_EQ(shards.in_place_bytes, m.total_bytes());
  std::vector<Layout> rows(2), quarter(1);
  for (int s = 0; s < 2; ++s)
    for (const auto& t : m.tensors) rows[s].tensors[t.name] = Request::narrow(0, s * 512, 512);
  for (const auto& t : m.tensors) quarter[0].tensors[t.name] = Request::narrow(1, 0, 64);
  const Prediction strided = predict_refit(m, rows, quarter, one_host(2, 1, "64MiB", true));
  EXPECT_EQ(strided.in_place_bytes, 0u);
  EXPECT_EQ(packed_bytes(strided.sources[0]) + packed_bytes(strided.sources[1]), m.total_bytes() / 4);
}

TEST(Prediction, InPlaceLoadsShareTheCrowdedRateOnceMoreRunThanHalfTheCores) {
  const ModelInventory m = rows_model(4, 1024, 256);
  const double bytes = static_cast<double>(m.total_bytes());
  auto host = [](int pairs, const std::string& crowded) {
    Cluster c = parse_cluster(fmt::format(R"(
nodes: [{{name: h, workers: 8, device: cpu, cores: 2, copy: 1GB/s, node_copy: 4GB/s{}}}]
sources: {{nodes: h, ranks: {}}}
destinations: {{nodes: h, ranks: {}}}
transfer: {{bucket: 64MiB, latency: 0s, turnaround: 0s, overhead: 0s}}
)",
                                          crowded, pairs, pairs),
                              "crowded.yaml");
    apply_calibration(c, Calibration{});
    return c;
  };
  // One pair: the load and its waiting source fit the two cores; the crowded rate does not apply.
  EXPECT_NEAR(predict_refit(m, {}, std::vector<Layout>(1), host(1, ", in_place_crowded_copy: 1GB/s")).seconds,
              bytes / 1e9, 1e-6);
  // Two pairs: each load at its own rate without the limit, sharing 1 GB/s with it.
  EXPECT_NEAR(predict_refit(m, {}, std::vector<Layout>(2), host(2, "")).seconds, bytes / 1e9, 1e-6);
  const Prediction crowded = predict_refit(m, {}, std::vector<Layout>(2), host(2, ", in_place_crowded_copy: 1GB/s"));
  EXPECT_NEAR(crowded.seconds, 2 * bytes / 1e9, 1e-6);
  EXPECT_THAT(crowded.bound, HasSubstr("in-place loads"));
  // The bucket path is not limited by it (its crowded rate is crowded_copy).
  Cluster buckets = host(2, ", in_place_crowded_copy: 1GB/s");
  buckets.transfer.direct_reads = false;
  EXPECT_NEAR(predict_refit(m, {}, std::vector<Layout>(2), buckets).seconds, 2 * bytes / 1e9, 1e-6);
}

TEST(Prediction, OnlyDestinationsThatMapTheSourcesTensorsReadInPlace) {
  const ModelInventory m = rows_model(4, 1024, 256);
  const std::vector<Layout> whole(1);
  // Another node: the bytes are read, but with direct_reads the destination reads these 1 MiB
  // tensors from the source's memory, so the source packs nothing and finishes sooner.
  const Cluster remote_off = two_sides(1, 1, "8Gbit", "1GB/s", "64MiB");
  Cluster remote_on = remote_off;
  remote_on.transfer.direct_reads = true;
  const Prediction a = predict_refit(m, {}, whole, remote_on), b = predict_refit(m, {}, whole, remote_off);
  EXPECT_EQ(a.in_place_bytes, m.total_bytes());
  EXPECT_EQ(b.in_place_bytes, 0u);
  EXPECT_LT(a.seconds, b.seconds);
  // Tensors under 64 KiB are packed even so.
  const ModelInventory small = rows_model(4, 64, 64);
  EXPECT_EQ(predict_refit(small, {}, whole, remote_on).in_place_bytes, 0u);
  // One host without mapped buffers: the destination reads the source's memory in the same way.
  EXPECT_EQ(predict_refit(m, {}, whole, one_host(1, 1, "64MiB", true, "", ", mapped: false")).in_place_bytes,
            m.total_bytes());
  // GPUs of one node: CUDA IPC maps the source's tensors; UCX does not map GPU memory.
  auto gpus = [](const std::string& transport) {
    Cluster c = parse_cluster(fmt::format(R"(
nodes: [{{name: g, workers: 2, gpus: 2, device: gpu, copy: 100GB/s, nvlink: 50GB/s}}]
sources: {{nodes: g, ranks: 1}}
destinations: {{nodes: g, ranks: 1}}
transfer: {{bucket: 64MiB, transport: {}, latency: 0s, turnaround: 0s, overhead: 0s}}
)",
                                          transport),
                              "gpus.yaml");
    apply_calibration(c, Calibration{});
    return c;
  };
  const Prediction ipc = predict_refit(m, {}, whole, gpus("cuda_ipc"));
  EXPECT_EQ(ipc.in_place_bytes, m.total_bytes());
  // Across GPUs the one copy crosses NVLink (50 GB/s, below the device copy).
  EXPECT_NEAR(ipc.seconds, m.total_bytes() / 50e9, 1e-6);
  EXPECT_EQ(predict_refit(m, {}, whole, gpus("ucx")).in_place_bytes, 0u);
}

// Two processes on one GPU: a copy alone runs at its own rate; copies of both take turns, and
// while one waits for the other they move at the node copy rate together.
TEST(Prediction, CopiesOfProcessesOnOneGpuRunAloneAtTheirRateAndTakeTurnsTogether) {
  const ModelInventory m = rows_model(16, 1024, 256);  // 16 tensors of 1 MiB
  const double bytes = static_cast<double>(m.total_bytes());
  const std::vector<Layout> whole(1);
  auto one_gpu = [](const std::string& bucket, bool direct_reads) {
    Cluster c = parse_cluster(fmt::format(R"(
nodes: [{{name: g, workers: 2, gpus: 1, device: gpu, copy: 100GB/s, node_copy: 40GB/s, in_place_copy: 80GB/s}}]
sources: {{nodes: g, ranks: 1}}
destinations: {{nodes: g, ranks: 1}}
transfer: {{bucket: {}, transport: cuda_ipc, direct_reads: {}, latency: 0s, turnaround: 0s, overhead: 0s}}
)",
                                          bucket, direct_reads),
                              "one-gpu.yaml");
    apply_calibration(c, Calibration{});
    return c;
  };
  // In place: the destination's loads, alone, at the in-place rate (not the rate of turns).
  EXPECT_NEAR(predict_refit(m, {}, whole, one_gpu("1GiB", true)).seconds, bytes / 80e9, 1e-9);
  EXPECT_NEAR(predict_refit(m, {}, whole, one_gpu("2MiB", true)).seconds, bytes / 80e9, 1e-9);
  // One bucket: the pack, then the load, each alone.
  EXPECT_NEAR(predict_refit(m, {}, whole, one_gpu("1GiB", false)).seconds, 2 * bytes / 100e9, 1e-9);
  // Many buckets: the source packs while its destination loads, and they take turns.
  const double turns = predict_refit(m, {}, whole, one_gpu("2MiB", false)).seconds;
  EXPECT_GT(turns, 1.5 * (2 * bytes / 100e9));
  EXPECT_LE(turns, 2 * bytes / 40e9 + 1e-9);
}

// Pinned host buffers: a GPU's PCIe link runs one way alone at `pcie`, and both ways at once at
// `pcie_duplex` each (a source packing into its buffer while its destination loads the one before).
TEST(Prediction, HostBuffersCrossPcieBothWaysAtTheDuplexRate) {
  const ModelInventory m = rows_model(16, 1024, 256);  // 16 tensors of 1 MiB
  const double bytes = static_cast<double>(m.total_bytes());
  const std::vector<Layout> whole(1);
  auto one_gpu = [](const std::string& bucket) {
    Cluster c = parse_cluster(fmt::format(R"(
nodes: [{{name: g, workers: 2, gpus: 1, device: gpu, copy: 1000GB/s, pcie: 50GB/s, pcie_duplex: 25GB/s}}]
sources: {{nodes: g, ranks: 1}}
destinations: {{nodes: g, ranks: 1}}
transfer: {{bucket: {}, transport: ucx, buffers: host, latency: 0s, turnaround: 0s, overhead: 0s}}
)",
                                          bucket),
                              "host-buffers.yaml");
    apply_calibration(c, Calibration{});
    return c;
  };
  // One bucket: the pack to host, then the load from it, each alone at 50 GB/s.
  EXPECT_NEAR(predict_refit(m, {}, whole, one_gpu("1GiB")).seconds, 2 * bytes / 50e9, 1e-9);
  // Eight buckets: the first pack and the last load alone, the rest both ways at 25 GB/s each.
  const double overlapped = predict_refit(m, {}, whole, one_gpu("2MiB")).seconds;
  EXPECT_NEAR(overlapped, 2 * (bytes / 8) / 50e9 + 7 * (bytes / 8) / 25e9, 1e-6);
}

// The record the codec writes at a share: a byte of gap and a byte of step per change while gaps
// stay under 128 elements, the bitmap once it is smaller than the gaps, the tensor whole once the
// record would not be smaller.
TEST(DeltaPrediction, RecordsShrinkWithTheShareAndGoWholeWhenNotSmaller) {
  const TensorInfo bf16{"w", DType::kBFloat16, {1000, 1000}};
  EXPECT_EQ(predicted_record_bytes(bf16, 0.01), 32u + 10000 + 10000);
  EXPECT_EQ(predicted_record_bytes(bf16, 0.001), 32u + 1000 * 2 + 1000);  // gaps of 1000 take two bytes
  EXPECT_EQ(predicted_record_bytes(bf16, 0.5), 32u + 1000000 / 8 + 500000);
  EXPECT_EQ(predicted_record_bytes(bf16, 0.0), 32u);
  const TensorInfo bytes{"b", DType::kUInt8, {1000}};
  EXPECT_EQ(predicted_record_bytes(bytes, 0.95), 1000u);  // whole
}

// On a slow link a delta refit is bound by the sources' comparison and pays; where a full refit
// runs at copy speed it does not.
TEST(DeltaPrediction, PaysOnASlowLinkNotWhereTheLinkRunsAtCopySpeed) {
  const ModelInventory m = rows_model(8, 1024, 1024);  // 8 tensors of 4 MiB (float32)
  const double bytes = static_cast<double>(m.total_bytes());
  Cluster slow = two_sides(1, 1, "1Gbit", "10GB/s", "16MiB");
  slow.groups[0].gpu = slow.groups[1].gpu = false;
  const Prediction full = predict_refit(m, {}, std::vector<Layout>(1), slow);
  const DeltaPrediction d = predict_delta(m, {}, std::vector<Layout>(1), slow, 0.01, full);
  EXPECT_TRUE(d.pays);
  // A host scan: two copies' worth, and 320 bytes' worth per changed element (1% of 4-byte ones).
  EXPECT_NEAR(d.scan_seconds, (bytes * 2 + 0.01 * bytes / 4 * 320) / 10e9, 1e-9);
  // A patch: a copy's worth and 150 bytes' worth per change.
  EXPECT_NEAR(d.patch_seconds, (bytes + 0.01 * bytes / 4 * 150) / 10e9, 1e-9);
  const double wire = 8.0 * static_cast<double>(predicted_record_bytes(m.tensors[0], 0.01));
  EXPECT_EQ(d.wire_bytes, static_cast<uint64_t>(wire));
  // Its records (8 x 21 KB) fill no bucket (core/delta_schedule.h): they go with the trailer once
  // all is compared (and copied into the buffer), cross the link, and the destination then patches
  // them, releases the bucket and its loader copies every tensor out (the records with them).
  EXPECT_NEAR(d.seconds, d.scan_seconds + wire / 10e9 + wire / 125e6 + d.patch_seconds + (wire + bytes) / 10e9, 1e-9);
  EXPECT_EQ(d.seconds, d.transfer.seconds);
  EXPECT_EQ(d.transfer.buckets, 1u);
  Cluster fast = two_sides(1, 1, "4000Gbit", "10GB/s", "16MiB");
  fast.groups[0].gpu = fast.groups[1].gpu = false;
  const Prediction fast_full = predict_refit(m, {}, std::vector<Layout>(1), fast);
  EXPECT_FALSE(predict_delta(m, {}, std::vector<Layout>(1), fast, 0.01, fast_full).pays);
  EXPECT_THAT(error_of(ErrorKind::kConfig, [&] { predict_delta(m, {}, std::vector<Layout>(1), slow, 1.5, full); }),
              HasSubstr("[0, 1]"));
}

// The pipeline model runs a delta refit as the engine schedules it: records that fill many
// buckets overlap the source's comparing with the destination's patching and loading; a large
// tensor first holds the destination back until it is compared, and the source, whose buffers the
// destination holds, until it is patched: on one node the destination patches from the source's
// buffers and releases them after, so the source runs two buckets ahead; reading them into its
// own, the destination acknowledges each as read, so the source goes on.
TEST(DeltaPrediction, TheEnginesScheduleRunsThroughThePipelineModel) {
  auto predict = [](const ModelInventory& m, bool one_node) {
    Cluster c = two_sides(1, 1, "100Gbit", "10GB/s", "16MiB");
    for (NodeGroup& g : c.groups) {
      g.gpu = false;
      g.cores = 4;              // no pool threads, but cores for both ends of a node
      g.node_copy_rate = 40e9;  // ... and memory
    }
    if (one_node) {
      c.groups[0].workers = 2;
      c.destinations.nodes = "a";
      c.destinations.first_slot = 1;
    }
    return predict_delta(m, {}, std::vector<Layout>(1), c, 0.3, predict_refit(m, {}, std::vector<Layout>(1), c));
  };
  const ModelInventory many = rows_model(64, 1024, 1024);  // 64 x 4 MiB, about 440 KB of records each
  ASSERT_GT(predicted_record_bytes(many.tensors[0], 0.3), delta_schedule::kBucketBytes / 4);  // a bucket every few
  // The same bytes with a first tensor half the model.
  ModelInventory front = rows_model(33, 1024, 1024);
  front.tensors[0].shape = {32 * 1024, 1024};
  ASSERT_EQ(front.total_bytes(), many.total_bytes());
  const double bytes = static_cast<double>(many.total_bytes());
  for (bool one_node : {false, true}) {
    const DeltaPrediction d = predict(many, one_node);
    const double destination = d.patch_seconds + bytes / 10e9;  // patching and loading
    EXPECT_GT(d.seconds, std::max(d.scan_seconds, destination));
    EXPECT_LT(d.seconds, std::max(d.scan_seconds, destination) * 1.1) << "the stages overlap";
    // A bucket goes once it holds kBucketBytes of records (LinkSender::send_early).
    const double records = 64.0 * static_cast<double>(predicted_record_bytes(many.tensors[0], 0.3));
    EXPECT_GE(d.transfer.buckets, static_cast<uint64_t>(records / (2 * delta_schedule::kBucketBytes)));
    EXPECT_LE(d.transfer.buckets, static_cast<uint64_t>(records / delta_schedule::kBucketBytes) + 1);
    EXPECT_NEAR(predict(front, one_node).scan_seconds, d.scan_seconds, 1e-9);
  }
  EXPECT_GT(predict(front, true).seconds, predict(many, true).seconds * 1.05);
  EXPECT_GT(predict(front, true).seconds, predict(front, false).seconds * 1.05);
  // The destination releases each bucket once patched, before its loader copies the tensors out
  // (the engine's release_bucket): the large tensor's bucket goes back before the loader copies
  // the records and the tensor out of the destination's copy.
  std::map<uint64_t, double> released, loaded;
  uint64_t first_records = 0;
  const DeltaPrediction large_first = predict(front, true);
  for (const TimelineEvent& e : large_first.transfer.destinations[0].events) {
    if (e.phase == TimelinePhase::kRelease) released[e.bucket] = e.start;
    if (e.phase == TimelinePhase::kLoad) loaded[e.bucket] = e.end;
    if (e.phase == TimelinePhase::kLoad && e.bucket == 0) first_records = e.bytes;
  }
  ASSERT_EQ(released.size(), loaded.size());
  ASSERT_GT(loaded.size(), 2u);
  EXPECT_NEAR(loaded.at(0) - released.at(0), (first_records + 32.0 * (4 << 20)) / 10e9, 1e-9);
  for (const auto& [bucket, at] : released) EXPECT_LT(at, loaded.at(bucket)) << "bucket " << bucket;
}

// On hosts of 8 cores or more a delta's host work also runs on the engine's pool threads
// (host_pool_threads, the engine's rule): the planner spreads a stage over them, as far as the
// node's memory gives.
TEST(DeltaPrediction, HostStagesSpreadOverTheEnginesPoolThreadsAsFarAsMemoryGives) {
  const ModelInventory m = rows_model(8, 1024, 1024);  // 8 tensors of 4 MiB (float32)
  const double bytes = static_cast<double>(m.total_bytes());
  const double one_core = (bytes * 2 + 0.01 * bytes / 4 * 320) / 10e9;  // a source's scan on one core
  auto cluster = [&](int cores, double node_rate) {
    Cluster c = two_sides(1, 1, "1Gbit", "10GB/s", "16MiB");
    for (NodeGroup& g : c.groups) {
      g.gpu = false;
      g.cores = cores;
      g.node_copy_rate = node_rate;
    }
    return c;
  };
  auto scan = [&](const Cluster& c) {
    return predict_delta(m, {}, std::vector<Layout>(1), c, 0.01, predict_refit(m, {}, std::vector<Layout>(1), c))
        .scan_seconds;
  };
  ASSERT_EQ(host_pool_threads(4), 0);
  ASSERT_EQ(host_pool_threads(16), 4);
  ASSERT_EQ(host_pool_threads(128), kMaxHostPoolThreads);
  EXPECT_NEAR(scan(cluster(4, 100e9)), one_core, 1e-9);                // no pool threads
  EXPECT_NEAR(scan(cluster(16, 100e9)), one_core / 5, 1e-9);           // 4 threads and the caller's
  EXPECT_NEAR(scan(cluster(128, 100e9)), one_core / 9, 1e-9);          // at most 8 threads
  EXPECT_NEAR(scan(cluster(16, 20e9)), one_core * 10e9 / 20e9, 1e-9);  // the node's memory: 2 cores' worth
}

// A calibration of the engine's copies on `device` at `rate`, with a delta refit of `bytes` at 1%
// changed (4-byte elements) that compared and patched in the given seconds.
Calibration delta_calibration(const char* device, double rate, double bytes, double compare_s, double patch_s) {
  Calibration cal;
  cal.engine_device = device;
  cal.engine_copy_rate = rate;
  cal.delta_bytes = bytes;
  cal.delta_changes = 0.01 * bytes / 4;
  cal.delta_compare_s = compare_s;
  cal.delta_patch_s = patch_s;
  return cal;
}

// A calibration's delta refit (one source into one destination, host tensors) sets the cost of
// each changed element: predicting that refit on the machine that measured it gives back the
// measured comparing and patching, and on a node with pool threads the work spreads over them.
TEST(DeltaPrediction, TheCalibratedCostPerChangeReproducesTheMeasuredRefit) {
  const ModelInventory m = rows_model(8, 1024, 1024);  // 8 tensors of 4 MiB (float32)
  const double bytes = static_cast<double>(m.total_bytes());
  // Comparing: two copies' worth (6.7 ms) and 5.8 ms of changes; patching: one (3.4 ms) and 2.7 ms.
  Calibration cal = delta_calibration("cpu", 10e9, bytes, 0.0125, 0.0061);
  cal.cores = 2;
  auto cluster = [&](int cores, const Calibration& with) {
    Cluster c = two_sides(1, 1, "1Gbit", "10GB/s", "16MiB");
    for (NodeGroup& g : c.groups) {
      g.gpu = false;
      g.cores = cores;
      g.node_copy_rate = 100e9;
    }
    apply_calibration(c, with);
    return c;
  };
  auto delta = [&](const Cluster& c) {
    return predict_delta(m, {}, std::vector<Layout>(1), c, 0.01, predict_refit(m, {}, std::vector<Layout>(1), c));
  };
  const Cluster measured = cluster(2, cal);
  EXPECT_NEAR(measured.groups[0].compare_change_bytes, (0.0125 * 10e9 - 2 * bytes) / cal.delta_changes, 1e-6);
  EXPECT_NEAR(delta(measured).scan_seconds, 0.0125, 1e-9);
  EXPECT_NEAR(delta(measured).patch_seconds, 0.0061, 1e-9);
  // 16 cores: the engine's 4 pool threads and the caller's share the work.
  EXPECT_NEAR(delta(cluster(16, cal)).scan_seconds, 0.0125 / 5, 1e-9);
  // Without a measured delta refit, the planner's own (320 and 150 bytes' worth a change).
  const DeltaPrediction built_in = delta(cluster(2, Calibration{}));
  EXPECT_NEAR(built_in.scan_seconds, (2 * bytes + cal.delta_changes * 320) / 10e9, 1e-9);
  EXPECT_NEAR(built_in.patch_seconds, (bytes + cal.delta_changes * 150) / 10e9, 1e-9);
  // Measured faster than its bytes alone: no negative cost per change.
  Calibration fast = cal;
  fast.delta_compare_s = 0.001;
  EXPECT_EQ(cluster(2, fast).groups[0].compare_change_bytes, 0.0);
}

// On a GPU the same: the calibration's delta refit (GPU tensors) gives back its comparing and
// patching, each change costing far more than its bytes (it crosses to the host); the source's
// waits for its kernels, 8 copies' worth of its bytes, stay when fewer elements change.
TEST(DeltaPrediction, AGpuCalibrationSetsTheCostPerChangeOfGpuNodes) {
  const ModelInventory m = rows_model(8, 1024, 1024);  // 8 tensors of 4 MiB (float32)
  const double bytes = static_cast<double>(m.total_bytes());
  Calibration cal = delta_calibration("cuda", 1000e9, bytes, 0.0015, 0.0006);
  cal.device_copy_rate = 2000e9;
  Cluster c = two_sides(1, 1, "1Gbit", "10GB/s", "16MiB");
  for (NodeGroup& g : c.groups) g.copy_rate = g.node_copy_rate = 0;  // as the calibration measured
  apply_calibration(c, cal);
  ASSERT_DOUBLE_EQ(c.groups[1].copy_rate, 1000e9);
  const double per_change = (0.0015 * 1000e9 - (2 + 8) * bytes) / cal.delta_changes;
  EXPECT_NEAR(c.groups[0].compare_change_bytes, per_change, 1e-6);
  auto delta = [&](double share) {
    return predict_delta(m, {}, std::vector<Layout>(1), c, share, predict_refit(m, {}, std::vector<Layout>(1), c));
  };
  const DeltaPrediction d = delta(0.01);
  EXPECT_NEAR(d.scan_seconds, 0.0015, 1e-9);
  EXPECT_NEAR(d.patch_seconds, 0.0006, 1e-9);
  EXPECT_NEAR(delta(0.001).scan_seconds, ((2 + 8) * bytes + 0.1 * cal.delta_changes * per_change) / 1000e9, 1e-9);
}

// On one GPU, a source's and its destination's delta work per change (records written and read)
// runs on their processes' host threads side by side, while their work on the GPU takes turns.
TEST(DeltaPrediction, OnOneGpuBothSidesWorkPerChangeOverlaps) {
  const ModelInventory m = rows_model(128, 1024, 1024);  // 128 tensors of 4 MiB: several batches
  const std::vector<Layout> whole(1);
  Cluster c = parse_cluster(R"(
nodes: [{name: g, workers: 2, gpus: 1, device: gpu, copy: 100GB/s, node_copy: 100GB/s}]
sources: {nodes: g, ranks: 1}
destinations: {nodes: g, ranks: 1}
transfer: {bucket: 16MiB, transport: cuda_ipc, direct_reads: false, latency: 0s, turnaround: 0s, overhead: 0s}
)",
                            "one-gpu.yaml");
  apply_calibration(c, Calibration{});
  auto delta = [&](double per_change) {
    for (NodeGroup& g : c.groups) g.compare_change_bytes = g.patch_change_bytes = per_change;
    return predict_delta(m, {}, whole, c, 0.05, predict_refit(m, {}, whole, c));
  };
  const DeltaPrediction heavy = delta(20000);  // per change: 200 ns of each side's host threads
  ASSERT_GT(heavy.scan_seconds, 0.02);
  ASSERT_NEAR(heavy.scan_seconds, heavy.patch_seconds, 0.2 * heavy.scan_seconds);
  EXPECT_LT(heavy.seconds, 0.75 * (heavy.scan_seconds + heavy.patch_seconds)) << "the two sides' host work overlaps";
  EXPECT_GT(heavy.seconds, std::max(heavy.scan_seconds, heavy.patch_seconds));
}

// A destination with a layout gets the records of what it keeps: its source compares and sends
// those slices, and the pair that keeps the most sets the time.
TEST(DeltaPrediction, DestinationsWithLayoutsGetTheRecordsOfTheirSlices) {
  const ModelInventory m = rows_model(8, 1024, 1024);  // 8 tensors of 4 MiB (float32)
  Cluster slow = two_sides(2, 2, "1Gbit", "10GB/s", "16MiB");
  slow.groups[0].gpu = slow.groups[1].gpu = false;
  std::vector<Layout> halves(2);  // TP 2 by rows; destination 1 keeps no layers.7
  for (int d = 0; d < 2; ++d)
    for (const TensorInfo& t : m.tensors) halves[d].tensors[t.name] = Request::narrow(0, 512 * d, 512);
  halves[1].tensors.erase("layers.7.weight");
  halves[1].drop_prefixes.push_back("layers.7.");
  const Prediction full = predict_refit(m, {}, halves, slow);
  const DeltaPrediction d = predict_delta(m, {}, halves, slow, 0.01, full);
  const TensorInfo half{"t0", DType::kFloat32, {512, 1024}};
  EXPECT_EQ(d.wire_bytes, 8 * predicted_record_bytes(half, 0.01));  // destination 0's
  // Half the model: its slices copied out (a copy), then compared.
  const double kept = 8.0 * static_cast<double>(half.nbytes());
  EXPECT_NEAR(d.scan_seconds, (kept * 3 + 0.01 * kept / 4 * 320) / 10e9, 1e-9);
  EXPECT_TRUE(d.pays);
  // Whole tensors to the same two destinations: twice the records, nothing to copy out.
  const std::vector<Layout> whole(2);
  const DeltaPrediction w = predict_delta(m, {}, whole, slow, 0.01, predict_refit(m, {}, whole, slow));
  EXPECT_EQ(w.wire_bytes, 8 * predicted_record_bytes(m.tensors[0], 0.01));
  const double whole_bytes = 8.0 * static_cast<double>(m.tensors[0].nbytes());
  EXPECT_NEAR(w.scan_seconds, (whole_bytes * 2 + 0.01 * whole_bytes / 4 * 320) / 10e9, 1e-9);
  // Both pairs as processes of one machine with one core: its core does every stage's work (the
  // loads' copies too), one piece of work after another, where each pair alone on its own hosts
  // overlaps its stages.
  Cluster one = slow;
  for (NodeGroup& g : one.groups) {
    g.machine = "one";
    g.cores = 1;
  }
  const DeltaPrediction s = predict_delta(m, {}, halves, one, 0.01, full);
  const double load = kept / 10e9;                               // destination 0's loader
  const double pair0 = s.scan_seconds + s.patch_seconds + load;  // destination 0 keeps the most
  EXPECT_LT(d.seconds, 1.1 * pair0);
  EXPECT_GT(s.seconds, 1.8 * pair0);  // destination 1 keeps 7 of 8 tensors
  EXPECT_LT(s.seconds, 1.9 * pair0);
}

// Resharding: each source compares its shard with its base and sends the records of the plan's
// pieces; a piece that is the source's whole shard is not copied out first.
TEST(DeltaPrediction, ReshardingSourcesCompareTheirShardsAndSendTheRecordsOfTheirPieces) {
  const ModelInventory m = rows_model(8, 1024, 1024);  // 8 tensors of 4 MiB (float32)
  Cluster slow = two_sides(2, 1, "1Gbit", "10GB/s", "16MiB");
  slow.groups[0].gpu = slow.groups[1].gpu = false;
  const std::vector<Layout> holds = row_shards(m, 2), needs(1);
  const Prediction full = predict_refit(m, holds, needs, slow);
  const DeltaPrediction d = predict_delta(m, holds, needs, slow, 0.01, full);
  const TensorInfo half{"t0", DType::kFloat32, {512, 1024}};
  EXPECT_EQ(d.wire_bytes, 16 * predicted_record_bytes(half, 0.01)) << "every half, from both sources";
  const double shard = 8.0 * static_cast<double>(half.nbytes());
  EXPECT_NEAR(d.scan_seconds, (shard * 2 + 0.01 * shard / 4 * 320) / 10e9, 1e-9) << "nothing copied out";
  const double model = 2 * shard;
  EXPECT_NEAR(d.patch_seconds, (model + 0.01 * model / 4 * 150) / 10e9, 1e-9);
  EXPECT_TRUE(d.pays);
  EXPECT_LT(d.seconds, full.seconds / 5);
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
