// refit_gpu_ceiling: the copy bandwidths of this machine's GPU path, the ceilings a GPU refit is
// measured against. Times cudaMemcpyAsync on one non-blocking stream with CUDA events and prints
// the median over several copies of the same size:
//   d2d          device to device on one GPU (what a CUDA IPC read on one GPU does)
//   h2d_pinned   pinned host to device (packing from host tensors into GPU buffers; PCIe)
//   d2h_pinned   device to pinned host
//   duplex_pinned  both at once, on two streams, the rate of each direction (the pinned-host path
//                runs both: a source packs into host buffers while its destination loads out of them)
//   h2d_pageable, d2h_pageable   the same from ordinary host memory (for comparison)
//   peer         GPU 0 to GPU 1 when there are two (a CUDA IPC read across GPUs; NVLink/PCIe)
//   nccl_p2p     ncclSend on GPU 1 / ncclRecv on GPU 0 when there are two and NCCL is built (the
//                NCCL transport's data path; one process, one 2-rank communicator per GPU)
// With --model PATH (a config.json or safetensors of refit's models), also what a destination's
// loader gets out of that device copy, copying every tensor of the model from one allocation
// into another:
//   load_per_tensor   one cudaMemcpyAsync per tensor (an inference engine's loader)
//   load_batched      CopyStream::copy of each (one kernel per ~100 tensors)
// GB/s are 1e9 bytes copied per second (a device-to-device copy also reads as many bytes as it
// writes; the rate counts them once, as a refit's throughput does).
//
// Usage: refit_gpu_ceiling [--device N] [--bytes BYTES] [--iterations K] [--json FILE]
//                          [--model PATH] [--calibration-out FILE]  (merged into a planner calibration, cluster.h)
// Exit status: 0, 2 when no GPU is usable, 1 on a CUDA error.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef REFIT_HAVE_NCCL
#include <nccl.h>
#endif

#include <filesystem>

#include "refit/cluster.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"
#include "refit/memory.h"
#include "refit/model.h"

namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(call) + ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

struct Result {
  std::string name;
  double median_gbps = 0;
  double min_gbps = 0;
  double max_gbps = 0;
};

// Times `copy` (which enqueues one copy of `bytes` on `stream`) `iterations` times after a warm-up.
Result measure(const std::string& name, size_t bytes, int iterations, cudaStream_t stream,
               const std::function<void()>& copy) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  copy();  // warm-up: first-touch mappings, peer access set-up
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<double> rates;
  for (int i = 0; i < iterations; ++i) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    copy();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    rates.push_back(static_cast<double>(bytes) / (ms / 1e3) / 1e9);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(rates.begin(), rates.end());
  Result r{name, rates[rates.size() / 2], rates.front(), rates.back()};
  std::printf("%-13s %8.1f GB/s  (min %.1f, max %.1f; %d copies of %.2f GiB)\n", name.c_str(), r.median_gbps,
              r.min_gbps, r.max_gbps, iterations, static_cast<double>(bytes) / (1ull << 30));
  std::fflush(stdout);
  return r;
}

#ifdef REFIT_HAVE_NCCL
void check_nccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) throw std::runtime_error(std::string(call) + ": " + ncclGetErrorString(result));
}

// Point-to-point NCCL bandwidth from GPU `from` to GPU `to`, timed on the receiver's stream.
Result measure_nccl(size_t bytes, int iterations, int to, int from) {
  int devices[2] = {to, from};
  ncclComm_t comms[2];
  check_nccl(ncclCommInitAll(comms, 2, devices), "ncclCommInitAll");
  cudaStream_t streams[2];
  refit::DeviceBuffer recv_buffer(refit::Device{refit::Device::Kind::kCuda, to}, bytes);
  refit::DeviceBuffer send_buffer(refit::Device{refit::Device::Kind::kCuda, from}, bytes);
  for (int i = 0; i < 2; ++i) {
    check(cudaSetDevice(devices[i]), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  auto transfer = [&] {
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    check_nccl(ncclRecv(recv_buffer.data(), bytes, ncclInt8, 1, comms[0], streams[0]), "ncclRecv");
    check_nccl(ncclSend(send_buffer.data(), bytes, ncclInt8, 0, comms[1], streams[1]), "ncclSend");
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  };
  check(cudaSetDevice(to), "cudaSetDevice");
  Result r = measure("nccl_p2p", bytes, iterations, streams[0], transfer);
  for (int i = 0; i < 2; ++i) {
    check(cudaSetDevice(devices[i]), "cudaSetDevice");
    check(cudaStreamSynchronize(streams[i]), "cudaStreamSynchronize");
    cudaStreamDestroy(streams[i]);
    ncclCommDestroy(comms[i]);
  }
  check(cudaSetDevice(to), "cudaSetDevice");
  return r;
}
#endif

void usage() {
  std::fprintf(stderr,
               "usage: refit_gpu_ceiling [--device N] [--bytes BYTES] [--iterations K] [--json FILE] "
               "[--model PATH] [--calibration-out FILE]\n");
  std::exit(64);
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0;
  size_t bytes = size_t{1} << 30;
  int iterations = 10;
  std::string json_path, calibration_path, model_path;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (arg == "--device") {
      device = std::stoi(value());
    } else if (arg == "--bytes") {
      bytes = std::stoull(value());
    } else if (arg == "--iterations") {
      iterations = std::max(1, std::stoi(value()));
    } else if (arg == "--json") {
      json_path = value();
    } else if (arg == "--model") {
      model_path = value();
    } else if (arg == "--calibration-out") {
      calibration_path = value();
    } else {
      usage();
    }
  }

  std::string reason;
  const int count = refit::cuda_device_count(&reason);
  if (count == 0) {
    std::fprintf(stderr, "refit_gpu_ceiling: no usable GPU: %s\n", reason.c_str());
    return 2;
  }
  try {
    refit::Device gpu{refit::Device::Kind::kCuda, device};
    refit::check_device(gpu);
    cudaDeviceProp properties{};
    check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
    std::printf("device cuda:%d %s, %.1f GiB, %d GPU(s) visible; copies of %zu bytes\n", device, properties.name,
                static_cast<double>(properties.totalGlobalMem) / (1ull << 30), count, bytes);
    check(cudaSetDevice(device), "cudaSetDevice");
    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");

    std::vector<Result> results;
    {
      refit::DeviceBuffer a(gpu, bytes), b(gpu, bytes);
      results.push_back(measure("d2d", bytes, iterations, stream, [&] {
        check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
      }));
      refit::HostBuffer host(bytes);
      std::memset(host.data(), 1, bytes);  // fault the pages in before timing
      {
        refit::HostPin pin = refit::HostPin::pin(host.data(), bytes);
        if (!pin.pinned()) throw std::runtime_error("cannot pin host memory: " + pin.reason());
        results.push_back(measure("h2d_pinned", bytes, iterations, stream, [&] {
          check(cudaMemcpyAsync(a.data(), host.data(), bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
        }));
        results.push_back(measure("d2h_pinned", bytes, iterations, stream, [&] {
          check(cudaMemcpyAsync(host.data(), a.data(), bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
        }));
        refit::HostBuffer other(bytes);
        std::memset(other.data(), 2, bytes);
        refit::HostPin other_pin = refit::HostPin::pin(other.data(), bytes);
        if (!other_pin.pinned()) throw std::runtime_error("cannot pin host memory: " + other_pin.reason());
        cudaStream_t side;
        cudaEvent_t fork, join;
        check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
        check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "cudaEventCreate");
        check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "cudaEventCreate");
        results.push_back(measure("duplex_pinned", bytes, iterations, stream, [&] {
          check(cudaEventRecord(fork, stream), "cudaEventRecord");
          check(cudaStreamWaitEvent(side, fork), "cudaStreamWaitEvent");
          check(cudaMemcpyAsync(other.data(), b.data(), bytes, cudaMemcpyDeviceToHost, side), "cudaMemcpyAsync");
          check(cudaMemcpyAsync(a.data(), host.data(), bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
          check(cudaEventRecord(join, side), "cudaEventRecord");
          check(cudaStreamWaitEvent(stream, join), "cudaStreamWaitEvent");
        }));
        cudaEventDestroy(fork);
        cudaEventDestroy(join);
        cudaStreamDestroy(side);
      }
      const int pageable_iterations = std::max(1, iterations / 2);
      results.push_back(measure("h2d_pageable", bytes, pageable_iterations, stream, [&] {
        check(cudaMemcpyAsync(a.data(), host.data(), bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
      }));
      results.push_back(measure("d2h_pageable", bytes, pageable_iterations, stream, [&] {
        check(cudaMemcpyAsync(host.data(), a.data(), bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
      }));
      if (count >= 2) {
        const int other = device == 0 ? 1 : 0;
        int can_access = 0;
        check(cudaDeviceCanAccessPeer(&can_access, device, other), "cudaDeviceCanAccessPeer");
        if (can_access) {
          cudaError_t status = cudaDeviceEnablePeerAccess(other, 0);
          if (status != cudaErrorPeerAccessAlreadyEnabled) check(status, "cudaDeviceEnablePeerAccess");
          cudaGetLastError();
        }
        refit::DeviceBuffer remote(refit::Device{refit::Device::Kind::kCuda, other}, bytes);
        std::printf("peer: cuda:%d -> cuda:%d, peer access %s\n", other, device, can_access ? "on" : "off (staged)");
        results.push_back(measure("peer", bytes, iterations, stream, [&] {
          check(cudaMemcpyPeerAsync(a.data(), device, remote.data(), other, bytes, stream), "cudaMemcpyPeerAsync");
        }));
#ifdef REFIT_HAVE_NCCL
        results.push_back(measure_nccl(bytes, iterations, device, other));
#endif
      }
    }
    if (!model_path.empty()) {
      // Every tensor of the model, 256-byte aligned in one allocation, into another.
      const refit::ModelInventory model = refit::load_model_inventory(model_path);
      struct Copy {
        void* dst;
        const void* src;
        size_t bytes;
      };
      std::vector<Copy> copies;
      uint64_t total = 0, payload = 0;
      for (const auto& t : model.tensors) {
        copies.push_back({nullptr, nullptr, t.nbytes()});
        payload += t.nbytes();
        total += (t.nbytes() + 255) / 256 * 256;
      }
      refit::DeviceBuffer from(gpu, total), to(gpu, total);
      uint64_t offset = 0;
      for (auto& c : copies) {
        c.src = from.data() + offset;
        c.dst = to.data() + offset;
        offset += (c.bytes + 255) / 256 * 256;
      }
      std::printf("model %s: %zu tensors, %.2f GiB\n", model.name.c_str(), copies.size(),
                  static_cast<double>(payload) / (1ull << 30));
      refit::CopyStream loads(gpu);
      // Timed on the wall clock from issue to completion, as a loader's batch is.
      auto timed = [&](const std::string& name, const std::function<void()>& issue) {
        std::vector<double> rates;
        auto wait = [&] {
          loads.synchronize(refit::deadline_after(std::chrono::seconds(60)));
          check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        };
        issue();  // warm-up
        wait();
        for (int i = 0; i < iterations; ++i) {
          const auto start = std::chrono::steady_clock::now();
          issue();
          wait();
          rates.push_back(static_cast<double>(payload) /
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 1e9);
        }
        std::sort(rates.begin(), rates.end());
        Result r{name, rates[rates.size() / 2], rates.front(), rates.back()};
        std::printf("%-15s %8.1f GB/s  (min %.1f, max %.1f; %d loads of the model, wall clock)\n", name.c_str(),
                    r.median_gbps, r.min_gbps, r.max_gbps, iterations);
        results.push_back(r);
      };
      timed("load_per_tensor", [&] {
        for (const auto& c : copies)
          check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
      });
      timed("load_batched", [&] {
        for (const auto& c : copies)
          loads.copy(c.dst, c.src, c.bytes, refit::MemoryKind::kCuda, refit::MemoryKind::kCuda);
      });
    }
    cudaStreamDestroy(stream);

    std::string json = "{\"device\": \"" + std::string(properties.name) + "\", \"bytes\": " + std::to_string(bytes) +
                       ", \"iterations\": " + std::to_string(iterations);
    for (const Result& r : results) {
      char field[160];
      std::snprintf(field, sizeof(field), ", \"%s_GBps\": %.2f", r.name.c_str(), r.median_gbps);
      json += field;
    }
    json += "}";
    std::printf("%s\n", json.c_str());
    if (!calibration_path.empty()) {
      refit::Calibration c;
      if (std::filesystem::exists(calibration_path)) refit::load_calibration(calibration_path, c);
      c.machine = properties.name;
      for (const Result& r : results) {
        const double rate = r.median_gbps * 1e9;
        if (r.name == "d2d") c.device_copy_rate = rate;
        if (r.name == "peer") c.peer_copy_rate = rate;
        if (r.name == "nccl_p2p") c.nccl_rate = rate;
        if (r.name == "duplex_pinned") c.duplex_pinned_copy_rate = rate;
        if (r.name == "h2d_pinned" || r.name == "d2h_pinned")
          c.pinned_copy_rate = c.pinned_copy_rate > 0 ? std::min(c.pinned_copy_rate, rate) : rate;
      }
      refit::save_calibration(calibration_path, c);
    }
    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f == nullptr) throw std::runtime_error("cannot write " + json_path);
      std::fprintf(f, "%s\n", json.c_str());
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "refit_gpu_ceiling: %s\n", e.what());
    return 1;
  }
  return 0;
}
