#include "gpu_request.h"

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "bench.h"
#include "refit/device.h"
#include "refit/error.h"

namespace refit::tools {

std::string gpu_request(const BenchOptions& options, const RefitConfig& config, MemoryKind tensors) {
  if (config.device.kind == Device::Kind::kCuda)
    return options.device.empty() ? "refit_cfg.nixl.device=" + to_string(config.device) : "--device " + options.device;
  if (tensors == MemoryKind::kCuda) return "--tensors cuda";
  std::string backend = config.backend_name;
  std::transform(backend.begin(), backend.end(), backend.begin(), [](unsigned char c) { return std::toupper(c); });
  if (backend == "CUDA_IPC" || backend == "NCCL") return "refit_cfg.nixl.backend_name=" + config.backend_name;
  return "";
}

std::string no_gpu_message(const std::string& request, bool cuda_built, const std::string& reason) {
  if (!cuda_built)
    return fmt::format(
        "{} needs a GPU, but this build of refit has no CUDA: rebuild it with -DREFIT_WITH_CUDA=ON on a host with the "
        "CUDA toolkit (nvcc), or use the CPU (--device cpu)",
        request);
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  return fmt::format(
      "{} needs a GPU, but CUDA finds no usable one here: {}{}; check the driver with nvidia-smi, or "
      "use the CPU (--device cpu)",
      request, reason, visible ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", visible) : "");
}

namespace {

constexpr int kProbeTimeoutMs = 60'000;

// The GPUs CUDA sees, and why there are none, asked in a child process: the driver forks the
// workers later, and a process that has made a CUDA call cannot fork children that use CUDA.
int probe_gpus(std::string& reason) {
  int out[2];
  if (pipe(out) != 0) throw Error(ErrorKind::kIo, "pipe for the GPU probe");
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw Error(ErrorKind::kIo, "fork for the GPU probe");
  if (pid == 0) {
    close(out[0]);
    std::string why;
    const std::string answer = fmt::format("{}\n{}", cuda_device_count(&why), why);
    [[maybe_unused]] ssize_t n = write(out[1], answer.data(), answer.size());
    _exit(0);
  }
  close(out[1]);
  // A driver that hangs in its initialization must not hang the bench: the probe has a deadline.
  std::string answer;
  char buf[512];
  bool timed_out = false;
  for (;;) {
    pollfd readable{out[0], POLLIN, 0};
    if (poll(&readable, 1, kProbeTimeoutMs) <= 0) {
      timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    const ssize_t n = read(out[0], buf, sizeof buf);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const size_t newline = answer.find('\n');
  if (timed_out || !WIFEXITED(status) || newline == std::string::npos) {
    reason = timed_out ? fmt::format("CUDA did not answer within {} s", kProbeTimeoutMs / 1000)
                       : "the process asking CUDA for its GPUs died";
    return 0;
  }
  reason = answer.substr(newline + 1);
  return std::atoi(answer.c_str());
}

}  // namespace

void check_gpu_request(const std::string& request, const Device& device) {
  if (request.empty()) return;
  if (!cuda_built()) throw Error(ErrorKind::kUnsupported, no_gpu_message(request, false, ""));
  std::string reason;
  const int gpus = probe_gpus(reason);
  if (gpus == 0) throw Error(ErrorKind::kUnsupported, no_gpu_message(request, true, reason));
  if (device.index >= gpus)
    throw Error(ErrorKind::kConfig, fmt::format("{}: this machine has {} GPU{} (cuda:0..cuda:{})", request, gpus,
                                                gpus == 1 ? "" : "s", gpus - 1));
}

}  // namespace refit::tools
