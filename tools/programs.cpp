#include "programs.h"

#include <signal.h>
#include <xxhash.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>

#include "core/fail.h"
#include "refit/memory.h"
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

[[noreturn]] void die_on_purpose() {
  std::fflush(nullptr);
  raise(SIGKILL);
  _exit(137);
}

// Streams a list of views; kills the process at the kill point, if one is set for it.
class ViewSource final : public WeightSource {
 public:
  ViewSource(const std::vector<TensorView>& views, std::optional<uint64_t> kill_at) : views_(views), kill_at_(kill_at) {}
  bool next(TensorView* out) override {
    if (kill_at_ && index_ == *kill_at_) die_on_purpose();
    if (index_ == views_.size()) return false;
    *out = views_[index_++];
    return true;
  }

 private:
  const std::vector<TensorView>& views_;
  std::optional<uint64_t> kill_at_;
  size_t index_ = 0;
};

class SourceProgram final : public WorkerProgram {
 public:
  SourceProgram(const BenchModel& model, const std::optional<Layout>* layout, std::optional<KillPoint> kill)
      : model_(model), layout_(layout), kill_(kill) {
    if (!model.safetensors_path.empty()) {
      load_files();
    } else {
      // One allocation for the whole model, refilled every refit.
      storage_ = HostBuffer(std::max<uint64_t>(model.inventory.total_bytes(), 1));
      uint64_t offset = 0;
      for (const auto& t : model.inventory.tensors) {
        views_.push_back({&t, storage_.data() + offset, MemoryKind::kHost});
        offset += t.nbytes();
      }
    }
  }

  void stage(uint64_t index) override {
    if (!synthetic() && !hashes_.empty()) return;  // file content does not change
    hashes_.clear();
    for (size_t i = 0; i < views_.size(); ++i) {
      const auto& v = views_[i];
      const uint64_t n = v.info->nbytes();
      if (synthetic()) fill(const_cast<std::byte*>(v.data), n, index * 1000003 + i);
      hash_expected(v);
    }
  }

  std::unique_ptr<WeightSource> weights(uint64_t index) override {
    std::optional<uint64_t> kill;
    if (kill_ && kill_->refit == index) kill = kill_->step;
    return std::make_unique<ViewSource>(views_, kill);
  }

  BatchLoader loader(uint64_t) override { fail(ErrorKind::kInternal, "a source has no loader"); }

  std::string report(uint64_t) override { return json{{"hashes", hashes_}}.dump(); }

 private:
  bool synthetic() const { return model_.safetensors_path.empty(); }

  // The hash of what the paired destination should receive of this tensor.
  void hash_expected(const TensorView& v) {
    if (layout_ == nullptr || !*layout_) {
      hashes_[v.info->name] = hex(XXH3_64bits(v.data, v.info->nbytes()));
      return;
    }
    Selection s = select(**layout_, *v.info);
    if (s.take == Take::kDrop) return;
    if (s.take == Take::kWhole) {
      hashes_[v.info->name] = hex(XXH3_64bits(v.data, v.info->nbytes()));
      return;
    }
    scratch_.resize(s.info.nbytes());
    copy_slice(v.data, *v.info, s.slice, scratch_.data());
    hashes_[v.info->name] = hex(XXH3_64bits(scratch_.data(), scratch_.size()));
  }

  static void fill(std::byte* data, uint64_t n, uint64_t seed) {
    uint64_t state = seed;
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t v = splitmix64(state);
      std::memcpy(data + i, &v, 8);
    }
    uint64_t v = splitmix64(state);
    std::memcpy(data + i, &v, n - i);
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
  std::optional<KillPoint> kill_;
  std::vector<std::byte> scratch_;
  HostBuffer storage_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<TensorView> views_;
  std::map<std::string, std::string> hashes_;
};

class DestinationProgram final : public WorkerProgram {
 public:
  explicit DestinationProgram(std::optional<KillPoint> kill) : kill_(kill) {}

  std::unique_ptr<WeightSource> weights(uint64_t) override { fail(ErrorKind::kInternal, "a destination has no weights"); }

  BatchLoader loader(uint64_t index) override {
    hashes_.clear();
    batches_ = 0;
    return [this, index](LoadBatch batch) {
      const bool kill_here = kill_ && kill_->refit == index && kill_->step == batches_;
      ++batches_;
      for (size_t i = 0; i < batch.size(); ++i) {
        if (kill_here && kill_->when == KillPoint::When::kLoad && i == batch.size() / 2) die_on_purpose();
        hashes_[batch[i].info->name] = hex(XXH3_64bits(batch[i].data, batch[i].info->nbytes()));
      }
      if (kill_here) die_on_purpose();
    };
  }

  std::string report(uint64_t) override { return json{{"hashes", hashes_}}.dump(); }

 private:
  std::optional<KillPoint> kill_;
  uint64_t batches_ = 0;
  std::map<std::string, std::string> hashes_;
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
    fail(ErrorKind::kInvalidArgument,
         "--kill '{}': expected ROLE:RANK:REFIT:STEP[:WHEN], e.g. source:0:1:25 or destination:0:1:2:after "
         "(WHEN: pack for a source; load or after for a destination)",
         text);
  k.source = r == "source";
  k.rank = rank;
  k.refit = refit;
  k.step = step;
  k.when = k.source ? KillPoint::When::kPack : (w == "after" ? KillPoint::When::kAfterLoad : KillPoint::When::kLoad);
  return k;
}

WorkerProgramFactory bench_programs(const BenchModel& model, const std::vector<std::optional<Layout>>& layouts,
                                    std::optional<KillPoint> kill) {
  return [&model, &layouts, kill](bool is_source, int rank) -> std::unique_ptr<WorkerProgram> {
    std::optional<KillPoint> mine;
    if (kill && kill->source == is_source && kill->rank == rank) mine = kill;
    const std::optional<Layout>* layout = rank < static_cast<int>(layouts.size()) ? &layouts[rank] : nullptr;
    if (is_source) return std::make_unique<SourceProgram>(model, layout, mine);
    return std::make_unique<DestinationProgram>(mine);
  };
}

}  // namespace refit::tools
