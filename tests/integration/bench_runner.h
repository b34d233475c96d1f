// `refit bench` on the small MoE between local processes, for the multi-process tests: 1 MiB
// buckets, a 20 s engine timeout, the result's JSON in a temporary folder.
#pragma once

#include <string>
#include <vector>

#include "cli_runner.h"
#include "small_models.h"

namespace refit::testing {

struct SmallBench {
  TempDir dir;
  std::string model = dir.write("config.json", kSmallMoe);
  std::string json = dir.file("result.json");

  CliResult run(int sources, int destinations, int refits, const std::vector<std::string>& extra = {},
                double timeout_s = 120) {
    std::vector<std::string> args = {"bench",
                                     "--model",
                                     model,
                                     "--sources",
                                     std::to_string(sources),
                                     "--destinations",
                                     std::to_string(destinations),
                                     "--refits",
                                     std::to_string(refits),
                                     "--json",
                                     json,
                                     "refit_cfg.nixl.bucket_bytes=1MiB",
                                     "refit_cfg.nixl.timeout_s=20"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(args, timeout_s);
  }
};

}  // namespace refit::testing
