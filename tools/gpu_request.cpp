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

namespace {

constexpr int kProbeTimeoutMs = 60'000;

// check_device(device) in a child process (the driver forks the workers later, and a process
// that has made a CUDA call cannot fork children that use CUDA): "" when usable, else the error's
// kind and message as "KIND\nMESSAGE".
std::string probe_device(const Device& device) {
  int out[2];
  if (pipe(out) != 0) throw Error(ErrorKind::kIo, "pipe for the GPU probe");
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw Error(ErrorKind::kIo, "fork for the GPU probe");
  if (pid == 0) {
    close(out[0]);
    std::string answer;
    try {
      check_device(device);
    } catch (const Error& e) {
      answer = fmt::format("{}\n{}", static_cast<int>(e.kind()), e.what());
    }
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
  if (timed_out || !WIFEXITED(status))
    return fmt::format("{}\n{}", static_cast<int>(ErrorKind::kUnsupported),
                       timed_out ? fmt::format("CUDA did not answer within {} s", kProbeTimeoutMs / 1000)
                                 : std::string("the process asking CUDA for its GPUs died"));
  return answer;
}

}  // namespace

void check_gpu_request(const std::string& request, const Device& device) {
  if (request.empty()) return;
  const std::string answer = probe_device(device.kind == Device::Kind::kCuda ? device : Device{Device::Kind::kCuda});
  if (answer.empty()) return;
  const size_t newline = answer.find('\n');
  throw Error(static_cast<ErrorKind>(std::atoi(answer.c_str())), request + ": " + answer.substr(newline + 1));
}

}  // namespace refit::tools
