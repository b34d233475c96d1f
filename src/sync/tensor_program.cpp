#include "refit/tensor_program.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "core/fail.h"

namespace refit {

TensorProgram::TensorProgram() = default;
TensorProgram::~TensorProgram() = default;

namespace {

void check_shape(const TensorInfo& info) {
  if (std::any_of(info.shape.begin(), info.shape.end(), [](int64_t d) { return d < 0; }))
    fail(ErrorKind::kInvalidArgument, "TensorProgram: tensor '{}' has a negative dimension in its shape {}", info.name,
         shape_string(info.shape));
}

}  // namespace

void TensorProgram::add(TensorInfo info, void* data, MemoryKind memory) {
  if (info.name.empty()) fail(ErrorKind::kInvalidArgument, "TensorProgram: a tensor needs a name");
  check_shape(info);
  loads_.add(info, data, memory);  // refuses a name added before and a missing data pointer, naming the tensor
  tensors_.push_back({std::move(info), static_cast<std::byte*>(data), memory});
}

void TensorProgram::add_owned(TensorInfo info, void* data, uint64_t elements, std::shared_ptr<const void> owner) {
  check_shape(info);
  if (info.numel() != elements)
    fail(ErrorKind::kInvalidArgument, "TensorProgram: tensor '{}' of shape {} holds {} elements, its values are {}",
         info.name, shape_string(info.shape), info.numel(), elements);
  add(std::move(info), data, MemoryKind::kHost);
  owned_.push_back(std::move(owner));
}

void TensorProgram::set_report(std::function<std::string()> report) { report_ = std::move(report); }

size_t TensorProgram::size() const { return tensors_.size(); }

uint64_t TensorProgram::bytes() const {
  uint64_t total = 0;
  for (const auto& t : tensors_) total += t.info.nbytes();
  return total;
}

std::unique_ptr<WeightSource> TensorProgram::weights(uint64_t) {
  views_.clear();
  for (const auto& t : tensors_) views_.push_back({&t.info, t.data, t.memory});
  return std::make_unique<ViewSource>(views_);
}

BatchLoader TensorProgram::loader(uint64_t) {
  loading_ = true;
  return loads_.loader();
}

void TensorProgram::stage(uint64_t) {
  // A refit that failed before its report left some tensors marked loaded: count afresh.
  if (loading_) loads_.take_not_loaded();
  loading_ = false;
}

std::string TensorProgram::report(uint64_t index) {
  if (loading_) {
    loading_ = false;
    const std::vector<std::string> missing = loads_.take_not_loaded();
    if (!missing.empty()) {
      constexpr size_t kNamed = 5;
      const size_t named = std::min(missing.size(), kNamed);
      fail(ErrorKind::kLayout,
           "refit {}: no source sent {} of the {} tensors this destination holds ('{}'{}); they still hold their old "
           "bytes",
           index, missing.size(), tensors_.size(), fmt::join(std::span(missing).first(named), "', '"),
           missing.size() > named ? fmt::format(" and {} more", missing.size() - named) : "");
    }
  }
  if (report_) return report_();
  return nlohmann::json{{"tensors", tensors_.size()}, {"bytes", bytes()}}.dump();
}

WorkerProgramFactory tensor_program(std::function<void(bool is_source, int rank, TensorProgram& program)> setup) {
  if (!setup) fail(ErrorKind::kInvalidArgument, "tensor_program: no setup function");
  return [setup = std::move(setup)](bool is_source, int rank) -> std::unique_ptr<WorkerProgram> {
    auto program = std::make_unique<TensorProgram>();
    setup(is_source, rank, *program);
    return program;
  };
}

}  // namespace refit
