// Loads received tensors straight into a destination's own parameters, by name: the loader an
// inference engine writes (look each tensor's parameter up, copy into it), with the per-tensor
// costs taken out. A name is one hash lookup with no allocation, a batch's copies go out
// together (on a GPU one kernel per ~100 tensors, instead of a cudaMemcpyAsync each, which also
// reads memory another process exported faster: docs/GPU.md), and the loader waits for them once
// per batch. Use `loader()` as CheckpointEngine::receive's loader; from Python,
// refit.ParameterLoader. One thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "refit/checkpoint_engine.h"
#include "refit/device.h"
#include "refit/tensor.h"

namespace refit {

class ParameterLoader {
 public:
  // `device`: the GPU whose stream runs the GPU copies (cuda:N, or the calling thread's current
  // device for cuda and cpu). `timeout_s` bounds the wait for a batch's copies.
  explicit ParameterLoader(Device device = {}, double timeout_s = 300);
  ~ParameterLoader();
  ParameterLoader(const ParameterLoader&) = delete;
  ParameterLoader& operator=(const ParameterLoader&) = delete;

  // The parameter `parameter.name`, of that dtype and shape, contiguous at `data` in host or GPU
  // memory. The memory must stay valid while the loader is used. Error(kInvalidArgument) for a
  // name added before.
  void add(const TensorInfo& parameter, void* data, MemoryKind memory);
  size_t size() const;

  // Copies every tensor of `batch` into its parameter, and returns once the copies are done (the
  // views are valid only during a loader call). Error(kLayout) naming the first tensor with no
  // parameter, or of another dtype or shape than its parameter (bytes are never reinterpreted),
  // before anything of the batch is copied.
  void load(LoadBatch batch);
  // load() as a CheckpointEngine loader; the ParameterLoader must outlive it.
  BatchLoader loader();

  // The parameters that no batch loaded since the loader was made or this was last called (after
  // a refit: what no source sent, which still hold their old bytes); starts the count anew.
  std::vector<std::string> take_not_loaded();

  uint64_t tensors_loaded() const;  // since the loader was made
  uint64_t bytes_loaded() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
