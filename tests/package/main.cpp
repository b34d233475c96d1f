// Uses refit through its installed headers and package only: the built-in model's inventory, its
// bucket plan, and a UCX transport.
#include <cstdio>

#include "refit/ext/transport.h"
#include "refit/model.h"
#include "refit/plan.h"
#include "refit/version.h"

int main() {
  const refit::ModelInventory model = refit::load_model_inventory(refit::kDefaultModel);
  const refit::BucketPlan plan = refit::plan_buckets(model.tensors, 64ull << 20);
  auto transport = refit::create_transport("UCX", {});
  if (model.tensors.size() != 459 || plan.buckets.empty() || transport->address().empty()) {
    std::fprintf(stderr, "refit_consumer: unexpected model %zu tensors, %zu buckets\n", model.tensors.size(),
                 plan.buckets.size());
    return 1;
  }
  std::printf("refit %s: %s, %zu tensors in %zu buckets of 64 MiB, UCX transport up\n", refit::kVersionString,
              model.name.c_str(), model.tensors.size(), plan.buckets.size());
  return 0;
}
