// The planner's model of a refit's streams, shared by the full and the delta predictions.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "refit/prediction.h"

namespace refit {

// What crosses the link from source `source` to destination `destination` for `piece` of what
// the source's weight stream yields of a tensor (`yielded`: the tensor, or the source's shard of
// it): a delta refit's record instead of the piece, sent from the source's own memory.
using Crossing = std::function<TensorInfo(uint32_t source, uint32_t destination, const TensorInfo& piece,
                                          const TensorInfo& yielded)>;

// predict_refit, with each piece replaced by what `crossing` makes of it: paired (no holds),
// source i streams what destination i keeps in one link with the whole bucket; resharding, each
// source streams the plan's pieces on its links. Checks the cluster's ranks.
Prediction predict_stream(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                          const Cluster& cluster, const Crossing& crossing);

}  // namespace refit
