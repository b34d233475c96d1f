#include "info.h"

#include <fmt/format.h>

#include "refit/config.h"
#include "refit/device.h"
#include "refit/memory.h"
#include "refit/transport.h"
#include "refit/version.h"

namespace refit::tools {

int run_info(const InfoOptions& options) {
  const RefitConfig config = load_config(options.config_file, options.overrides);
  fmt::print("refit        {}\n", kVersionString);
  fmt::print("host memory  {:.2f} GiB\n", total_host_memory_bytes() / double(1ull << 30));
  std::string no_gpu;
  const int gpus = cuda_device_count(&no_gpu);
  if (!cuda_built())
    fmt::print("CUDA         not in this build (REFIT_WITH_CUDA=OFF or no toolkit at build time): device cpu only\n");
  else if (gpus > 0)
    fmt::print("CUDA         built; {} GPU(s) seen, the first with {:.2f} GiB\n", gpus,
               total_device_memory_bytes(Device{Device::Kind::kCuda, 0}) / double(1ull << 30));
  else
    fmt::print("CUDA         built; no usable GPU: {}\n", no_gpu);
  fmt::print("transports\n");
  for (const auto& backend : transport_backends())
    fmt::print("  {:<10} {:<12} {}\n", backend.name, backend.available ? "available" : "unavailable", backend.detail);
  fmt::print("effective configuration{}:\n{}", options.config_file.empty() ? " (defaults and overrides)" : "",
             to_yaml(config));
  return 0;
}

}  // namespace refit::tools
