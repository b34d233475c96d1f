// `refit info` and `refit --version` report what this build and machine have.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>
#include <sstream>

#include "cli_runner.h"
#include "refit/config_keys.h"
#include "refit/device.h"
#include "refit/ext/transport.h"
#include "refit/version.h"

namespace refit {
namespace {

using testing::run_cli;

TEST(Info, VersionIsTheHeadersAndThePythonPackagesToo) {
  auto r = run_cli({"--version"}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, std::string("refit ") + kVersionString + "\n");
  std::ifstream pyproject(std::string(REFIT_DATA_DIR) + "/../pyproject.toml");
  std::stringstream text;
  text << pyproject.rdbuf();
  std::smatch m;
  const std::string body = text.str();
  ASSERT_TRUE(std::regex_search(body, m, std::regex(R"(\nversion = "([^"]+)\")"))) << "no version in pyproject.toml";
  EXPECT_EQ(m[1].str(), kVersionString) << "pyproject.toml and include/refit/version.h disagree";
}

TEST(Info, ReportsEachTransportAndTheEffectiveConfig) {
  auto r = run_cli({"info", "refit_cfg.nixl.bucket_bytes=64MiB", "refit_cfg.nixl.timeout_s=42"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(std::string("refit        ") + kVersionString), std::string::npos) << r.output;
  for (const auto& backend : transport_backends()) {
    const std::string line = fmt::format("  {:<10} {:<12} {}", backend.name,
                                         backend.available ? "available" : "unavailable", backend.detail);
    EXPECT_NE(r.output.find(line), std::string::npos) << "missing: " << line << "\nin:\n" << r.output;
  }
  // UCX is always built in; what it offers here is read from UCX itself.
  EXPECT_NE(r.output.find("UCX        available    UCX "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tcp/lo"), std::string::npos) << r.output;
  if (cuda_device_count() == 0) EXPECT_NE(r.output.find("CUDA_IPC   unavailable"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bucket_bytes: 67108864"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("timeout_s: 42"), std::string::npos) << r.output;
}

// `refit info --keys` is the configuration table: every row, under its scope's heading, with its
// default; `--json` the same rows for tools.
TEST(Info, KeysPrintsTheConfigurationTable) {
  auto r = run_cli({"info", "--keys"}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* heading : {"refit_cfg.nixl\n", "\nrefit_cfg.nixl.backend_init_params\n", "\nenvironment\n"})
    EXPECT_NE(r.output.find(heading), std::string::npos) << heading << "\n" << r.output;
  for (const ConfigKey& key : config_keys()) {
    const std::regex row("\n  " + std::string(key.name) + " +[^\n]* default " +
                         std::string(key.default_value.empty() ? "none" : key.default_value) + " ");
    EXPECT_TRUE(std::regex_search(r.output, row)) << key.name << "\n" << r.output;
  }
  auto json = run_cli({"info", "--keys", "--json"}, 30);
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const auto rows = nlohmann::json::parse(json.output);
  ASSERT_EQ(rows.size(), config_keys().size());
  EXPECT_EQ(rows[0]["scope"], "nixl");
  EXPECT_EQ(rows[0]["name"], config_keys()[0].name);
}

TEST(Info, ABadOverrideIsAnError) {
  auto r = run_cli({"info", "refit_cfg.nixl.no_such_key=1"}, 30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no_such_key"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace refit
