// Fault injection over real processes: 100 seeded trials, each killing one worker (SIGKILL) at a
// random point of a refit. Every trial must fail the refit naming the lost worker and phase
// within the deadline, and recover with a replacement, checked bitwise (see tools/chaos.cpp).
#include <gtest/gtest.h>

#include "cli_runner.h"

namespace refit {
namespace {

TEST(Chaos, HundredKillsAreDetectedAndRecovered) {
  testing::TempDir dir;
  const std::string json = dir.file("chaos.json");
  auto r = testing::run_cli({"chaos", "--trials", "100", "--seed", "20261129", "--timeout", "10", "--json", json}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = testing::read_json(json);
  EXPECT_EQ(j.at("trials").get<int>(), 100);
  EXPECT_EQ(j.at("detected").get<int>(), 100);
  EXPECT_EQ(j.at("behaved").get<int>(), 100);
  EXPECT_LT(j.at("detect_worst_s").get<double>(), 15.0);
  for (const auto& t : j.at("details")) {
    EXPECT_TRUE(t.at("recovered").get<bool>()) << t.dump();
    EXPECT_NE(t.at("error").get<std::string>().find(t.at("victim").get<std::string>()), std::string::npos) << t.dump();
  }
}

}  // namespace
}  // namespace refit
