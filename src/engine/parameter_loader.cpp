#include "refit/parameter_loader.h"

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "core/fail.h"
#include "core/name_index.h"
#include "delta/codec.h"
#include "delta/device_delta.h"
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
  // A tied parameter (another name of the same memory, dtype and shape): its group's number.
  int32_t tie = -1;
  uint64_t loads = 0;  // times loaded: a tied one loaded fewer times than another of its memory comes second
};

}  // namespace

struct ParameterLoader::Impl {
  explicit Impl(Device d, double t) : stream(d), timeout_s(t) {}
  NameIndex names;
  std::vector<Parameter> parameters;  // by number in `names`
  CopyStream stream;
  double timeout_s;
  std::vector<uint32_t> targets;  // the parameter of each tensor of the batch being loaded
  std::vector<bool> there;        // ... whose bytes are there already (a tied weight's second name)
  uint64_t tensors = 0, bytes = 0;
  std::map<const std::byte*, uint32_t> by_address;  // the first parameter of each memory range
  std::vector<std::vector<uint32_t>> ties;          // tied parameters, by group
  std::unique_ptr<DeviceDelta> gpu;                 // hashes GPU memory where a tie is checked

  // Whether `n` bytes at `a` and at `b` are the same: compared on the host, hashed where either
  // is GPU memory.
  bool same_bytes(const std::byte* a, MemoryKind a_kind, const std::byte* b, MemoryKind b_kind, uint64_t n) {
    if (a_kind == MemoryKind::kHost && b_kind == MemoryKind::kHost) return std::memcmp(a, b, n) == 0;
    auto hash = [&](const std::byte* data, MemoryKind kind) {
      if (kind == MemoryKind::kHost) return delta_checksum({data, n}, DeltaChecksum::kWords);
      if (!gpu) gpu = std::make_unique<DeviceDelta>();
      return gpu->checksum(data, n, DeltaChecksum::kWords);
    };
    return hash(a, a_kind) == hash(b, b_kind);
  }
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
  Impl& m = *impl_;
  if (m.names.contains(parameter.name))
    fail(ErrorKind::kInvalidArgument, "ParameterLoader: parameter '{}' was added twice", parameter.name);
  auto* begin = static_cast<std::byte*>(data);
  // Parameters must not share memory, unless they are one tensor under two names (a tied weight):
  // a refit would otherwise leave one holding the other's bytes.
  std::optional<uint32_t> tied_to;  // the parameter whose memory this one is
  if (bytes > 0) {
    auto next = m.by_address.upper_bound(begin);
    for (auto it : {next, next == m.by_address.begin() ? m.by_address.end() : std::prev(next)}) {
      if (it == m.by_address.end()) continue;
      const Parameter& other = m.parameters[it->second];
      const uint64_t other_bytes = TensorInfo{"", other.dtype, other.shape}.nbytes();
      if (it->first >= begin + bytes || it->first + other_bytes <= begin) continue;
      if (it->first != begin || other.dtype != parameter.dtype || other.shape != parameter.shape)
        fail(ErrorKind::kInvalidArgument,
             "ParameterLoader: parameter '{}' ({} {}) overlaps the memory of parameter '{}' ({} {}) without being the "
             "same tensor: a refit would leave one holding the other's bytes (give each its own memory; a tied weight "
             "is the same memory, dtype and shape under two names)",
             parameter.name, dtype_name(parameter.dtype), shape_string(parameter.shape), m.names.name(it->second),
             dtype_name(other.dtype), shape_string(other.shape));
      tied_to = it->second;
    }
  }
  m.names.add(parameter.name);
  const auto index = static_cast<uint32_t>(m.parameters.size());
  m.parameters.push_back({begin, memory, parameter.dtype, parameter.shape});
  if (!tied_to) {
    if (bytes > 0) m.by_address.emplace(begin, index);
    return;
  }
  Parameter& first = m.parameters[*tied_to];
  if (first.tie < 0) {
    first.tie = static_cast<int32_t>(m.ties.size());
    m.ties.push_back({*tied_to});
  }
  m.parameters.back().tie = first.tie;
  m.ties[first.tie].push_back(index);
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
  // A tied parameter takes one tensor under two names: what arrives under the second must be what
  // arrived under the first (earlier in this batch, or in an earlier batch: a name of its memory
  // loaded more times than this one), or the source's model is not tied as this one is. Compared
  // instead of copied: its bytes are there.
  m.there.assign(batch.size(), false);
  for (size_t i = 0; i < batch.size() && !m.ties.empty(); ++i) {
    Parameter& p = m.parameters[m.targets[i]];
    if (p.tie < 0) continue;
    const TensorView* earlier = nullptr;
    for (size_t j = 0; j < i && !earlier; ++j)
      if (m.parameters[m.targets[j]].tie == p.tie) earlier = &batch[j];
    uint32_t ahead = UINT32_MAX;  // a name of this memory loaded more times
    uint64_t most = p.loads;
    for (uint32_t member : m.ties[p.tie])
      if (m.parameters[member].loads > most) most = m.parameters[ahead = member].loads;
    if (!earlier && ahead == UINT32_MAX) continue;
    const uint64_t n = batch[i].info->nbytes();
    const bool same = earlier ? m.same_bytes(earlier->data, earlier->memory, batch[i].data, batch[i].memory, n)
                              : m.same_bytes(p.data, p.memory, batch[i].data, batch[i].memory, n);
    if (same) {
      m.there[i] = true;
      continue;
    }
    const std::string other = earlier ? earlier->info->name : std::string(m.names.name(ahead));
    p.loads = most;  // caught up: a source that sends the names in another order is checked the other way
    fail(ErrorKind::kLayout,
         "received tensors '{}' and '{}' differ, but their parameters here are one memory (tied): the source's "
         "model does not tie them as this one does",
         other, batch[i].info->name);
  }
  // Every tensor checked before any copy; between GPU memory the copies go out as one kernel per ~100.
  for (size_t i = 0; i < batch.size(); ++i) {
    const Parameter& p = m.parameters[m.targets[i]];
    if (!m.there[i]) m.stream.copy(p.data, batch[i].data, batch[i].info->nbytes(), p.memory, batch[i].memory);
  }
  if (m.stream.pending()) m.stream.synchronize(deadline_after(std::chrono::duration<double>(m.timeout_s)));
  for (uint32_t target : m.targets) {  // once the copies are done
    m.parameters[target].loaded = true;
    ++m.parameters[target].loads;
  }
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
