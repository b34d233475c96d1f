// `refit plan --cluster FILE`: the planner's prediction of one refit on a described cluster
// (prediction.h), for refit's path and the reference's paired path, as a table and as JSON with
// per-bucket timelines (the events `refit bench --json` records, for `python -m refit.timeline`).
#pragma once

#include "plan_command.h"

namespace refit::tools {

int run_cluster_plan(const PlanOptions& options);

}  // namespace refit::tools
