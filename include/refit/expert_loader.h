// Direct copy of received routed-expert slices into a destination's canonical fused expert
// storage (the reference's VllmShardedExpertRefitMixin), with no loader callback:
//   w13 [E_local, 2*I/tp, H]: gate (w1) into [:, 0:S, :], up (w3) into [:, S:2S, :], S = dim 1 / 2
//   w2  [E_local, H, I/tp]:   down (w2) whole.
// A destination slot smaller than the storage (padded storage) gets its leading block written;
// slots the batch does not name are untouched.
//
// Differences from the reference, on purpose: a received expert the destination cannot place
// (unknown parameter, unowned expert id, slot out of range, wrong dtype/ndim/shape, twice in
// one batch) is an Error(kLayout) naming the tensor and destination rank, never skipped; every
// HF expert name is copied directly (the reference hands full-shape, non-EP experts to vLLM's
// loader, which ends in the same bytes).
//
// Storage problems are reported as the reference's V31-V38 (kUnsupported for what refit cannot
// do: transposed, quantized other than block-scaled FP8, or non-Triton storage, EPLB, redundant experts;
// kLayout for a description that does not add up). Unlike the reference (V40), FP8 experts load:
// a received "<expert weight>_scale_inv" goes where its weight goes, in scale blocks (gate's, then
// up's, in w13_weight_scale_inv; down's in w2_weight_scale_inv), sliced with it by the layout
// (layout_from_compact), which refuses a TP slice that cuts a 128 x 128 block. An ExpertLoader is
// used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/layout_builders.h"
#include "refit/model.h"
#include "refit/tensor.h"

namespace refit {

// One fused expert parameter as the destination holds it (vLLM attribute in brackets).
struct ExpertStorage {
  std::string name;  // "<prefix>.routed_experts.w13_weight" or "...w2_weight"
  DType dtype = DType::kBFloat16;
  std::vector<int64_t> shape;                      // [E_local, 2*I/tp, H] or [E_local, H, I/tp]
  std::byte* data = nullptr;                       // contiguous row-major host memory
  bool transposed = false;                         // [param.is_transposed]
  bool loader_inspectable = true;                  // [param.weight_loader.__self__ resolves]
  std::string quant_method;                        // [owner.quant_config]; empty: unquantized
  std::string moe_backend = "TRITON";              // [quant_method.unquantized_backend.name]
  int tp_rank = 0;                                 // [moe_config.tp_rank]
  int tp_size = 1;                                 // [moe_config.tp_size]
  bool use_ep = false;                             // [owner.use_ep]
  bool eplb = false;                               // [moe_parallel_config.enable_eplb]
  std::optional<std::vector<int64_t>> expert_map;  // [owner._expert_map]: global id -> local slot or -1
  int64_t num_logical_experts = 0;                 // [moe_config.num_logical_experts]; 0: expert_map size
  int64_t global_num_experts = 0;                  // [owner.global_num_experts]; 0: num_logical_experts
};

// The reference's _checkpoint_engine_weight_layout: validates every parameter (V31-V38, in the
// reference's order) and returns the expert part of the compact layout (local_expert_ids are
// ascending global ids when EP is on). Missing prefixes are the caller's (pp_missing_prefixes).
CompactLayout expert_layout_from_storage(std::span<const ExpertStorage> storage, int destination_rank);

struct ExpertLoadResult {
  std::vector<TensorView> remaining;  // non-expert tensors of the batch, in order, for the loader callback
  uint64_t experts = 0;               // expert tensors written
  uint64_t copies = 0;                // block copies issued (a run of adjacent experts is one)
};

class ExpertLoader {
 public:
  // `inventory` gives the full (unsharded) HF shapes; `storage` is validated as by
  // expert_layout_from_storage. FP8 weight storage (float8_e4m3fn, quant_method "fp8") needs its
  // block-scale storage "<name>_scale_inv" beside it (float32, [E_local, 2 * row blocks, column
  // blocks] for w13, [E_local, H blocks, I/tp blocks] for w2), which takes the weight's TP and EP;
  // other FP8 scalings are kUnsupported.
  ExpertLoader(const ModelInventory& inventory, std::vector<ExpertStorage> storage, int destination_rank);

  // Writes the batch's expert tensors into storage. Host views only (kUnsupported otherwise).
  // On error nothing of the failing batch is written (every tensor is checked first).
  ExpertLoadResult load(std::span<const TensorView> batch);

 private:
  struct Param {
    ExpertStorage storage;
    std::vector<int64_t> slot_of;  // global id -> local slot or -1; empty: slot = global id
  };
  std::map<std::string, Param, std::less<>> params_;
  std::map<std::string, std::vector<int64_t>, std::less<>> full_shapes_;  // expert tensors of the inventory
  int destination_rank_;
};

}  // namespace refit
