#include "refit/parameter_loader.h"

#include <vector>

#include "core/fail.h"
#include "core/name_index.h"
#include "refit/ext/device_memory.h"

namespace refit {
namespace {

// A batch looks its parameters up this many tensors ahead, so that the lookups do not wait on
// memory one after the other.
constexpr size_t kLookAhead = 8;

struct Parameter {
  std::byte* data = nullptr;
  MemoryKind memory = MemoryKind::kHost;
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  bool loaded = false;  // since the loader was made or take_not_loaded() last ran
};

}  // namespace

struct ParameterLoader::Impl {
  explicit Impl(Device d, double t) : stream(d), timeout_s(t) {}
  NameIndex names;
  std::vector<Parameter> parameters;  // by number in `names`
  CopyStream stream;
  double timeout_s;
  std::vector<uint32_t> targets;  // the parameter of each tensor of the batch being loaded
  uint64_t tensors = 0, bytes = 0;
};

ParameterLoader::ParameterLoader(Device device, double timeout_s) : impl_(std::make_unique<Impl>(device, timeout_s)) {
  if (!(timeout_s > 0)) fail(ErrorKind::kInvalidArgument, "ParameterLoader: timeout_s must be > 0, got {}", timeout_s);
}
ParameterLoader::~ParameterLoader() = default;

void ParameterLoader::add(const TensorInfo& parameter, void* data, MemoryKind memory) {
  const uint64_t bytes = parameter.nbytes();
  if (data == nullptr && bytes > 0)
    fail(ErrorKind::kInvalidArgument, "ParameterLoader: parameter '{}' of {} bytes has no data pointer", parameter.name,
         bytes);
  if (!impl_->names.add(parameter.name).added)
    fail(ErrorKind::kInvalidArgument, "ParameterLoader: parameter '{}' was added twice", parameter.name);
  impl_->parameters.push_back({static_cast<std::byte*>(data), memory, parameter.dtype, parameter.shape});
}

size_t ParameterLoader::size() const { return impl_->parameters.size(); }

void ParameterLoader::load(LoadBatch batch) {
  Impl& m = *impl_;
  m.targets.clear();
  uint64_t bytes = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (i + kLookAhead < batch.size()) m.names.prefetch(batch[i + kLookAhead].info->name);
    const TensorView& v = batch[i];
    const auto index = m.names.find(v.info->name);
    if (!index)
      fail(ErrorKind::kLayout, "received tensor '{}' has no parameter here (the loader holds {})", v.info->name,
           m.parameters.size());
    const Parameter& p = m.parameters[*index];
    const uint64_t n = v.info->nbytes();
    if (v.info->dtype != p.dtype || v.info->shape != p.shape)
      fail(ErrorKind::kLayout,
           "received tensor '{}' is {} {} but its parameter here is {} {}: the loader copies bytes as they are and "
           "converts nothing",
           v.info->name, dtype_name(v.info->dtype), shape_string(v.info->shape), dtype_name(p.dtype),
           shape_string(p.shape));
    m.targets.push_back(*index);
    bytes += n;
  }
  // Every tensor checked before any copy; between GPU memory the copies go out as one kernel per ~100.
  for (size_t i = 0; i < batch.size(); ++i) {
    const Parameter& p = m.parameters[m.targets[i]];
    m.stream.copy(p.data, batch[i].data, batch[i].info->nbytes(), p.memory, batch[i].memory);
  }
  if (m.stream.pending()) m.stream.synchronize(deadline_after(std::chrono::duration<double>(m.timeout_s)));
  for (uint32_t target : m.targets) m.parameters[target].loaded = true;  // once the copies are done
  m.tensors += batch.size();
  m.bytes += bytes;
}

BatchLoader ParameterLoader::loader() {
  return [this](LoadBatch batch) { load(batch); };
}

std::vector<std::string> ParameterLoader::take_not_loaded() {
  std::vector<std::string> out;
  for (uint32_t i = 0; i < impl_->parameters.size(); ++i) {
    Parameter& p = impl_->parameters[i];
    if (!p.loaded) out.emplace_back(impl_->names.name(i));
    p.loaded = false;
  }
  return out;
}

uint64_t ParameterLoader::tensors_loaded() const { return impl_->tensors; }
uint64_t ParameterLoader::bytes_loaded() const { return impl_->bytes; }

}  // namespace refit
