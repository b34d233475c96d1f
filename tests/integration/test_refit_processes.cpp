// Refits between real processes over UCX, driven through the `refit bench` command.
#include <gtest/gtest.h>

#include <regex>

#include "bench_runner.h"
#include "cli_runner.h"
#include "refit/model.h"
#include "refit/safetensors.h"
#include "small_models.h"

namespace refit {
namespace {

using testing::read_json;
using testing::run_cli;
using testing::TempDir;

using testing::kSmallMoe;

const std::string kShm = "refit_cfg.nixl.backend_init_params.tls=posix,sysv,cma,self";
const std::string kTcp = "refit_cfg.nixl.backend_init_params.tls=tcp,self";

using Bench = testing::SmallBench;

void expect_verified(const testing::CliResult& r, const nlohmann::json& j, int destinations, int refits,
                     uint64_t model_bytes) {
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(j.at("verified").get<bool>());
  ASSERT_EQ(j.at("refits").size(), static_cast<size_t>(refits));
  for (const auto& refit : j.at("refits")) {
    EXPECT_TRUE(refit.at("verified").get<bool>());
    ASSERT_EQ(refit.at("bytes_received").size(), static_cast<size_t>(destinations));
    for (const auto& d : refit.at("bytes_received")) EXPECT_EQ(d.at("bytes").get<uint64_t>(), model_bytes);
  }
  EXPECT_GT(j.at("median_throughput_bytes_per_s").get<double>(), 0);
  EXPECT_EQ(j.at("bucket_bytes").get<uint64_t>(), 1u << 20);
}

TEST(RefitProcesses, OneToOneOverSharedMemory) {
  Bench b;
  auto r = b.run(1, 1, 2, {kShm});
  auto model_bytes = inventory_from_hf_config(b.model).total_bytes();
  expect_verified(r, read_json(b.json), 1, 2, model_bytes);
  EXPECT_NE(r.output.find("refit bench: model " + b.model + " (qwen3_moe, "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[vLLM refit] Loaded"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Using checkpoint-engine refit backend: nixl"), std::string::npos);
  EXPECT_NE(r.output.find("[checkpoint engine] Bucket size: 1 MiB per buffer"), std::string::npos);
  // Set-up is reported with its steps, then the table's header, then the rows; every process's
  // log lines share one format (time, who, level).
  const size_t setup = r.output.find("set-up: "), header = r.output.find(" refit    seconds"),
               row = r.output.find("     0 ");
  ASSERT_NE(setup, std::string::npos) << r.output;
  EXPECT_NE(r.output.find("engines ", setup), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("buffers ", setup), std::string::npos) << r.output;
  EXPECT_LT(setup, header) << r.output;
  EXPECT_LT(header, row) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\] \[driver\] \[info\] Using checkpoint-engine)"))) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\] \[destination rank 0\] \[info\] \[vLLM refit\] Loaded)")))
      << r.output;
  // The destination read every tensor in place, from the source's weights in UCX shared memory
  // (direct_reads), so it holds no transfer buffers of its own.
  const auto result = read_json(b.json);
  for (const auto& refit : result.at("refits")) {
    const auto& d = refit.at("bytes_received").at(0);
    EXPECT_TRUE(d.at("mapped").get<bool>());
    EXPECT_EQ(d.at("buffer_bytes").get<uint64_t>(), 0u);
    EXPECT_EQ(d.at("in_place_bytes").get<uint64_t>(), model_bytes);
    EXPECT_EQ(d.at("wire_bytes").get<uint64_t>(), 0u);
  }
  EXPECT_NE(r.output.find("100% of the bytes read in place"), std::string::npos) << r.output;
}

// Without direct reads every tensor is packed into the source's mapped buckets: two copies per byte.
TEST(RefitProcesses, WithoutDirectReadsTensorsGoThroughTheMappedBuckets) {
  Bench b;
  auto r = b.run(1, 1, 2, {kShm, "refit_cfg.nixl.direct_reads=false"});
  const auto model_bytes = inventory_from_hf_config(b.model).total_bytes();
  const auto result = read_json(b.json);  // kept: the loop below iterates inside it
  expect_verified(r, result, 1, 2, model_bytes);
  for (const auto& refit : result.at("refits")) {
    const auto& d = refit.at("bytes_received").at(0);
    EXPECT_TRUE(d.at("mapped").get<bool>());
    EXPECT_EQ(d.at("in_place_bytes").get<uint64_t>(), 0u);
    EXPECT_GE(d.at("wire_bytes").get<uint64_t>(), model_bytes);
  }
  EXPECT_EQ(r.output.find("read in place"), std::string::npos) << r.output;
}

// The default model is compiled in: a copy of the binary, run away from the source tree, still
// refits it (an installed refit has no data folder).
TEST(RefitProcesses, ACopiedBinaryRefitsTheBuiltinDefaultModel) {
  TempDir dir;
  const std::string copy = dir.file("refit");
  std::filesystem::copy_file(REFIT_CLI_PATH, copy);
  std::filesystem::permissions(copy, std::filesystem::perms::owner_exec, std::filesystem::perm_options::add);
  const std::string json = dir.file("result.json");
  auto r = testing::run_program(copy,
                                {"bench", "--refits", "1", "--json", json, "refit_cfg.nixl.bucket_bytes=64MiB",
                                 "refit_cfg.nixl.timeout_s=60", kShm},
                                180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The header names the model as --model does, its architecture after it.
  EXPECT_NE(r.output.find("refit bench: model builtin:refit-tiny-moe (qwen3_moe, 459 tensors, "), std::string::npos)
      << r.output;
  const auto result = read_json(json);
  EXPECT_TRUE(result.at("verified").get<bool>());
  EXPECT_EQ(result.at("model").get<std::string>(), "qwen3_moe");
  EXPECT_EQ(result.at("model_bytes").get<uint64_t>(), load_model_inventory(kDefaultModel).total_bytes());
}

// A destination that does not map reads the source's large tensors from its memory: the
// source packs only the small ones. Returns the bytes read so of each refit.
std::vector<uint64_t> expect_read_from_source_memory(const nlohmann::json& result, uint64_t model_bytes) {
  std::vector<uint64_t> read;
  for (const auto& refit : result.at("refits")) {
    const auto& d = refit.at("bytes_received").at(0);
    EXPECT_FALSE(d.at("mapped").get<bool>());
    read.push_back(d.at("in_place_bytes").get<uint64_t>());
    EXPECT_GT(read.back(), model_bytes / 2);
    EXPECT_LT(read.back(), model_bytes);
  }
  return read;
}

TEST(RefitProcesses, OneToOneStagedOverSharedMemory) {
  Bench b;
  auto r = b.run(1, 1, 2, {kShm, "refit_cfg.nixl.map_source_buffers=false"});
  const auto model_bytes = inventory_from_hf_config(b.model).total_bytes();
  expect_verified(r, read_json(b.json), 1, 2, model_bytes);
  const auto result = read_json(b.json);
  for (const auto& refit : result.at("refits"))
    EXPECT_EQ(refit.at("bytes_received").at(0).at("buffer_bytes").get<uint64_t>(), 2u << 20);  // 2 x 1 MiB
  expect_read_from_source_memory(result, model_bytes);
}

TEST(RefitProcesses, OneToOneOverTcpReadsLargeTensorsFromTheSourcesMemory) {
  Bench b;
  auto r = b.run(1, 1, 2, {kTcp});
  const auto model_bytes = inventory_from_hf_config(b.model).total_bytes();
  expect_verified(r, read_json(b.json), 1, 2, model_bytes);
  expect_read_from_source_memory(read_json(b.json), model_bytes);  // tcp cannot map: it reads
  EXPECT_NE(r.output.find("of the bytes read in place (direct_reads)"), std::string::npos) << r.output;
}

TEST(RefitProcesses, OneToOneOverTcpWithoutDirectReadsPacksEverything) {
  Bench b;
  auto r = b.run(1, 1, 2, {kTcp, "refit_cfg.nixl.direct_reads=false"});
  const auto result = read_json(b.json);  // kept: the loop below iterates inside it
  expect_verified(r, result, 1, 2, inventory_from_hf_config(b.model).total_bytes());
  for (const auto& refit : result.at("refits"))
    EXPECT_EQ(refit.at("bytes_received").at(0).at("in_place_bytes").get<uint64_t>(), 0u);
}

TEST(RefitProcesses, TwoToTwo) {
  Bench b;
  auto r = b.run(2, 2, 2, {kShm});
  expect_verified(r, read_json(b.json), 2, 2, inventory_from_hf_config(b.model).total_bytes());
}

TEST(RefitProcesses, FourSourcesToThreeDestinationsLeavesOneSourceIdle) {
  Bench b;
  auto r = b.run(4, 3, 2, {kShm});
  expect_verified(r, read_json(b.json), 3, 2, inventory_from_hf_config(b.model).total_bytes());
}

TEST(RefitProcesses, SeveralRefitsWithReleaseAfterRefit) {
  Bench b;
  auto r = b.run(1, 1, 3, {kShm, "refit_cfg.nixl.release_after_refit=true"});
  expect_verified(r, read_json(b.json), 1, 3, inventory_from_hf_config(b.model).total_bytes());
}

TEST(RefitProcesses, SafetensorsDirectoryIsSentBitwise) {
  Bench b;
  std::vector<std::vector<std::byte>> storage;
  std::vector<SafetensorsEntry> entries;
  const std::vector<TensorInfo> infos = {{"a.weight", DType::kBFloat16, {1000, 700}},  // splits over 1 MiB buckets
                                         {"b.bias", DType::kFloat32, {33}},
                                         {"c.empty", DType::kFloat16, {0}},
                                         {"d.ids", DType::kInt64, {5}}};
  for (const auto& info : infos) {
    storage.emplace_back(info.nbytes());
    for (size_t i = 0; i < storage.back().size(); ++i) storage.back()[i] = static_cast<std::byte>(i * 131 + 7);
    entries.push_back({info, storage.back()});
  }
  std::filesystem::create_directories(b.dir.file("st"));
  write_safetensors(b.dir.file("st/model-00001.safetensors"), entries);
  b.model = b.dir.file("st");
  auto r = b.run(1, 1, 1, {kShm});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = read_json(b.json);
  EXPECT_TRUE(j.at("verified").get<bool>());
  EXPECT_EQ(j.at("tensors").get<int>(), 4);
}

// Sharded destinations: each gets exactly its slices (checked bitwise against the source's
// slices of the same tensors) and fewer bytes than the full model.
void expect_sharded(const testing::CliResult& r, const nlohmann::json& j, uint64_t model_bytes) {
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(j.at("verified").get<bool>());
  EXPECT_TRUE(j.at("sharded").get<bool>());
  for (const auto& refit : j.at("refits")) {
    for (const auto& d : refit.at("bytes_received")) {
      EXPECT_EQ(d.at("bytes"), d.at("expected_bytes"));
      EXPECT_LT(d.at("bytes").get<uint64_t>(), model_bytes);
      EXPECT_GT(d.at("bytes").get<uint64_t>(), 0u);
    }
  }
}

TEST(RefitProcesses, ShardedTp2Pp2) {
  Bench b;
  auto r = b.run(4, 4, 2, {kShm, "--tp", "2", "--pp", "2", "refit_cfg.nixl.shard_expert_weights=true"});
  expect_sharded(r, read_json(b.json), inventory_from_hf_config(b.model).total_bytes());
}

TEST(RefitProcesses, ShardedTp2Ep2WithDenseSlices) {
  Bench b;
  auto r =
      b.run(4, 4, 2, {kShm, "--tp", "2", "--ep", "2", "--shard-dense", "refit_cfg.nixl.shard_expert_weights=true"});
  expect_sharded(r, read_json(b.json), inventory_from_hf_config(b.model).total_bytes());
}

TEST(RefitProcesses, ParallelFlagsWithoutShardingAreRefused) {
  Bench b;
  auto r = b.run(2, 2, 1, {"--tp", "2"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("shard_expert_weights"), std::string::npos) << r.output;
}

// Corruption in flight (the transport test hook flips a byte of every 3rd read): with checksums
// the destination refuses the bucket; without them the bench's own bitwise check catches it.
// Either way the refit is never reported as verified.
TEST(RefitProcesses, CorruptionInFlightIsCaught) {
  setenv("REFIT_TEST_FLIP_READ_BYTES", "3", 1);
  Bench with, without;
  auto r1 = with.run(1, 1, 2, {kShm, "refit_cfg.nixl.verify_checksums=true"});
  auto r2 = without.run(1, 1, 2, {kShm});
  unsetenv("REFIT_TEST_FLIP_READ_BYTES");

  EXPECT_NE(r1.exit_code, 0) << r1.output;
  auto j1 = read_json(with.json);
  EXPECT_FALSE(j1.at("verified").get<bool>());
  EXPECT_EQ(j1.at("refits").back().at("error_kind"), "integrity") << r1.output;

  EXPECT_NE(r2.exit_code, 0) << r2.output;
  auto j2 = read_json(without.json);
  EXPECT_FALSE(j2.at("verified").get<bool>());
  EXPECT_TRUE(j2.at("refits").back().contains("verification_errors")) << r2.output;
}

// A killed peer: the survivor reports an error naming the lost peer and the phase within its
// deadline; nothing hangs; the run fails and is never reported as verified.
void expect_peer_failure(const testing::CliResult& r, const nlohmann::json& j, const std::string& survivor,
                         const std::string& lost) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, -1) << "the bench hung: " << r.output;
  EXPECT_FALSE(j.at("verified").get<bool>());
  const auto& last = j.at("refits").back();
  EXPECT_FALSE(last.at("ok").get<bool>());
  const std::string error = last.at("error");
  EXPECT_NE(error.find(survivor), std::string::npos) << error;
  EXPECT_NE(error.find(lost), std::string::npos) << error;
  EXPECT_NE(error.find("phase"), std::string::npos) << error;
}

TEST(RefitProcesses, SourceKilledMidRefitIsReportedByItsDestination) {
  Bench b;
  auto r = b.run(1, 1, 3, {kShm, "--kill", "source:0:1:40"}, 90);
  expect_peer_failure(r, read_json(b.json), "destination rank 0", "source rank 0");
  EXPECT_LT(r.seconds, 60) << r.output;
  EXPECT_EQ(read_json(b.json).at("refits").size(), 2u);  // refit 0 succeeded, refit 1 failed
}

TEST(RefitProcesses, DestinationKilledMidRefitIsReportedByItsSource) {
  Bench b;
  auto r = b.run(2, 2, 2, {kTcp, "--kill", "destination:1:0:2"}, 90);
  expect_peer_failure(r, read_json(b.json), "source rank 1", "destination rank 1");
  EXPECT_LT(r.seconds, 60) << r.output;
}

// A kill point past the refit's batches kills nothing: the bench says so and fails (exit 4)
// instead of passing a failure test that tested nothing.
TEST(RefitProcesses, AKillPointNoWorkerReachesFailsTheBench) {
  Bench b;
  auto r = b.run(1, 1, 2, {kShm, "--kill", "destination:0:1:100000:after"}, 90);
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_NE(r.output.find("nothing was killed"), std::string::npos) << r.output;
  const auto j = read_json(b.json);
  EXPECT_TRUE(j.at("verified").get<bool>()) << "every refit went through";
  EXPECT_TRUE(j.at("kill_missed").get<bool>());
}

}  // namespace
}  // namespace refit
