// Bad input to the `refit` command: a clear error and a non-zero exit, never a reported success.
#include <gtest/gtest.h>

#include <filesystem>

#include "cli_runner.h"
#include "refit/device.h"
#include "refit/safetensors.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

void expect_error(const std::vector<std::string>& args, const std::vector<std::string>& needles) {
  auto r = run_cli(args, 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, -1) << "hung: " << r.output;
  for (const auto& n : needles)
    EXPECT_NE(r.output.find(n), std::string::npos) << "missing '" << n << "' in: " << r.output;
  EXPECT_EQ(r.output.find("verified: yes"), std::string::npos) << r.output;
}

TEST(CliErrors, MalformedYaml) {
  TempDir d;
  auto path = d.write("bad.yaml", "refit_cfg:\n  nixl: [unclosed\n");
  expect_error({"bench", "--config", path}, {"bad.yaml", "line"});
}

TEST(CliErrors, UnknownKey) { expect_error({"bench", "refit_cfg.nixl.bucket_size=3"}, {"bucket_size"}); }

TEST(CliErrors, RatioOutOfRange) {
  expect_error({"bench", "refit_cfg.nixl.update_weights_bucket_memory_ratio=0.6"},
               {"update_weights_bucket_memory_ratio", "0.6"});
}

TEST(CliErrors, UnknownTransport) { expect_error({"bench", "refit_transport=carrier_pigeon"}, {"carrier_pigeon"}); }

TEST(CliErrors, BadDevice) { expect_error({"bench", "refit_cfg.nixl.device=tpu"}, {"device", "tpu"}); }

TEST(CliErrors, GpuDeviceWithoutAGpuFailsBeforeAnyTransfer) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU (tests/gpu covers it)";
  expect_error({"bench", "--device", "cuda"}, {"refit_cfg.nixl.device: device cuda requested but"});
  expect_error({"bench", "--tensors", "cuda"}, {"GPU"});
  expect_error({"bench", "--tensors", "tpu"}, {"--tensors 'tpu'"});
}

TEST(CliErrors, ModelPathDoesNotExist) { expect_error({"bench", "--model", "/no/such/model"}, {"/no/such/model"}); }

TEST(CliErrors, TruncatedSafetensors) {
  TempDir d;
  std::vector<std::byte> data(4096, std::byte{1});
  SafetensorsEntry e{{"w", DType::kFloat32, {1024}}, data};
  auto path = d.file("m.safetensors");
  write_safetensors(path, {&e, 1});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  expect_error({"bench", "--model", path}, {"m.safetensors"});
}

TEST(CliErrors, TooFewSourcesIsRefusedBeforeAnyProcessStarts) {
  auto r = run_cli({"bench", "--sources", "1", "--destinations", "2", "refit_cfg.nixl.bucket_bytes=1MiB"}, 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train_world_size >= rollout_world_size"), std::string::npos) << r.output;
  // Bucket sizing asks every worker for its memory: its line would mean workers were started.
  EXPECT_EQ(r.output.find("Bucket size"), std::string::npos) << r.output;
}

TEST(CliErrors, BadKillSpec) { expect_error({"bench", "--kill", "nobody"}, {"--kill"}); }

}  // namespace
}  // namespace refit
