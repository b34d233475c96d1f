// A worker program that is only the named tensors a worker holds: a source sends them, a
// destination copies what it receives into them by name. The short way to a WorkerProgram
// (worker_program.h) when the weights stay where they are between refits:
//
//   group.program = refit::tensor_program([](bool is_source, int rank, refit::TensorProgram& p) {
//     p.add("w", std::vector<float>(1 << 20, is_source ? 1.5f : 0.0f));
//   });
//
// A destination loads through a ParameterLoader (parameter_loader.h): a received tensor with no
// tensor of its name here, or of another dtype or shape, fails the refit, naming it, before
// anything of its batch is copied; a tensor it holds that no source sent fails that refit's
// report (it still holds its old bytes). A program that does more (weights made for each refit,
// its own loader, weights moved into engine memory for in-place reads) implements WorkerProgram.
// One thread at a time.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "refit/dtype.h"
#include "refit/parameter_loader.h"
#include "refit/tensor.h"
#include "refit/worker_program.h"

namespace refit {

class TensorProgram final : public WorkerProgram {
 public:
  TensorProgram();
  ~TensorProgram() override;

  // A tensor in the caller's memory: info.nbytes() contiguous row-major bytes at `data`, in host
  // or GPU memory, valid as long as the program. Error(kInvalidArgument) naming the tensor for
  // an empty name, a name added before, or no data.
  void add(TensorInfo info, void* data, MemoryKind memory);
  // A host tensor the program keeps: `values` (moved in), of shape `shape` (empty: one dimension
  // of values.size()) and dtype dtype_of<T>(). Returns the program's memory of it. Also
  // Error(kInvalidArgument) when the shape does not hold values.size() elements.
  template <class T>
  std::span<T> add(std::string name, std::vector<T>&& values, std::vector<int64_t> shape = {}) {
    static_assert(!std::is_same_v<T, bool>, "std::vector<bool> holds no array of bool: use uint8_t");
    auto owned = std::make_shared<std::vector<T>>(std::move(values));
    TensorInfo info{std::move(name), dtype_of<T>(), std::move(shape)};
    if (info.shape.empty()) info.shape = {static_cast<int64_t>(owned->size())};
    add_owned(std::move(info), owned->data(), owned->size(), owned);
    return std::span<T>(*owned);
  }

  // What report() returns after each refit instead of the default: e.g. a value to print.
  void set_report(std::function<std::string()> report);

  size_t size() const;  // tensors added
  uint64_t bytes() const;

  // Every tensor, in the order added.
  std::unique_ptr<WeightSource> weights(uint64_t index) override;
  BatchLoader loader(uint64_t index) override;
  void stage(uint64_t index) override;
  // After a refit whose loader() was asked for (a destination's), first: Error(kLayout) naming
  // the tensors no batch loaded. Then set_report's text, or JSON {"tensors": N, "bytes": B}.
  std::string report(uint64_t index) override;

 private:
  void add_owned(TensorInfo info, void* data, uint64_t elements, std::shared_ptr<const void> owner);

  struct Held {
    TensorInfo info;
    std::byte* data;
    MemoryKind memory;
  };
  std::deque<Held> tensors_;  // stable: views_ point into it
  std::vector<std::shared_ptr<const void>> owned_;
  std::vector<TensorView> views_;  // of the last weights()
  ParameterLoader loads_;
  bool loading_ = false;  // loader() was asked for since the last stage() or report()
  std::function<std::string()> report_;
};

// A WorkerProgramFactory (GroupOptions::program) of TensorPrograms, each filled by `setup` inside
// its worker process, for that worker's role and rank.
WorkerProgramFactory tensor_program(std::function<void(bool is_source, int rank, TensorProgram& program)> setup);

}  // namespace refit
