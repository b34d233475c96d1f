// A model's tensor names sorted so that a layout resolves to one request per tensor in
// O(tensors + entries + prefixes · log tensors): plan_transfers resolves hundreds of layouts of
// models with tens of thousands of tensors, where request_for per tensor would scan every
// dropped prefix each time.
#pragma once

#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/fp8.h"
#include "refit/layout.h"
#include "refit/model.h"

namespace refit {

// Empty if `slice` fits `info`, else what is wrong (for error messages).
std::string slice_problem(const TensorInfo& info, const Slice& slice);

// A source's layout says what it holds, a destination's what it needs. Only a destination must
// take each FP8 scale exactly as its weight's slice needs (a source may hold scales sharded on
// their own, as FSDP shards every tensor).
enum class LayoutRole { kSource, kDestination };

// resolve() may run on several threads at once.
class LayoutResolver {
 public:
  explicit LayoutResolver(const ModelInventory& inventory);  // keeps a reference

  // The request for every inventory tensor, by index, as Layout::request_for gives it; a slice
  // that covers its whole dimension comes back as whole. Checks what validate_layout checks and
  // throws Error(kLayout) naming `owner` ("source rank 2"); for a destination, also that every
  // FP8 scale is requested as fp8_scale_request says.
  // `out` is reused: resolving hundreds of layouts then allocates once.
  void resolve(const Layout& layout, LayoutRole role, std::string_view owner, std::vector<Request>& out) const;
  // The model's FP8 scales (fp8_scales_of), found once.
  const std::vector<Fp8ScaleOf>& fp8_scales() const { return scales_; }

 private:
  const std::vector<uint32_t>& sorted() const;
  void check_fp8_scales(std::span<const Request> requests, std::string_view owner) const;

  const ModelInventory& inventory_;
  // Inventory indices in name order, sorted on first use.
  mutable std::once_flag sorted_once_;
  mutable std::vector<uint32_t> sorted_;
  const std::vector<Fp8ScaleOf> scales_;
};

}  // namespace refit
