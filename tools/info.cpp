#include "info.h"

#include <fmt/format.h>
#include <ucp/api/ucp.h>

#include "refit/memory.h"

namespace refit::tools {

int run_info() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  fmt::print("refit 0.1.0\n");
  fmt::print("host memory:  {:.2f} GiB\n", total_host_memory_bytes() / double(1ull << 30));
  fmt::print("UCX:          {}.{}.{} (run `ucx_info -d` for its transports and devices)\n", major, minor, release);
  fmt::print("CUDA:         not in this build (device: cpu only)\n");
  fmt::print("backends:     UCX\n");
  return 0;
}

}  // namespace refit::tools
