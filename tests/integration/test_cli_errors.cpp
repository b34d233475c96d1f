// Bad input to the `refit` command: a clear error and a non-zero exit, never a reported success.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <filesystem>

#include "cli_runner.h"
#include "refit/device.h"
#include "refit/safetensors.h"

namespace refit {
namespace {

using testing::CliResult;
using testing::run_cli;
using testing::run_program;
using testing::TempDir;

void expect_error(const std::vector<std::string>& args, const std::vector<std::string>& needles) {
  auto r = run_cli(args, 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, -1) << "hung: " << r.output;
  for (const auto& n : needles)
    EXPECT_NE(r.output.find(n), std::string::npos) << "missing '" << n << "' in: " << r.output;
  EXPECT_EQ(r.output.find("verified: yes"), std::string::npos) << r.output;
}

// The errors a newcomer meets first: the whole output is one line, which says what is wrong and
// what to do, and the exit is non-zero.
void expect_one_line_error(const CliResult& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, -1) << "hung: " << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_TRUE(r.output.starts_with("refit: error (")) << r.output;
  for (const auto& n : needles)
    EXPECT_NE(r.output.find(n), std::string::npos) << "missing '" << n << "' in: " << r.output;
}

// A port of this host that nobody listens on (bound, then closed).
int closed_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof a;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) != 0)
    std::abort();
  close(fd);
  return ntohs(a.sin_port);
}

TEST(CliErrors, MalformedYaml) {
  TempDir d;
  auto path = d.write("bad.yaml", "refit_cfg:\n  nixl: [unclosed\n");
  expect_error({"bench", "--config", path}, {"bad.yaml", "line"});
}

TEST(CliErrors, UnknownKey) { expect_error({"bench", "refit_cfg.nixl.bucket_size=3"}, {"bucket_size"}); }

TEST(CliErrors, AnUnknownKeyOrBadValueOfAConfigFileNamesTheFileAndLine) {
  TempDir d;
  auto typo = d.write("typo.yaml", "refit_cfg:\n  nixl:\n    device: cpu\n    bucket_byte: 1MiB\n");
  expect_one_line_error(run_cli({"bench", "--config", typo}, 60),
                        {"refit: error (config): " + typo + ", line 4: unknown key refit_cfg.nixl.bucket_byte"});
  auto bad = d.write("bad_value.yaml", "refit_cfg:\n  nixl:\n    timeout_s: soon\n");
  expect_one_line_error(run_cli({"plan", "--config", bad}, 60),
                        {bad + ", line 3: refit_cfg.nixl.timeout_s must be a number, got 'soon'"});
}

// Refused input, not a failed refit: the bench stops before any worker starts.
TEST(CliErrors, AHostCopyThreadCountOutOfRangeIsRefusedAtStart) {
  auto r = run_program("/usr/bin/env", {"REFIT_HOST_COPY_THREADS=100", REFIT_CLI_PATH, "bench", "--refits", "1"}, 60);
  expect_one_line_error(r, {"refit: error (config): REFIT_HOST_COPY_THREADS='100'", "from 0 to 64"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
}

// A bad option or option value is refused input too: refit's one line and exit status 1, the
// subcommand's --help named; --help and --version still succeed.
TEST(CliErrors, ABadOptionIsRefusedInRefitsFormatWithExitStatusOne) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"bench", "--bogus"}, {"refit: error (invalid argument): ", "--bogus", "see `refit bench --help`"}},
      {{"bench", "--sources", "x"}, {"--sources", "see `refit bench --help`"}},
      {{"demo", "elastic", "--nope"}, {"--nope", "see `refit demo elastic --help`"}},
      {{}, {"subcommand", "see `refit --help`"}}};
  for (const auto& [args, needles] : cases) {
    const auto r = run_cli(args, 60);
    expect_one_line_error(r, needles);
    EXPECT_EQ(r.exit_code, 1) << r.output;
  }
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--version"}, {"bench", "--help"}, {"--help"}}) {
    const auto r = run_cli(args, 60);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_FALSE(r.output.starts_with("refit: error")) << r.output;
  }
}

TEST(CliErrors, RatioOutOfRange) {
  expect_error({"bench", "refit_cfg.nixl.update_weights_bucket_memory_ratio=0.6"},
               {"update_weights_bucket_memory_ratio", "0.6"});
}

TEST(CliErrors, UnknownTransport) { expect_error({"bench", "refit_transport=carrier_pigeon"}, {"carrier_pigeon"}); }

TEST(CliErrors, BadDevice) { expect_error({"bench", "refit_cfg.nixl.device=tpu"}, {"device", "tpu"}); }

// Every option that asks for a GPU, refused before any worker starts: on a CUDA build without a
// GPU with the CUDA runtime's reason, on a build without CUDA with how to build one (the build
// here has CUDA; test_gpu_request.cpp checks that message).
TEST(CliErrors, GpuOptionsWithoutAGpuFailWithOneLine) {
  std::string reason;
  if (cuda_device_count(&reason) > 0) GTEST_SKIP() << "this machine has a GPU (tests/gpu covers it)";
  // check_device()'s own message, after the option that asked.
  const std::string why = cuda_built()
                              ? " requested but CUDA is not available: " + reason
                              : " requested but this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON";
  const std::vector<std::pair<std::string, std::vector<std::string>>> requests = {
      {"--device cuda", {"--device", "cuda"}},
      {"refit_cfg.nixl.device=cuda:0", {"refit_cfg.nixl.device=cuda:0"}},
      {"--tensors cuda", {"--tensors", "cuda"}},
      {"refit_cfg.nixl.backend_name=CUDA_IPC", {"refit_cfg.nixl.backend_name=CUDA_IPC"}},
      {"refit_cfg.nixl.backend_name=NCCL", {"refit_cfg.nixl.backend_name=NCCL"}}};
  for (const auto& [request, args] : requests) {
    std::vector<std::string> bench = {"bench"};
    bench.insert(bench.end(), args.begin(), args.end());
    expect_one_line_error(run_cli(bench, 60), {request + ": device cuda", why, "device"});
  }
  expect_error({"bench", "--tensors", "tpu"}, {"--tensors 'tpu'"});
}

TEST(CliErrors, ModelPathDoesNotExistFailsWithOneLineSayingWhatIsAccepted) {
  for (const char* command : {"bench", "plan"})
    expect_one_line_error(
        run_cli({command, "--model", "/no/such/model"}, 60),
        {"--model '/no/such/model' does not exist", "config.json", ".safetensors", "builtin:refit-tiny-moe"});
}

// Rank 1 of a launcher's job whose rank 0 is not there: one line within --join-timeout, naming
// the address, where it came from, the rank and what to check.
TEST(CliErrors, UnreachableRendezvousFailsWithOneLineWithinTheJoinTimeout) {
  const std::string port = std::to_string(closed_port());
  auto r = run_program("/usr/bin/env",
                       {"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port, REFIT_CLI_PATH,
                        "bench", "--launcher", "env", "--join-timeout", "2"},
                       60);
  expect_one_line_error(r, {"rank 1 (destination rank 0", "could not reach rank 0 at 127.0.0.1:" + port,
                            "(MASTER_ADDR:MASTER_PORT) within 2 s", "check that rank 0 is started", "firewall"});
  EXPECT_LT(r.seconds, 15) << r.output;
}

TEST(CliErrors, TruncatedSafetensors) {
  TempDir d;
  std::vector<std::byte> data(4096, std::byte{1});
  SafetensorsEntry e{{"w", DType::kFloat32, {1024}}, data};
  auto path = d.file("m.safetensors");
  write_safetensors(path, {&e, 1});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  expect_error({"bench", "--model", path}, {"m.safetensors"});
}

// A paired refit with fewer sources than destinations: one line, before any process starts,
// pointing to the resharding options.
TEST(CliErrors, TooFewSourcesIsRefusedWithTheReshardingOptions) {
  for (const char* command : {"bench", "plan"})
    expect_one_line_error(run_cli({command, "--sources", "1", "--destinations", "2"}, 60),
                          {"--sources 1 < --destinations 2", "--src-tp/--src-pp/--src-dp/--src-ep/--src-etp",
                           "--src-fsdp", "--tp/--pp/--ep"});
}

TEST(CliErrors, AnExplicitSourceDataParallelSizeMustAgreeWithTheSourceCount) {
  expect_one_line_error(run_cli({"plan", "--sources", "4", "--src-tp", "2", "--src-dp", "3"}, 60),
                        {"--src-dp 3 disagrees with --sources 4 / (--src-tp 2 x --src-pp 1) = 2"});
  expect_one_line_error(run_cli({"plan", "--sources", "6", "--src-tp", "4"}, 60),
                        {"--sources 6 is not a multiple of --src-tp 4 x --src-pp 1 = 4"});
}

TEST(CliErrors, BadKillSpec) { expect_error({"bench", "--kill", "nobody"}, {"--kill"}); }

}  // namespace
}  // namespace refit
