// `refit demo elastic`: the reference's elastic-rollout demo with synthetic weights. The set of
// destinations changes from phase to phase; each phase tears the group down, prepares again,
// exchanges fresh metadata, runs a full refit and checks it.
#pragma once

#include <string>
#include <vector>

namespace refit::tools {

struct ElasticOptions {
  std::string sequence = "1,3,2,4,1";  // destination count per phase
  int bucket_mb = 64;
  int tensor_mb = 96;
  std::string config_file;
  std::vector<std::string> overrides;
};

int run_elastic_demo(const ElasticOptions& options);

// "1, 3,2" -> {1, 3, 2}; throws Error(kInvalidArgument) for an empty or non-positive sequence.
std::vector<int> parse_sequence(const std::string& text);

}  // namespace refit::tools
