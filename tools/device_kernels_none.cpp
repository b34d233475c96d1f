// The bench's GPU kernels in a build without CUDA (tools/device_kernels.cu has the real ones).
#ifndef REFIT_HAVE_CUDA
#include "device_kernels.h"
#include "refit/error.h"

namespace refit::tools {
namespace {

[[noreturn]] void no_cuda() {
  throw Error(ErrorKind::kUnsupported,
              "GPU-resident bench tensors need CUDA: this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON");
}

}  // namespace

void fill_device_pattern(std::byte*, uint64_t, uint64_t, void*) { no_cuda(); }
void change_device_elements(std::byte*, uint64_t, uint32_t, uint64_t, uint64_t, void*) { no_cuda(); }
std::vector<uint64_t> hash_device_ranges(const std::vector<DeviceRange>&, void*) { no_cuda(); }

}  // namespace refit::tools
#endif
