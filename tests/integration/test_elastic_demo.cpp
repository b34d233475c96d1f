// `refit demo elastic`: destinations join and leave between refits; every phase re-prepares,
// exchanges fresh metadata, refits fully and checks every tensor.
#include <gtest/gtest.h>

#include "cli_runner.h"

namespace refit {
namespace {

using testing::run_cli;

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(ElasticDemo, ChangingDestinationCountsRefitCorrectlyInEveryPhase) {
  auto r = run_cli({"demo", "elastic", "--sequence", "1,3,2,4,1", "--bucket-mb", "1", "--tensor-mb", "3",
                    "refit_cfg.nixl.backend_init_params.tls=posix,sysv,cma,self", "refit_cfg.nixl.timeout_s=20"},
                   120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "ELASTIC_NIXL_PHASE "), 5u) << r.output;
  EXPECT_EQ(count(r.output, "\"status\":\"ok\""), 5u) << r.output;
  EXPECT_NE(r.output.find("\"removed\":[1,2,3]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ELASTIC_NIXL_DEMO_COMPLETED"), std::string::npos) << r.output;
  // 1 + 3 + 2 + 4 + 1 destination refits, each logging the reference's line.
  EXPECT_EQ(count(r.output, "[vLLM refit] Loaded 2 tensors"), 11u) << r.output;
}

TEST(ElasticDemo, BadSequenceIsRefused) {
  for (const std::string bad : {"", "1,0", "2,x"}) {
    auto r = run_cli({"demo", "elastic", "--sequence", bad}, 30);
    EXPECT_NE(r.exit_code, 0) << bad;
    EXPECT_NE(r.output.find("--sequence"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("DEMO_COMPLETED"), std::string::npos);
  }
}

}  // namespace
}  // namespace refit
