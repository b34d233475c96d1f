// The planner's model of the paired path, shared by the full and the delta predictions.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "refit/prediction.h"

namespace refit {

// What crosses destination `destination`'s link for `piece` (what the destination keeps of tensor
// `whole`): a delta refit's record instead of the piece, sent from the source's own memory.
using PairedCrossing =
    std::function<TensorInfo(uint32_t destination, const TensorInfo& piece, const TensorInfo& whole)>;

// Source i streams what destination i keeps (needs[i]) in one link with the whole bucket, the
// pieces themselves or, given `crossing`, what it makes of each. Checks the cluster's ranks.
Prediction predict_paired_stream(const ModelInventory& model, std::span<const Layout> needs, const Cluster& cluster,
                                 const PairedCrossing& crossing = {});

}  // namespace refit
