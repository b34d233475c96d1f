// Delta refit between real processes over UCX, driven through `refit bench --changed`: every
// refit verified bitwise against the sources, and after the first only the changes on the wire.
#include <gtest/gtest.h>

#include "bench_runner.h"
#include "cli_runner.h"
#include "refit/model.h"

namespace refit {
namespace {

using testing::read_json;

const std::string kTcp = "refit_cfg.nixl.backend_init_params.tls=tcp,self";
const std::string kShm = "refit_cfg.nixl.backend_init_params.tls=posix,sysv,cma,self";

void expect_delta_refits(const testing::SmallBench& b, const testing::CliResult& r, int destinations, int refits,
                         double most_wire_share) {
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = read_json(b.json);
  const uint64_t model_bytes = inventory_from_hf_config(b.model).total_bytes();
  ASSERT_EQ(j.at("refits").size(), static_cast<size_t>(refits));
  for (size_t k = 0; k < j.at("refits").size(); ++k) {
    const auto& refit = j.at("refits")[k];
    EXPECT_TRUE(refit.at("verified").get<bool>()) << k;
    ASSERT_EQ(refit.at("bytes_received").size(), static_cast<size_t>(destinations));
    for (const auto& d : refit.at("bytes_received")) {
      // The loader gets every tensor whole, whatever travelled.
      EXPECT_EQ(d.at("bytes").get<uint64_t>(), model_bytes) << k;
      const auto wire = d.at("wire_bytes").get<uint64_t>();
      if (k == 0) {
        EXPECT_EQ(d.at("delta_tensors").get<uint64_t>(), 0u) << "the first refit has no base";
      } else {
        EXPECT_GT(d.at("delta_tensors").get<uint64_t>(), 0u) << k;
        EXPECT_LT(wire, most_wire_share * model_bytes) << "refit " << k << " of destination " << d.at("rank");
      }
    }
  }
}

TEST(DeltaProcesses, TwoToTwoOverTcpSendOnlyTheChanges) {
  testing::SmallBench b;
  auto r = b.run(2, 2, 4, {"--changed", "0.005", "refit_cfg.nixl.delta=true", kTcp});
  expect_delta_refits(b, r, 2, 4, 0.05);
  EXPECT_NE(r.output.find("sending every tensor whole"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tensors came as changes"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("delta refits: "), std::string::npos) << r.output;
}

TEST(DeltaProcesses, OverSharedMemoryWithReleasedBuffers) {
  // release_after_refit: the engines prepare again before every refit, and the destinations'
  // metadata carry the version they hold.
  testing::SmallBench b;
  auto r = b.run(1, 1, 3,
                 {"--changed", "0.01", "refit_cfg.nixl.delta=true", "refit_cfg.nixl.release_after_refit=true", kShm});
  expect_delta_refits(b, r, 1, 3, 0.1);
}

TEST(DeltaProcesses, WithoutDeltaTheSameWorkloadSendsEverything) {
  // The control: the workload alone does not shrink the wire.
  testing::SmallBench b;
  auto r = b.run(1, 1, 2, {"--changed", "0.01", kTcp});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = read_json(b.json);
  const uint64_t model_bytes = inventory_from_hf_config(b.model).total_bytes();
  for (const auto& refit : j.at("refits")) {
    EXPECT_TRUE(refit.at("verified").get<bool>());
    for (const auto& d : refit.at("bytes_received")) EXPECT_GE(d.at("wire_bytes").get<uint64_t>(), model_bytes / 2);
  }
}

// Resharding: two TP sources, each holding half of every dense tensor, feed two TP destinations;
// after the first refit each link carries only the changed elements of its pieces, and every
// destination checks every byte it keeps against the model's content of that refit.
TEST(DeltaProcesses, ReshardingSendsEachPiecesChangesOverTcp) {
  testing::SmallBench b;
  auto r = b.run(
      2, 2, 3, {"--src-tp", "2", "--tp", "2", "--shard-dense", "--changed", "0.01", "refit_cfg.nixl.delta=true", kTcp},
      180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = read_json(b.json);
  EXPECT_TRUE(j.at("resharding").get<bool>());
  ASSERT_EQ(j.at("refits").size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    const auto& refit = j.at("refits")[k];
    EXPECT_TRUE(refit.at("verified").get<bool>()) << k;
    for (const auto& d : refit.at("bytes_received")) {
      EXPECT_EQ(d.at("bytes"), j.at("expected_bytes").at(d.at("rank").get<size_t>())) << d.dump();
      EXPECT_EQ(d.at("sources").get<size_t>(), 2u) << d.dump();
      if (k == 0) {
        EXPECT_EQ(d.at("delta_tensors").get<uint64_t>(), 0u) << "the first refit has no base";
      } else {
        EXPECT_GT(d.at("delta_tensors").get<uint64_t>(), 0u) << k;
        EXPECT_LT(d.at("wire_bytes").get<uint64_t>(), d.at("bytes").get<uint64_t>() / 10) << d.dump();
      }
    }
  }
  EXPECT_NE(r.output.find("pieces came as changes"), std::string::npos) << r.output;
}

// Bytes flipped in flight (test fault injection in the UCX reads) in a delta refit's first, whole
// refit: the destination's engine itself fails the refit, naming the tensor, because every tensor
// that goes whole carries the source's checksum in the trailer (no verify_checksums needed).
TEST(DeltaProcesses, AWholeTensorCorruptedInFlightFailsTheRefitAtTheDestination) {
  setenv("REFIT_TEST_FLIP_READ_BYTES", "3", 1);
  testing::SmallBench b;
  auto r = b.run(1, 1, 1, {"refit_cfg.nixl.delta=true", "refit_cfg.nixl.map_source_buffers=false", kTcp});
  unsetenv("REFIT_TEST_FLIP_READ_BYTES");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("as it arrived whole from source rank 0 does not match the source's checksum"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace refit
