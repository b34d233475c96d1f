#include "programs.h"

#include <fmt/format.h>
#include <signal.h>
#include <xxhash.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>

#include "device_kernels.h"
#include "parallel_options.h"
#include "refit/device.h"
#include "refit/error.h"
#include "refit/ext/box_copy.h"
#include "refit/ext/device_memory.h"
#include "refit/ext/tensor_memory.h"
#include "refit/memory.h"
#include "refit/parameter_loader.h"
#include "refit/safetensors.h"

namespace refit::tools {
namespace {

using nlohmann::json;

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

// Synthetic content: 8-byte word w of tensor `tensor` in refit `refit` is a hash of the three, so
// any process computes any slice of any tensor without the rest.
uint64_t seed_of(uint64_t refit, uint64_t tensor) { return refit * 1000003 + tensor; }
uint64_t content_word(uint64_t seed, uint64_t word) {
  uint64_t state = seed * 0xD6E8FEB86659FD93ull + word;
  return splitmix64(state);
}

// Writes `box` of the tensor `full` (packed, box_copy.h) as the content of `seed`.
void fill_box(std::byte* out, const TensorInfo& full, const Box& box, uint64_t seed) {
  const uint64_t total = box.nbytes_in(full);
  for_each_box_block(full.shape, dtype_size(full.dtype), box, 0, total, [&](const BoxBlock& b) {
    for (uint64_t r = 0; r < b.rows; ++r) {
      const uint64_t at = b.tensor_offset + r * b.pitch;  // byte offset in the whole tensor
      std::byte* row = out + b.packed_offset + r * b.row_bytes;
      uint64_t j = 0;
      while (j < b.row_bytes) {
        const uint64_t word = (at + j) / 8, skip = (at + j) % 8;
        const uint64_t value = content_word(seed, word);
        const uint64_t n = std::min<uint64_t>(8 - skip, b.row_bytes - j);
        std::memcpy(row + j, reinterpret_cast<const std::byte*>(&value) + skip, n);
        j += n;
      }
    }
  });
}

// The delta workload's step: `share` of a tensor's elements, at positions drawn from the refit's
// seed, move by one or two units in the last place, up or down (their bytes as a little-endian
// integer, modulo 2^bits), as an optimizer step moves a bf16 weight. `at(element)` gives where
// element `element` of the whole tensor lies, or null where it is not ours.
template <typename At>
void step_elements(const TensorInfo& info, double share, uint64_t seed, At&& at) {
  const uint64_t element = dtype_size(info.dtype), elements = info.numel();
  const uint64_t n = BenchModel::changed_elements(elements, share);
  for (uint64_t k = 0; k < n; ++k) {
    const uint64_t r = content_word(seed, k);
    std::byte* e = at(r % elements);
    if (e == nullptr) continue;
    uint64_t v = 0;
    for (uint64_t b = 0; b < element; ++b) v |= static_cast<uint64_t>(e[b]) << (8 * b);
    v += (r >> 62) & 1 ? 1 + ((r >> 61) & 1) : ~uint64_t{0} - ((r >> 61) & 1);  // +1, +2, -1 or -2
    for (uint64_t b = 0; b < element; ++b) e[b] = static_cast<std::byte>(v >> (8 * b));
  }
}

// Steps the elements of `box` of tensor `tensor` of the model (packed at `out`) that refit `refit`
// of the delta workload moves (step_elements); the others are not ours.
void step_box(std::byte* out, const TensorInfo& full, const Box& box, uint64_t refit, uint64_t tensor, double share) {
  const size_t rank = full.shape.size(), element = dtype_size(full.dtype);
  std::vector<Slice> along(rank);
  for (size_t d = 0; d < rank; ++d) along[d] = box.along(static_cast<int32_t>(d), full.shape);
  std::vector<int64_t> coordinate(rank);
  step_elements(full, share, seed_of(refit, tensor), [&](uint64_t flat) -> std::byte* {
    if (box.is_whole()) return out + flat * element;
    for (size_t d = rank; d-- > 0;) {
      coordinate[d] = static_cast<int64_t>(flat % static_cast<uint64_t>(full.shape[d]));
      flat /= static_cast<uint64_t>(full.shape[d]);
    }
    uint64_t packed = 0;
    for (size_t d = 0; d < rank; ++d) {
      if (coordinate[d] < along[d].start || coordinate[d] >= along[d].start + along[d].length) return nullptr;
      packed = packed * static_cast<uint64_t>(along[d].length) + static_cast<uint64_t>(coordinate[d] - along[d].start);
    }
    return out + packed * element;
  });
}

// Writes `box` of tensor `tensor` of the model as refit `refit` holds it: its own content, or,
// with the delta workload (`share` > 0), refit 0's content stepped by every refit since (any
// process computes any box of it; a source steps what it holds in place, one refit at a time).
void fill_box_of_refit(std::byte* out, const TensorInfo& full, const Box& box, uint64_t refit, uint64_t tensor,
                       double share) {
  if (share <= 0 || refit == 0) return fill_box(out, full, box, seed_of(refit, tensor));
  fill_box(out, full, box, seed_of(0, tensor));
  for (uint64_t r = 1; r <= refit; ++r) step_box(out, full, box, r, tensor, share);
}

// GPU copies and hashes of one refit finish well within this.
constexpr auto kGpuWait = std::chrono::seconds(300);
constexpr uint64_t kTensorAlignment = 256;

uint64_t aligned(uint64_t n) { return (n + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment; }

[[noreturn]] void die_on_purpose() {
  std::fflush(nullptr);
  raise(SIGKILL);
  _exit(137);
}

// The source's views (ViewSource); kills the process at the kill point, if one is set for it.
class KillingViewSource final : public WeightSource {
 public:
  KillingViewSource(std::span<const TensorView> views, std::optional<uint64_t> kill_at)
      : views_(views), kill_at_(kill_at) {}
  bool next(TensorView* out) override {
    if (kill_at_ && index_++ == *kill_at_) die_on_purpose();
    return views_.next(out);
  }
  bool views_outlive_send() const override { return views_.views_outlive_send(); }

 private:
  ViewSource views_;
  std::optional<uint64_t> kill_at_;
  size_t index_ = 0;
};

class SourceProgram final : public WorkerProgram {
 public:
  SourceProgram(const BenchModel& model, const std::optional<Layout>* layout, const Layout* holds,
                std::optional<KillPoint> kill)
      : model_(model), layout_(layout), holds_(holds), kill_(kill), kind_(model.tensors) {
    if (holds_ && !synthetic())
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("the resharding bench (--src-*) runs on synthetic content (a config.json)"));
    if (!model.versions.empty() && (holds_ || kind_ == MemoryKind::kCuda))
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("--versions replays files in host memory on the paired topology"));
    if (model.changed_share > 0 && !synthetic())
      throw Error(
          ErrorKind::kInvalidArgument,
          fmt::format("--changed (a delta workload) changes synthetic content: leave out a safetensors --model"));
    if (!model.safetensors_path.empty()) load_files();
    if (synthetic() || kind_ == MemoryKind::kCuda || !model.versions.empty()) {
      // One allocation for the whole model (or this source's shards of it): synthetic content is
      // refilled every refit, file content is copied to the GPU once.
      std::vector<const TensorInfo*> infos;
      if (holds_) {
        for (uint32_t i = 0; i < model.inventory.tensors.size(); ++i) {
          const TensorInfo& t = model.inventory.tensors[i];
          const Request r = holds_->request_for(t.name);
          if (r.take == Take::kDrop) continue;
          shard_infos_.push_back({t.name, t.dtype, Box::of(r).shape_in(t.shape)});
          full_index_.push_back(i);
          boxes_.push_back(Box::of(r));
        }
        for (const auto& t : shard_infos_) infos.push_back(&t);
      } else if (synthetic()) {
        for (const auto& t : model.inventory.tensors) infos.push_back(&t);
      } else
        for (const auto& v : views_) infos.push_back(v.info);
      uint64_t total = 0;
      for (const auto* t : infos) total += aligned(t->nbytes());
      storage_ = TensorMemory(kind_, Device{Device::Kind::kCuda, -1}, std::max<uint64_t>(total, 1));
      std::vector<TensorView> placed;
      uint64_t offset = 0;
      for (size_t i = 0; i < infos.size(); ++i) {
        placed.push_back({infos[i], storage_.data() + offset, kind_});
        if (!synthetic())
          copies_.copy(storage_.data() + offset, views_[i].data, infos[i]->nbytes(), kind_, views_[i].memory);
        offset += aligned(infos[i]->nbytes());
      }
      copies_.synchronize(deadline_after(kGpuWait));
      views_ = std::move(placed);
    }
  }

  // Host weights move into memory from the engine's transport, which destinations on this host
  // map (UCX: shared memory), so that they load every tensor in place: one copy per byte. GPU
  // weights stay: CUDA IPC maps any cudaMalloc memory.
  void place_weights(CheckpointEngine& engine) override {
    if (kind_ != MemoryKind::kHost || views_.empty()) return;
    uint64_t total = 0;
    for (const auto& v : views_) total += aligned(v.info->nbytes());
    std::byte* base = engine.allocate_weight_memory(std::max<uint64_t>(total, 1));
    uint64_t offset = 0;
    for (auto& v : views_) {
      const uint64_t n = v.info->nbytes();
      if (n > 0) std::memcpy(base + offset, v.data, n);
      v.data = base + offset;
      offset += aligned(n);
    }
    storage_ = TensorMemory();  // the engine's memory holds the weights now
  }

  void stage(uint64_t index) override {
    if (!model_.versions.empty()) return stage_version(index);
    if (!synthetic() && !hashes_.empty()) return;  // file content does not change
    hashes_.clear();
    if (kind_ == MemoryKind::kCuda) return holds_ ? stage_shards_on_gpu(index) : stage_on_gpu(index);
    const bool change_in_place = model_.changed_share > 0 && index > 0;
    for (size_t i = 0; i < views_.size(); ++i) {
      const auto& v = views_[i];
      const uint64_t n = v.info->nbytes();
      if (change_in_place)  // the previous refit's content, stepped by this refit's draws
        step_box(const_cast<std::byte*>(v.data), holds_ ? model_.inventory.tensors[full_index_[i]] : *v.info,
                 holds_ ? boxes_[i] : Box::whole(), index, holds_ ? full_index_[i] : i, model_.changed_share);
      else if (synthetic())
        fill_box_of_refit(const_cast<std::byte*>(v.data), holds_ ? model_.inventory.tensors[full_index_[i]] : *v.info,
                          holds_ ? boxes_[i] : Box::whole(), index, holds_ ? full_index_[i] : i,
                          holds_ ? model_.changed_share : 0);
      if (!holds_) hash_expected(v);
      (void)n;
    }
  }

  std::unique_ptr<WeightSource> weights(uint64_t index) override {
    std::optional<uint64_t> kill;
    if (kill_ && kill_->refit == index) kill = kill_->step;
    if (kill) return std::make_unique<KillingViewSource>(views_, kill);
    return std::make_unique<ViewSource>(views_);
  }

  BatchLoader loader(uint64_t) override { throw Error(ErrorKind::kInternal, fmt::format("a source has no loader")); }

  std::string report(uint64_t) override { return json{{"hashes", hashes_}}.dump(); }

 private:
  bool synthetic() const { return model_.safetensors_path.empty(); }

  // Version `index` of the weights, copied over the previous one tensor by tensor.
  void stage_version(uint64_t index) {
    if (index >= model_.versions.size())
      throw Error(ErrorKind::kInvalidArgument, fmt::format("refit {} needs version {}, but --versions has {} files",
                                                           index, index, model_.versions.size()));
    hashes_.clear();
    if (index > 0) {
      SafetensorsFile file(model_.versions[index]);
      std::map<std::string_view, size_t> by_name;
      for (size_t i = 0; i < file.tensors().size(); ++i) by_name[file.tensors()[i].name] = i;
      for (auto& v : views_) {
        auto it = by_name.find(v.info->name);
        if (it == by_name.end() || file.tensors()[it->second] != *v.info)
          throw Error(ErrorKind::kModel,
                      fmt::format("{} has no tensor '{}' of {} {} (as the first version)", model_.versions[index],
                                  v.info->name, dtype_name(v.info->dtype), shape_string(v.info->shape)));
        const auto bytes = file.data(it->second);
        std::memcpy(const_cast<std::byte*>(v.data), bytes.data(), bytes.size());
      }
    }
    for (const auto& v : views_) hash_expected(v);
  }

  // What the paired destination holds of `info`: all of it without a layout.
  Selection expected(const TensorInfo& info) const {
    if (layout_ == nullptr || !*layout_) return {Take::kWhole, {}, info};
    return select(**layout_, info);
  }

  // GPU tensors: filled by a kernel; what the destination should hold is hashed on the GPU
  // (slices are gathered first, one at a time).
  void stage_on_gpu(uint64_t index) {
    std::vector<DeviceRange> whole;
    std::vector<std::string> names;
    std::vector<std::pair<const TensorView*, Selection>> slices;
    for (size_t i = 0; i < views_.size(); ++i) {
      const auto& v = views_[i];
      if (model_.changed_share > 0 && index > 0)
        change_device_elements(
            const_cast<std::byte*>(v.data), v.info->numel(), static_cast<uint32_t>(dtype_size(v.info->dtype)),
            BenchModel::changed_elements(v.info->numel(), model_.changed_share), seed_of(index, i), nullptr);
      else if (synthetic())
        fill_device_pattern(const_cast<std::byte*>(v.data), v.info->nbytes(), index * 1000003 + i, nullptr);
      const Selection s = expected(*v.info);
      if (s.take == Take::kWhole) {
        whole.push_back({v.data, v.info->nbytes()});
        names.push_back(v.info->name);
      } else if (s.take == Take::kSlice) {
        slices.emplace_back(&v, s);
      }
    }
    const auto sums = hash_device_ranges(whole, nullptr);  // on the fills' stream: waits for them
    for (size_t i = 0; i < whole.size(); ++i) hashes_[names[i]] = hex(sums[i]);
    for (const auto& [v, s] : slices) {
      if (gpu_scratch_.size() < s.info.nbytes())
        gpu_scratch_ = DeviceBuffer(Device{Device::Kind::kCuda, -1}, s.info.nbytes());
      const Box box = Box::of(Request::narrow(s.slice.dim, s.slice.start, s.slice.length));
      for_each_box_block(v->info->shape, dtype_size(v->info->dtype), box, 0, s.info.nbytes(), [&](const BoxBlock& b) {
        copies_.copy_2d(gpu_scratch_.data() + b.packed_offset, b.row_bytes, v->data + b.tensor_offset, b.pitch,
                        b.row_bytes, b.rows, MemoryKind::kCuda, MemoryKind::kCuda);
      });
      copies_.synchronize(deadline_after(kGpuWait));
      hashes_[v->info->name] = hex(hash_device_ranges({{gpu_scratch_.data(), s.info.nbytes()}}, nullptr).at(0));
    }
  }

  // Resharding with GPU tensors: each shard is the box of the model's content that this source
  // holds, made on the host (any process computes any box) and uploaded; destinations check
  // themselves against the same content.
  void stage_shards_on_gpu(uint64_t index) {
    for (size_t i = 0; i < views_.size(); ++i) {
      const auto& v = views_[i];
      scratch_.resize(v.info->nbytes());
      fill_box_of_refit(scratch_.data(), model_.inventory.tensors[full_index_[i]], boxes_[i], index, full_index_[i],
                        model_.changed_share);
      copies_.copy(const_cast<std::byte*>(v.data), scratch_.data(), scratch_.size(), MemoryKind::kCuda,
                   MemoryKind::kHost);
      copies_.synchronize(deadline_after(kGpuWait));  // scratch_ is refilled next
    }
  }

  // The hash of what the paired destination should receive of this tensor.
  void hash_expected(const TensorView& v) {
    const Selection s = expected(*v.info);
    if (s.take == Take::kDrop) return;
    if (s.take == Take::kWhole) {
      hashes_[v.info->name] = hex(XXH3_64bits(v.data, v.info->nbytes()));
      return;
    }
    scratch_.resize(s.info.nbytes());
    copy_slice(v.data, *v.info, s.slice, scratch_.data());
    hashes_[v.info->name] = hex(XXH3_64bits(scratch_.data(), scratch_.size()));
  }

  void load_files() {
    auto add = [&](const std::string& path) {
      files_.push_back(std::make_unique<SafetensorsFile>(path));
      const auto& f = *files_.back();
      for (size_t i = 0; i < f.tensors().size(); ++i)
        views_.push_back({&f.tensors()[i], f.data(i).data(), MemoryKind::kHost});
    };
    namespace fs = std::filesystem;
    if (fs::is_directory(model_.safetensors_path)) {
      std::vector<std::string> paths;
      for (const auto& e : fs::directory_iterator(model_.safetensors_path))
        if (e.path().extension() == ".safetensors") paths.push_back(e.path().string());
      std::sort(paths.begin(), paths.end());
      for (const auto& p : paths) add(p);
    } else {
      add(model_.safetensors_path);
    }
  }

  const BenchModel& model_;
  const std::optional<Layout>* layout_;  // null for a source without a destination
  const Layout* holds_;                  // resharding: what this source holds; null: everything
  std::vector<TensorInfo> shard_infos_;  // resharding: the shards, with where they lie in the model
  std::vector<uint32_t> full_index_;
  std::vector<Box> boxes_;
  std::optional<KillPoint> kill_;
  MemoryKind kind_;
  std::vector<std::byte> scratch_;
  DeviceBuffer gpu_scratch_;
  CopyStream copies_;
  TensorMemory storage_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<TensorView> views_;
  std::map<std::string, std::string> hashes_;
};

class DestinationProgram final : public WorkerProgram {
 public:
  // `tensors`: what this destination holds (its layout's selection of the model), allocated here
  // once as an inference engine's parameters are. `checks` (resharding): the model and this
  // destination's layout, against which it checks itself.
  // `changed_share`: the delta workload's (--changed).
  DestinationProgram(std::optional<KillPoint> kill, MemoryKind kind, std::vector<TensorInfo> tensors,
                     const ModelInventory* checks_model, const std::optional<Layout>* checks, double changed_share)
      : kill_(kill),
        kind_(kind),
        tensors_(std::move(tensors)),
        model_(checks_model),
        checks_(checks),
        changed_share_(changed_share) {
    uint64_t total = 0;
    for (const auto& t : tensors_) total += aligned(t.nbytes());
    storage_ = TensorMemory(kind_, Device{Device::Kind::kCuda, -1}, std::max<uint64_t>(total, 1));
    uint64_t offset = 0;
    for (const auto& t : tensors_) {
      parameters_.push_back(storage_.data() + offset);
      loads_.add(t, storage_.data() + offset, kind_);
      offset += aligned(t.nbytes());
    }
  }

  std::unique_ptr<WeightSource> weights(uint64_t) override {
    throw Error(ErrorKind::kInternal, fmt::format("a destination has no weights"));
  }

  // Outside the timed refit: the last refit's hashes are many small blocks to free.
  void stage(uint64_t) override {
    hashes_.clear();
    batches_ = 0;
    loaded_before_ = loads_.tensors_loaded();
  }

  // Into this worker's own parameters, kept across refits, by name (ParameterLoader); hashed in
  // report(), outside the timed refit.
  BatchLoader loader(uint64_t index) override {
    return [this, index](LoadBatch batch) {
      const bool kill_here = kill_ && kill_->refit == index && kill_->step == batches_;
      ++batches_;
      if (kill_here && kill_->when == KillPoint::When::kLoad) {
        loads_.load(batch.subspan(0, batch.size() / 2));
        die_on_purpose();
      }
      loads_.load(batch);
      if (kill_here) die_on_purpose();
    };
  }

  std::string report(uint64_t index) override {
    const uint64_t loaded = loads_.tensors_loaded() - loaded_before_;
    if (loaded != tensors_.size())
      throw Error(ErrorKind::kProtocol, fmt::format("the destination loaded {} tensors in refit {}, it holds {}",
                                                    loaded, index, tensors_.size()));
    if (model_) return self_check(index);
    if (kind_ == MemoryKind::kHost) {
      for (size_t i = 0; i < tensors_.size(); ++i)
        hashes_[tensors_[i].name] = hex(XXH3_64bits(parameters_[i], tensors_[i].nbytes()));
    } else {
      std::vector<DeviceRange> ranges;
      for (size_t i = 0; i < tensors_.size(); ++i) ranges.push_back({parameters_[i], tensors_[i].nbytes()});
      const auto sums = hash_device_ranges(ranges, nullptr);
      for (size_t i = 0; i < ranges.size(); ++i) hashes_[tensors_[i].name] = hex(sums[i]);
    }
    return json{{"hashes", hashes_}}.dump();
  }

 private:
  // The hashes of what this destination holds and of what it should hold (its slices of the
  // synthetic content of refit `index`); verify() compares the two.
  // GPU parameters are hashed on the GPU, beside the expected content uploaded there.
  std::string self_check(uint64_t index) {
    json held = json::object(), expected = json::object();
    if (kind_ == MemoryKind::kHost)
      for (size_t i = 0; i < tensors_.size(); ++i)
        held[tensors_[i].name] = hex(XXH3_64bits(parameters_[i], tensors_[i].nbytes()));
    std::map<std::string_view, size_t> parameter_of;
    for (size_t i = 0; i < tensors_.size(); ++i) parameter_of[tensors_[i].name] = i;
    std::vector<std::byte> want;
    for (uint32_t i = 0; i < model_->tensors.size(); ++i) {
      const TensorInfo& t = model_->tensors[i];
      const Request r = *checks_ ? (*checks_)->request_for(t.name) : Request::whole();
      if (r.take == Take::kDrop) continue;
      const Box box = Box::of(r);
      const uint64_t n = box.nbytes_in(t);
      want.resize(n);
      fill_box_of_refit(want.data(), t, box, index, i, changed_share_);
      if (kind_ == MemoryKind::kHost) {
        expected[t.name] = hex(XXH3_64bits(want.data(), n));
        continue;
      }
      const auto p = parameter_of.find(t.name);
      if (p == parameter_of.end()) continue;  // verify() reports it missing
      if (gpu_scratch_.size() < n) gpu_scratch_ = DeviceBuffer(Device{Device::Kind::kCuda, -1}, n);
      copies_.copy(gpu_scratch_.data(), want.data(), n, MemoryKind::kCuda, MemoryKind::kHost);
      copies_.synchronize(deadline_after(kGpuWait));
      const auto sums = hash_device_ranges(
          {{parameters_[p->second], tensors_[p->second].nbytes()}, {gpu_scratch_.data(), n}}, nullptr);
      held[t.name] = hex(sums[0]);
      expected[t.name] = hex(sums[1]);
    }
    return json{{"hashes", held}, {"expected", expected}}.dump();
  }

  std::optional<KillPoint> kill_;
  MemoryKind kind_;
  std::vector<TensorInfo> tensors_;  // the parameters, in storage_ (GPU, or host memory in huge pages)
  const ModelInventory* model_;      // resharding: the model, to check against
  const std::optional<Layout>* checks_;
  const double changed_share_;
  TensorMemory storage_;
  std::vector<std::byte*> parameters_;  // parallel to tensors_
  ParameterLoader loads_;
  uint64_t loaded_before_ = 0;  // tensors loaded before this refit
  uint64_t batches_ = 0;
  std::map<std::string, std::string> hashes_;
  DeviceBuffer gpu_scratch_;  // GPU parameters: the expected content, to hash beside them
  CopyStream copies_;
};

}  // namespace

KillPoint parse_kill_point(const std::string& text) {
  KillPoint k;
  char role[16] = {}, when[16] = {};
  unsigned long long refit = 0, step = 0;
  int rank = 0;
  const int fields = std::sscanf(text.c_str(), "%15[a-z]:%d:%llu:%llu:%15[a-z]", role, &rank, &refit, &step, when);
  const std::string r = role, w = when;
  const bool ok = (fields == 4 || fields == 5) && rank >= 0 &&
                  ((r == "source" && (w.empty() || w == "pack")) ||
                   (r == "destination" && (w.empty() || w == "load" || w == "after")));
  if (!ok)
    throw Error(
        ErrorKind::kInvalidArgument,
        fmt::format("--kill '{}': expected ROLE:RANK:REFIT:STEP[:WHEN], e.g. source:0:1:25 or destination:0:1:2:after "
                    "(WHEN: pack for a source; load or after for a destination)",
                    text));
  k.source = r == "source";
  k.rank = rank;
  k.refit = refit;
  k.step = step;
  k.when = k.source ? KillPoint::When::kPack : (w == "after" ? KillPoint::When::kAfterLoad : KillPoint::When::kLoad);
  return k;
}

WorkerProgramFactory bench_programs(const BenchModel& model, const std::vector<std::optional<Layout>>& layouts,
                                    const std::vector<Layout>& holds, std::optional<KillPoint> kill) {
  return [&model, &layouts, &holds, kill](bool is_source, int rank) -> std::unique_ptr<WorkerProgram> {
    std::optional<KillPoint> mine;
    if (kill && kill->source == is_source && kill->rank == rank) mine = kill;
    const std::optional<Layout>* layout = rank < static_cast<int>(layouts.size()) ? &layouts[rank] : nullptr;
    if (model.tensors == MemoryKind::kCuda) {
      try {
        check_device(Device{Device::Kind::kCuda, -1});
      } catch (const Error& e) {
        throw Error(e.kind(), fmt::format("GPU-resident bench tensors (--tensors cuda): {}", e.what()));
      }
    }
    const bool resharding = !holds.empty();
    if (is_source) return std::make_unique<SourceProgram>(model, layout, resharding ? &holds.at(rank) : nullptr, mine);
    static const std::optional<Layout> whole;
    const std::optional<Layout>& held = layout ? *layout : whole;
    return std::make_unique<DestinationProgram>(mine, model.tensors, selected_tensors(model.inventory, held),
                                                resharding ? &model.inventory : nullptr, &held, model.changed_share);
  };
}

}  // namespace refit::tools
