#include <algorithm>

#include "core/fail.h"
#include "refit/transport.h"
#include "transport/fault_injection.h"
#include "transport/ucx/ucx_transport.h"

namespace refit {

std::unique_ptr<Transport> create_transport(const std::string& backend_name,
                                            const std::map<std::string, std::string>& init_params) {
  std::string upper = backend_name;
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
  if (upper == "UCX") return maybe_inject_faults(create_ucx_transport(init_params));
  fail(ErrorKind::kConfig, "refit_cfg.nixl.backend_name: unknown transport backend '{}' (expected 'UCX')", backend_name);
}

}  // namespace refit
