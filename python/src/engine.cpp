// The checkpoint engine for Python.
//
// Sending: send(iterable) runs the C++ send() with the GIL released; its WeightSource pulls the
// next (name, tensor) pair from the Python iterator on demand, holding the GIL only for that
// call and the DLPack import, and keeps the tensor alive until the following pull.
//
// Receiving: the C++ receive() hands batches to a callback; Python wants an iterator. A
// BatchIterator runs receive() on a C++ thread (started at the first __next__). The callback
// publishes each batch and waits until the consumer asks for the next one (then the batch's
// views die) or gives up: a consumer that stops iterating (close(), garbage collection,
// finalize()) or holds a batch longer than timeout_s makes the refit fail, never hang, and the
// destination stays stale. The receive thread never touches Python; the consumer converts the
// batch to Python objects itself, with the GIL, while the callback waits.
//
// Tensors that were split over buckets are merged by the engine into memory it reuses on the
// next refit; by default they are copied into memory the Python object owns (a pool of such
// blocks avoids faulting in fresh pages every refit).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>

#include "common.h"
#include "refit/checkpoint_engine.h"
#include "refit/device.h"
#include "refit/fp8_loading.h"
#include "refit/layout.h"
#include "refit/layout_builders.h"

namespace refit::py {
namespace {

using namespace std::chrono_literals;

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux >= 5.7; older kernels refuse it (EINVAL) and the binding copies
#endif

// ---- owned blocks for merged tensors -----------------------------------------------------------

constexpr size_t kMapThreshold = size_t{1} << 20;

void* allocate_block(size_t bytes) {
  if (bytes >= kMapThreshold) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw Error(ErrorKind::kTransport, fmt::format("cannot allocate {} bytes for a merged tensor", bytes));
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
  }
  void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
  if (!p) throw Error(ErrorKind::kTransport, fmt::format("cannot allocate {} bytes for a merged tensor", bytes));
  return p;
}

void free_block(void* p, size_t bytes) noexcept {
  if (bytes >= kMapThreshold) {
    munmap(p, bytes);
  } else {
    std::free(p);
  }
}

// Keeps freed blocks for reuse, up to the most one refit has needed (merged tensors have the same
// sizes every refit). Thread-safe: blocks are taken on the receive thread and given back
// wherever Python drops the last reference.
class BlockPool : public std::enable_shared_from_this<BlockPool> {
 public:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      taken_this_refit_ += bytes;
      limit_ = std::max(limit_, taken_this_refit_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        pooled_ -= bytes;
        return p;
      }
    }
    return allocate_block(bytes);
  }
  void give(void* p, size_t bytes) noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pooled_ + bytes <= limit_) {
        free_.emplace(bytes, p);
        pooled_ += bytes;
        return;
      }
    }
    free_block(p, bytes);
  }
  void begin_refit() {
    std::lock_guard<std::mutex> lock(mu_);
    taken_this_refit_ = 0;
  }
  void clear() noexcept {
    std::multimap<size_t, void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      pooled_ = 0;
      limit_ = 0;
      taken_this_refit_ = 0;
    }
    for (auto& [bytes, p] : blocks) free_block(p, bytes);
  }
  ~BlockPool() { clear(); }

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  uint64_t pooled_ = 0;
  uint64_t limit_ = 0;
  uint64_t taken_this_refit_ = 0;
};

// Moves the pages of a merged tensor out of the engine's merge buffer instead of copying them.
//
// The engine merges a split tensor into a private anonymous mapping (HostBuffer) that it keeps
// for the same tensor in later refits, does not read once the loader has the tensor, and
// rewrites whole in the next refit. So the binding can give the Python object those pages:
// mremap(MREMAP_DONTUNMAP) moves them to a new mapping the object owns and leaves the engine's
// range mapped but empty. When the object dies before the next refit starts (the usual case: the
// model copied it), its pages go back home at the start of that refit, so the engine neither
// copies nor faults in memory; when the object lives on, the engine's range faults in fresh pages
// and the object keeps its own. Any failure (a kernel without MREMAP_DONTUNMAP, an unaligned
// buffer) falls back to a copy. Not used in builds with the CUDA data path, which may page-lock
// host buffers, nor when REFIT_PY_MOVE_MERGED=0.
class PageMover {
 public:
  PageMover() {
    const char* env = std::getenv("REFIT_PY_MOVE_MERGED");
    enabled_ = !cuda_built() && !(env && std::string_view(env) == "0");
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  }
  ~PageMover() { invalidate(); }

  // On the receive thread: moves the pages of [p, p + n) to a new mapping and returns it (its
  // length in *len, the refit it belongs to in *epoch), or null when that cannot be done.
  void* steal(const std::byte* p, size_t n, size_t* len, uint64_t* epoch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_ || n == 0 || reinterpret_cast<uintptr_t>(p) % page_ != 0) return nullptr;
    const size_t l = (n + page_ - 1) / page_ * page_;
    auto* from = const_cast<std::byte*>(p);
    void* moved = raw_mremap(from, l, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, nullptr);
    if (moved == MAP_FAILED) {
      enabled_ = false;  // this kernel (or mapping) does not allow it: copy from now on
      return nullptr;
    }
    // The engine's range must still be mapped (DONTUNMAP); if an emulated kernel unmapped it,
    // map it again (empty) and stop moving pages.
    if (!mapped(from) || !mapped(from + l - page_)) {
      enabled_ = false;
      void* again = mmap(from, l, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (again == MAP_FAILED) std::abort();  // the engine's buffer is gone and cannot be restored
      std::memcpy(from, moved, n);            // put the tensor back; the caller copies it the usual way
      munmap(moved, l);
      return nullptr;
    }
    *len = l;
    *epoch = epoch_;
    return moved;
  }

  // The Python object died: keep the pages for their home if the next refit has not started yet.
  void release(void* data, size_t len, void* home, uint64_t epoch) noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (epoch == epoch_) {
        returnable_.push_back({data, len, home});
        return;
      }
    }
    munmap(data, len);
  }

  // At the start of a receive, while the engine touches no merge buffer: pages whose objects died
  // go back to the engine's ranges they came from. Then a new refit (epoch) begins.
  void begin_refit() noexcept {
    std::vector<Block> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(returnable_);
      ++epoch_;
    }
    for (const Block& b : blocks) {
      void* r = raw_mremap(b.data, b.len, MREMAP_MAYMOVE | MREMAP_FIXED, b.home);
      if (r == MAP_FAILED) {
        munmap(b.data, b.len);  // the home range stays mapped (empty): the engine faults pages in
      } else if (r != b.home) {
        munmap(r, b.len);
      }
    }
  }

  // The engine's merge buffers may be gone (finalize with release_after_refit, close): nothing
  // may go back to them any more.
  void invalidate() noexcept {
    std::vector<Block> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(returnable_);
      ++epoch_;
    }
    for (const Block& b : blocks) munmap(b.data, b.len);
  }

 private:
  struct Block {
    void* data;
    size_t len;
    void* home;
  };
  // mremap(2) itself, not the libc symbol: UCX's memory hooks (ucm) interpose on mremap and drop
  // MREMAP_FIXED's fifth argument, which moved pages to a wrong address. These ranges are never
  // registered with UCX, so its registration cache needs no word of them.
  static void* raw_mremap(void* old_address, size_t len, int flags, void* new_address) {
    long r = syscall(SYS_mremap, old_address, len, len, flags, new_address);
    return r == -1 ? MAP_FAILED : reinterpret_cast<void*>(r);
  }
  bool mapped(void* page) const {
    unsigned char v = 0;
    return mincore(page, page_, &v) == 0 || errno != ENOMEM;
  }
  std::mutex mu_;
  bool enabled_ = false;
  size_t page_ = 4096;
  uint64_t epoch_ = 1;
  std::vector<Block> returnable_;
};

// Memory a Python object owns: a pooled copy, or pages moved out of the engine's merge buffer.
struct OwnedBlock {
  OwnedBlock(std::shared_ptr<BlockPool> p, size_t n) : pool(std::move(p)), size(n), data(pool->take(n)) {}
  OwnedBlock(std::shared_ptr<PageMover> m, void* moved, size_t len, void* from, uint64_t e)
      : mover(std::move(m)), size(len), data(moved), home(from), epoch(e) {}
  ~OwnedBlock() {
    if (mover) {
      mover->release(data, size, home, epoch);
    } else {
      pool->give(data, size);
    }
  }
  OwnedBlock(const OwnedBlock&) = delete;
  OwnedBlock& operator=(const OwnedBlock&) = delete;
  std::shared_ptr<BlockPool> pool;
  std::shared_ptr<PageMover> mover;
  size_t size;
  void* data;
  void* home = nullptr;
  uint64_t epoch = 0;
};

// ---- stats --------------------------------------------------------------------------------------

nb::dict send_stats(const SendStats& s) {
  nb::dict d;
  d["tensors"] = s.tensors;
  d["dropped"] = s.dropped;
  d["buckets"] = s.buckets;
  d["payload_bytes"] = s.payload_bytes;
  d["seconds"] = s.seconds;
  d["had_peer"] = s.had_peer;
  return d;
}

nb::dict receive_stats(const ReceiveStats& s) {
  nb::dict d;
  d["tensors"] = s.tensors;
  d["batches"] = s.batches;
  d["buckets"] = s.buckets;
  d["payload_bytes"] = s.payload_bytes;
  d["wire_bytes"] = s.wire_bytes;
  d["mapped"] = s.mapped;
  d["buffer_bytes"] = s.buffer_bytes;
  d["route"] = s.route;
  d["total_seconds"] = s.total_seconds;
  d["load_seconds"] = s.load_seconds;
  d["receive_seconds"] = s.receive_seconds();
  return d;
}

std::string describe_exception(nb::handle value) {
  std::string type = Py_TYPE(value.ptr())->tp_name;
  std::string text;
  try {
    text = nb::cast<std::string>(nb::str(value));
  } catch (...) {
    PyErr_Clear();
  }
  return text.empty() ? type : type + ": " + text;
}

// ---- the weight stream --------------------------------------------------------------------------

class PySource final : public WeightSource {
 public:
  PySource(nb::object iterator, bool device_ok) : iterator_(std::move(iterator)), device_ok_(device_ok) {}

  bool next(TensorView* out) override {
    nb::gil_scoped_acquire gil;
    current_ = ImportedTensor{};  // the previous tensor may go now
    PyObject* raw = PyIter_Next(iterator_.ptr());
    if (raw == nullptr) {
      if (PyErr_Occurred()) {
        nb::python_error e;
        exception_ = nb::borrow(e.value());
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("the weight iterator raised {}", describe_exception(exception_)));
      }
      return false;
    }
    nb::object item = nb::steal(raw);
    const uint64_t index = index_++;
    nb::object name_obj, tensor_obj;
    if (PyTuple_Check(raw) && PyTuple_GET_SIZE(raw) == 2) {
      name_obj = nb::borrow(PyTuple_GET_ITEM(raw, 0));
      tensor_obj = nb::borrow(PyTuple_GET_ITEM(raw, 1));
    } else if (PySequence_Check(raw) && !PyUnicode_Check(raw) && PySequence_Size(raw) == 2) {
      name_obj = nb::steal(PySequence_GetItem(raw, 0));
      tensor_obj = nb::steal(PySequence_GetItem(raw, 1));
    } else {
      PyErr_Clear();
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("item {} of the weight iterator is a {}, expected a (name, tensor) pair", index,
                              Py_TYPE(raw)->tp_name));
    }
    if (!name_obj.is_valid() || !tensor_obj.is_valid() || !PyUnicode_Check(name_obj.ptr())) {
      PyErr_Clear();
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("item {} of the weight iterator: the name must be a str, got {}", index,
                              name_obj.is_valid() ? Py_TYPE(name_obj.ptr())->tp_name : "nothing"));
    }
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(name_obj.ptr(), &size);
    if (utf8 == nullptr) {
      nb::python_error e;
      exception_ = nb::borrow(e.value());
      throw Error(ErrorKind::kInvalidArgument, fmt::format("item {} of the weight iterator: bad name", index));
    }
    std::string name(utf8, static_cast<size_t>(size));
    try {
      current_ = import_tensor(tensor_obj, name, device_ok_);
    } catch (nb::python_error& e) {
      exception_ = nb::borrow(e.value());
      throw Error(ErrorKind::kInvalidArgument, fmt::format("tensor '{}': {}", name, describe_exception(exception_)));
    }
    out->info = &current_.info;
    out->data = current_.data;
    out->memory = current_.memory;
    return true;
  }

  // With the GIL: the Python exception the iterator raised, if any; drops every reference.
  nb::object finish() {
    current_ = ImportedTensor{};
    iterator_ = nb::object();
    return std::move(exception_);
  }

 private:
  nb::object iterator_;
  bool device_ok_;
  uint64_t index_ = 0;
  ImportedTensor current_;
  nb::object exception_;
};

// ---- the receive side ---------------------------------------------------------------------------

struct Pending {
  const TensorInfo* info = nullptr;
  const std::byte* data = nullptr;
  MemoryKind memory = MemoryKind::kHost;
  OwnedBlock* owned = nullptr;  // owned copy of a merged tensor, until a capsule takes it
};

void free_pending(std::vector<Pending>& batch) {
  for (auto& p : batch) {
    delete p.owned;
    p.owned = nullptr;
  }
  batch.clear();
}

// The tensors of one batch, with merged tensors (split over buckets) made owned when asked:
// their pages moved out of the engine's merge buffer, or copied. No GIL needed.
std::vector<Pending> collect_batch(LoadBatch batch, BlockPool& pool, const std::shared_ptr<PageMover>& mover,
                                   uint64_t bucket_bytes, bool copy_merged) {
  std::vector<Pending> items;
  items.reserve(batch.size());
  try {
    for (const TensorView& v : batch) {
      Pending p{v.info, v.data, v.memory, nullptr};
      const uint64_t n = v.info->nbytes();
      if (copy_merged && v.memory == MemoryKind::kHost && n > bucket_bytes) {
        size_t len = 0;
        uint64_t epoch = 0;
        if (void* moved = mover->steal(v.data, n, &len, &epoch)) {
          p.owned = new OwnedBlock(mover, moved, len, const_cast<std::byte*>(v.data), epoch);
        } else {
          p.owned = new OwnedBlock(pool.shared_from_this(), n);
          std::memcpy(p.owned->data, v.data, n);
        }
        p.data = static_cast<const std::byte*>(p.owned->data);
      }
      items.push_back(p);
    }
  } catch (...) {
    free_pending(items);
    throw;
  }
  return items;
}

// Python (name, tensor) pairs for a batch; owned blocks go to capsules, views keep `engine_obj`
// (the engine, and so its buffers) alive. Needs the GIL.
nb::list convert_batch(std::vector<Pending>& batch, Framework framework, int device_id, nb::handle engine_obj) {
  nb::list out;
  for (auto& p : batch) {
    nb::object owner;
    if (p.owned) {
      OwnedBlock* block = p.owned;
      p.owned = nullptr;
      owner = nb::capsule(block, [](void* b) noexcept { delete static_cast<OwnedBlock*>(b); });
    } else {
      owner = nb::borrow(engine_obj);
    }
    nb::object tensor = export_tensor(*p.info, p.data, p.memory, device_id, owner, framework);
    out.append(nb::make_tuple(nb::str(p.info->name.data(), p.info->name.size()), tensor));
  }
  return out;
}

struct ReceiveSession {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Pending> batch;  // the published batch
  bool batch_ready = false;    // published and not yet taken by the consumer
  uint64_t published = 0;      // batches published so far
  uint64_t released = 0;       // batches the consumer is done with
  bool cancelled = false;
  std::string cancel_reason;
  bool finished = false;  // receive() returned or threw
  std::optional<Error> error;
  ReceiveStats stats;

  std::mutex join_mu;
  std::thread thread;

  ~ReceiveSession() {
    free_pending(batch);
    // Every owner joins before letting go; never std::terminate if one did not.
    if (thread.joinable()) thread.detach();
  }

  bool is_finished() {
    std::lock_guard<std::mutex> lock(mu);
    return finished;
  }

  // Joins the receive thread (if any). Releases the GIL while waiting unless the interpreter is
  // shutting down (the thread never needs the GIL, so holding it cannot deadlock).
  void join() {
    auto do_join = [this] {
      std::lock_guard<std::mutex> lock(join_mu);
      if (thread.joinable()) thread.join();
    };
    if (PyGILState_Check() && !interpreter_finalizing()) {
      nb::gil_scoped_release nogil;
      do_join();
    } else {
      do_join();
    }
  }

  void cancel(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    if (finished || cancelled) return;
    cancelled = true;
    cancel_reason = reason;
    cv.notify_all();
  }
};

class PyEngine;

class BatchIterator {
 public:
  BatchIterator(nb::object engine_obj, PyEngine* engine, std::shared_ptr<ReceiveSession> session, Framework framework,
                bool copy_merged)
      : engine_obj_(std::move(engine_obj)),
        engine_(engine),
        session_(std::move(session)),
        framework_(framework),
        copy_merged_(copy_merged) {}
  BatchIterator(BatchIterator&&) = default;
  BatchIterator& operator=(BatchIterator&&) = delete;
  ~BatchIterator() {
    if (session_) close_impl(closed_reason());
  }

  nb::object next();
  void close() { close_impl(closed_reason()); }

  nb::object stats() const {
    if (!session_ || !session_->is_finished() || session_->error) return nb::none();
    return receive_stats(session_->stats);
  }
  nb::object error() const {
    if (!session_ || !session_->is_finished() || !session_->error) return nb::none();
    return nb::str(session_->error->what());
  }
  uint64_t batches() const { return taken_; }
  bool running() const { return started_ && session_ && !session_->is_finished(); }

 private:
  void start();
  nb::list convert(std::vector<Pending>& batch);
  std::string closed_reason() const {
    return fmt::format(
        "receive_weight_batches(): the consumer stopped iterating after {} batch(es), before the refit ended "
        "(the iterator was closed or garbage-collected); the refit is incomplete",
        taken_);
  }
  void close_impl(const std::string& reason) {
    if (!session_) return;
    if (started_) {
      session_->cancel(reason);
      session_->join();
    }
    done_ = true;
  }

  nb::object engine_obj_;  // keeps the engine (and its transfer buffers) alive
  PyEngine* engine_;
  std::shared_ptr<ReceiveSession> session_;
  Framework framework_;
  bool copy_merged_;
  bool started_ = false;
  bool holding_ = false;  // the consumer has batch number `taken_`
  bool done_ = false;
  uint64_t taken_ = 0;
};

class PyEngine {
 public:
  PyEngine(uint64_t bucket_bytes, const RefitConfig& config, nb::handle session, uint64_t model_fingerprint,
           std::optional<Layout> layout, bool receives_only, std::optional<Layout> holds,
           std::optional<ModelInventory> model, const std::string& kv_cache_dtype, std::optional<int64_t> num_layers)
      : config_(config),
        bucket_bytes_(bucket_bytes),
        pool_(std::make_shared<BlockPool>()),
        mover_(std::make_shared<PageMover>()) {
    EngineOptions options;
    options.config = config;
    options.bucket_bytes = bucket_bytes;
    options.model_fingerprint = model_fingerprint;
    options.layout = std::move(layout);
    options.receives_only = receives_only;
    options.holds = std::move(holds);
    // KV-cache scales (the reference's kv_cache_dtype.startswith("fp8")): every send appends them
    // for the model's decoder layers, counted from `model` or given as `num_layers`.
    kv_cache_dtype_ = kv_cache_dtype;
    fp8_kv_cache_ = kv_cache_dtype.starts_with("fp8");
    if (num_layers && *num_layers < 0)
      throw Error(ErrorKind::kConfig, fmt::format("num_layers must be >= 0, got {}", *num_layers));
    if (model && num_layers && decoder_layer_count(*model) != *num_layers)
      throw Error(ErrorKind::kConfig,
                  fmt::format("num_layers={} disagrees with the {} decoder layers of model '{}'; give one of them",
                              *num_layers, decoder_layer_count(*model), model->name));
    kv_layers_ = num_layers;
    if (model) kv_layers_ = decoder_layer_count(*model);
    if (model) options.model = std::make_shared<const ModelInventory>(std::move(*model));
    if (session.is_valid() && !session.is_none()) {
      auto bytes = bytes_of(session, "session");
      if (bytes.size() != options.session.size())
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("session must be {} bytes (refit.new_session_id()), got {}", options.session.size(),
                                bytes.size()));
      std::copy(bytes.begin(), bytes.end(), options.session.begin());
    }
    device_ok_ = cuda_built();
    if (config.device.kind == Device::Kind::kCuda) device_id_ = std::max(config.device.index, 0);
    nb::gil_scoped_release nogil;
    engine_ = std::make_unique<CheckpointEngine>(std::move(options));
  }

  ~PyEngine() { close_now(); }

  nb::bytes prepare() {
    CheckpointEngine& e = idle("prepare()");
    Metadata md;
    {
      nb::gil_scoped_release nogil;
      md = e.prepare();
    }
    return nb::bytes(reinterpret_cast<const char*>(md.data()), md.size());
  }

  void init(bool source, int rank, int train, int rollout, nb::handle metadata) {
    CheckpointEngine& e = idle(source ? "init_policy_process_group()" : "init_rollout_process_group()");
    std::vector<Metadata> md;
    for (nb::handle item : metadata) md.push_back(bytes_of(item, "every metadata entry"));
    nb::gil_scoped_release nogil;
    if (source) {
      e.init_source(rank, train, rollout, md);
    } else {
      e.init_destination(rank, train, rollout, md);
    }
  }

  std::optional<int64_t> kv_scale_layers() const { return fp8_kv_cache_ ? kv_layers_ : std::nullopt; }

  nb::dict send(nb::handle iterable, nb::handle kv_scales) {
    CheckpointEngine& e = idle("send_weights()");
    std::optional<KvScales> scales = kv_scales_for_send(kv_scales);
    nb::object iterator = nb::steal(PyObject_GetIter(iterable.ptr()));
    if (!iterator.is_valid()) throw nb::python_error();
    PySource source(std::move(iterator), device_ok_);
    SendStats stats;
    try {
      nb::gil_scoped_release nogil;
      if (scales) {
        WeightSourceWithKvScales with_scales(source, std::move(*scales));
        stats = e.send(with_scales);
      } else {
        stats = e.send(source);
      }
    } catch (const Error& err) {
      nb::object cause = source.finish();
      raise_error(err, cause);
    }
    source.finish();
    return send_stats(stats);
  }

  // The KV-cache scales a send appends (None: this engine appends none). As the reference does:
  // with an fp8 kv_cache_dtype every layer's q/k/v scale goes, names missing from `kv_scales`
  // (or kv_scales None) as 1.0, other names ignored; without one, kv_scales must be None.
  std::optional<KvScales> kv_scales_for_send(nb::handle kv_scales) const {
    const bool given = kv_scales.is_valid() && !kv_scales.is_none();
    if (!fp8_kv_cache_) {
      if (given)
        throw Error(
            ErrorKind::kInvalidArgument,
            fmt::format("send_weights(): kv_scales were given but this engine's kv_cache_dtype is '{}'; KV-cache "
                        "scales are sent only with an fp8 kv_cache_dtype (create the engine with "
                        "kv_cache_dtype='fp8'), and the reference passes them only then",
                        kv_cache_dtype_));
      return std::nullopt;
    }
    if (!kv_layers_)
      throw Error(ErrorKind::kConfig,
                  fmt::format("send_weights(): kv_cache_dtype '{}' appends the KV-cache scales of every decoder layer, "
                              "but the engine does not know how many there are: create it with model= (a config.json "
                              "or refit.ModelInventory) or num_layers=",
                              kv_cache_dtype_));
    std::map<std::string, float> values;
    if (given) {
      if (!PyDict_Check(kv_scales.ptr()))
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("send_weights(): kv_scales must be a dict {{name: float}}, got a {}",
                                Py_TYPE(kv_scales.ptr())->tp_name));
      for (auto [key, value] : nb::borrow<nb::dict>(kv_scales)) {
        if (!PyUnicode_Check(key.ptr()))
          throw Error(ErrorKind::kInvalidArgument,
                      fmt::format("send_weights(): kv_scales keys must be str, got a {}", Py_TYPE(key.ptr())->tp_name));
        std::string name = nb::cast<std::string>(key);
        double v = PyFloat_AsDouble(value.ptr());
        if (v == -1.0 && PyErr_Occurred()) {
          PyErr_Clear();
          throw Error(ErrorKind::kInvalidArgument,
                      fmt::format("send_weights(): kv_scales['{}'] must be a number, got a {}", name,
                                  Py_TYPE(value.ptr())->tp_name));
        }
        values[std::move(name)] = static_cast<float>(v);
      }
    }
    return kv_scale_tensors(*kv_layers_, values);
  }

  BatchIterator receive(nb::handle self, const std::string& framework, bool copy_merged) {
    idle("receive_weight_batches()");
    Framework fw = parse_framework(framework);
    active_ = std::make_shared<ReceiveSession>();
    return BatchIterator(nb::borrow(self), this, active_, fw, copy_merged);
  }

  // One refit with a Python callback: engine.receive() runs on the calling thread with the GIL
  // released; each batch takes the GIL, becomes Python objects and goes to `load(batch)`. No
  // thread hand-off (the iterator's), the same lifetime rules: views die when load returns.
  nb::dict receive_into(nb::handle self, nb::handle load, const std::string& framework, bool copy_merged) {
    CheckpointEngine& e = idle("receive_weights()");
    const Framework fw = parse_framework(framework);
    struct Busy {
      bool& flag;
      explicit Busy(bool& f) : flag(f) { flag = true; }
      ~Busy() { flag = false; }
    } busy(in_receive_);
    pool_->begin_refit();
    mover_->begin_refit();
    nb::object cause;
    const int device_id = device_id_;
    BlockPool& pool = *pool_;
    const auto& mover = mover_;
    const uint64_t bucket_bytes = bucket_bytes_;
    BatchLoader loader = [&](LoadBatch batch) {
      std::vector<Pending> items = collect_batch(batch, pool, mover, bucket_bytes, copy_merged);
      nb::gil_scoped_acquire gil;
      try {
        nb::list out = convert_batch(items, fw, device_id, self);
        load(out);
      } catch (nb::python_error& err) {
        free_pending(items);
        cause = nb::borrow(err.value());
        throw Error(ErrorKind::kInvalidArgument, fmt::format("the loader raised {}", describe_exception(cause)));
      } catch (...) {
        free_pending(items);
        throw;
      }
    };
    ReceiveStats stats;
    try {
      nb::gil_scoped_release nogil;
      stats = e.receive(loader);
    } catch (const Error& err) {
      raise_error(err, cause);
    }
    return receive_stats(stats);
  }

  // Runs engine.receive(loader) on the session's thread.
  void start_receive(const std::shared_ptr<ReceiveSession>& session, bool copy_merged) {
    CheckpointEngine* engine = &this->engine();
    if (active_.get() != session.get() || session->cancelled)
      throw Error(
          ErrorKind::kInvalidArgument,
          "this receive_weight_batches() iterator was superseded (a later call, finalize() or close()) before it "
          "started; call receive_weight_batches() again");
    pool_->begin_refit();
    mover_->begin_refit();
    auto pool = pool_;
    auto mover = mover_;
    const uint64_t bucket_bytes = bucket_bytes_;
    const double timeout = config_.timeout_s;
    BatchLoader loader = [session, pool, mover, bucket_bytes, copy_merged, timeout](LoadBatch batch) {
      std::vector<Pending> items = collect_batch(batch, *pool, mover, bucket_bytes, copy_merged);
      std::unique_lock<std::mutex> lock(session->mu);
      if (session->cancelled) {
        free_pending(items);
        throw Error(ErrorKind::kInvalidArgument, session->cancel_reason);
      }
      session->batch = std::move(items);
      session->batch_ready = true;
      const uint64_t mine = ++session->published;
      session->cv.notify_all();
      const Deadline deadline = deadline_after(std::chrono::duration<double>(timeout));
      auto withdraw = [&] {
        if (session->batch_ready) {
          free_pending(session->batch);
          session->batch_ready = false;
        }
      };
      while (session->released < mine && !session->cancelled) {
        if (session->cv.wait_until(lock, deadline) == std::cv_status::timeout && session->released < mine &&
            !session->cancelled) {
          withdraw();
          session->cancelled = true;
          session->cancel_reason = fmt::format(
              "receive_weight_batches(): the consumer held batch {} for more than timeout_s={} s without asking for "
              "the next batch",
              mine - 1, timeout);
          throw Error(ErrorKind::kTimeout, session->cancel_reason);
        }
      }
      if (session->released < mine) {
        withdraw();
        throw Error(ErrorKind::kInvalidArgument, session->cancel_reason);
      }
    };
    session->thread = std::thread([session, engine, loader = std::move(loader)] {
      ReceiveStats stats;
      std::optional<Error> error;
      try {
        stats = engine->receive(loader);
      } catch (const Error& e) {
        error = e;
      } catch (const std::exception& e) {
        error = Error(ErrorKind::kInternal, e.what());
      }
      std::lock_guard<std::mutex> lock(session->mu);
      session->stats = stats;
      session->error = std::move(error);
      session->finished = true;
      free_pending(session->batch);
      session->batch_ready = false;
      session->cv.notify_all();
    });
  }

  void finalize() {
    if (in_receive_) throw Error(ErrorKind::kInvalidArgument, "finalize() inside receive_weights()'s load callback");
    cancel_active("finalize() was called during receive_weight_batches()");
    CheckpointEngine& e = engine();
    {
      nb::gil_scoped_release nogil;
      e.finalize();
    }
    if (config_.release_after_refit) {
      pool_->clear();
      mover_->invalidate();
    }
  }

  // Destroys the C++ engine now (buffers, transport); later calls raise.
  void close() {
    if (in_receive_) throw Error(ErrorKind::kInvalidArgument, "close() inside receive_weights()'s load callback");
    close_now();
  }

 private:
  void close_now() noexcept {
    cancel_active("the checkpoint engine was closed during receive_weight_batches()");
    if (!engine_) return;
    mover_->invalidate();
    if (PyGILState_Check() && !interpreter_finalizing()) {
      nb::gil_scoped_release nogil;
      engine_.reset();
    } else {
      engine_.reset();
    }
  }

 public:
  bool stale() { return engine().stale(); }
  uint64_t bucket_bytes() const { return bucket_bytes_; }
  std::optional<Layout> target_layout() {
    const Layout* l = engine().target_layout();
    return l ? std::optional<Layout>(*l) : std::nullopt;
  }
  std::string transport_name() { return engine().transport().name(); }
  const RefitConfig& config() const { return config_; }
  int device_id() const { return device_id_; }
  bool closed() const { return !engine_; }

 private:
  CheckpointEngine& engine() {
    if (!engine_) throw Error(ErrorKind::kInvalidArgument, "the checkpoint engine is closed");
    return *engine_;
  }

  CheckpointEngine& idle(const char* what) {
    CheckpointEngine& e = engine();
    if (in_receive_)
      throw Error(
          ErrorKind::kInvalidArgument,
          fmt::format("{}: receive_weights() is running on this engine (called from its load callback?)", what));
    if (active_) {
      // An iterator that never started is superseded; a running one must end first.
      if (!active_->is_finished() && active_->thread.joinable())
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("{}: a receive_weight_batches() iteration is still running on this engine; iterate it "
                                "to the end or close() it first",
                                what));
      active_.reset();
    }
    return e;
  }

  void cancel_active(const std::string& reason) {
    if (!active_) return;
    auto session = std::move(active_);
    session->cancel(reason);
    session->join();
  }

  RefitConfig config_;
  uint64_t bucket_bytes_;
  bool device_ok_ = false;
  std::string kv_cache_dtype_ = "auto";
  bool fp8_kv_cache_ = false;
  std::optional<int64_t> kv_layers_;  // decoder layers whose KV scales a send appends
  int device_id_ = 0;
  std::shared_ptr<BlockPool> pool_;
  std::shared_ptr<PageMover> mover_;
  std::unique_ptr<CheckpointEngine> engine_;
  std::shared_ptr<ReceiveSession> active_;
  bool in_receive_ = false;  // receive_into() is running (its callback holds the GIL)
};

void BatchIterator::start() {
  started_ = true;
  engine_->start_receive(session_, copy_merged_);
}

nb::list BatchIterator::convert(std::vector<Pending>& batch) {
  return convert_batch(batch, framework_, engine_->device_id(), engine_obj_);
}

nb::object BatchIterator::next() {
  if (!session_ || done_) throw nb::stop_iteration();
  ReceiveSession& s = *session_;
  if (!started_) start();
  for (bool first = true;; first = false) {
    {
      nb::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(s.mu);
      if (first && holding_) {
        // The consumer is done with the batch it holds: its views die now.
        s.released = taken_;
        holding_ = false;
        s.cv.notify_all();
      }
      s.cv.wait_for(lock, 100ms, [&] { return s.batch_ready || s.finished; });
      if (s.batch_ready || s.finished) break;
    }
    // Waiting: let Ctrl-C through (main thread only); an interrupt cancels the refit.
    if (PyErr_CheckSignals() != 0) {
      nb::python_error interrupt;
      close_impl("receive_weight_batches() was interrupted by a signal");
      interrupt.restore();
      throw nb::python_error();
    }
  }

  std::unique_lock<std::mutex> lock(s.mu);
  if (s.batch_ready) {
    s.batch_ready = false;
    std::vector<Pending> batch = std::move(s.batch);
    s.batch.clear();
    holding_ = true;
    ++taken_;
    try {
      return convert(batch);
    } catch (...) {
      free_pending(batch);
      lock.unlock();
      std::string reason = "receive_weight_batches(): converting a batch to Python objects failed";
      try {
        throw;
      } catch (const Error& e) {
        reason = fmt::format("receive_weight_batches(): {}", e.what());
        close_impl(reason);
        throw;
      } catch (const std::exception& e) {
        close_impl(reason + ": " + e.what());
        throw;
      }
    }
  }
  // Finished: the receive thread has returned or thrown.
  lock.unlock();
  s.join();
  done_ = true;
  if (s.error) throw *s.error;
  throw nb::stop_iteration();
}

}  // namespace

void register_engine(nb::module_& m) {
  nb::class_<BatchIterator>(m, "BatchIterator",
                            "Iterator over the batches of one refit (lists of (name, tensor)). Each batch's zero-copy "
                            "views are valid until the next batch is requested; merged tensors (split over buckets) "
                            "are owned. Stopping early (close(), garbage collection) fails the refit.")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__", &BatchIterator::next)
      .def("close", &BatchIterator::close,
           "Stops the refit if it is still running (it then fails and the destination stays stale).")
      .def("__enter__", [](nb::handle self) { return self; })
      .def(
          "__exit__", [](BatchIterator& it, nb::handle, nb::handle, nb::handle) { it.close(); }, nb::arg().none(),
          nb::arg().none(), nb::arg().none())
      .def_prop_ro("stats", &BatchIterator::stats, "Receive statistics once the refit succeeded, else None.")
      .def_prop_ro("error", &BatchIterator::error, "The refit's error message once it failed, else None.")
      .def_prop_ro("batches", &BatchIterator::batches, "Batches handed out so far.")
      .def_prop_ro("running", &BatchIterator::running, "Whether the refit is in progress.");

  nb::class_<PyEngine>(m, "CheckpointEngine",
                       "The C++ checkpoint engine. Use refit.create_checkpoint_engine(), which wraps it with the "
                       "reference's method names.")
      .def(nb::init<uint64_t, const RefitConfig&, nb::handle, uint64_t, std::optional<Layout>, bool,
                    std::optional<Layout>, std::optional<ModelInventory>, const std::string&, std::optional<int64_t>>(),
           nb::arg("bucket_bytes"), nb::arg("config"), nb::arg("session").none() = nb::none(),
           nb::arg("model_fingerprint") = 0, nb::arg("layout").none() = nb::none(), nb::arg("receives_only") = false,
           nb::arg("holds").none() = nb::none(), nb::arg("model").none() = nb::none(),
           nb::arg("kv_cache_dtype") = "auto", nb::arg("num_layers").none() = nb::none())
      .def("prepare", &PyEngine::prepare)
      .def(
          "init_source",
          [](PyEngine& e, int rank, int train, int rollout, nb::handle md) { e.init(true, rank, train, rollout, md); },
          nb::arg("worker_rank"), nb::arg("train_world_size"), nb::arg("rollout_world_size"), nb::arg("metadata"))
      .def(
          "init_destination",
          [](PyEngine& e, int rank, int train, int rollout, nb::handle md) { e.init(false, rank, train, rollout, md); },
          nb::arg("rollout_rank"), nb::arg("train_world_size"), nb::arg("rollout_world_size"), nb::arg("metadata"))
      .def("send", &PyEngine::send, nb::arg("weights"), nb::arg("kv_scales").none() = nb::none())
      .def_prop_ro("kv_scale_layers", &PyEngine::kv_scale_layers,
                   "Decoder layers whose KV-cache scales every send appends (None: no scales are appended).")
      .def(
          "receive",
          [](nb::handle self, const std::string& framework, bool copy_merged) {
            return nb::cast<PyEngine&>(self).receive(self, framework, copy_merged);
          },
          nb::arg("framework") = "numpy", nb::arg("copy_merged") = true)
      .def(
          "receive_into",
          [](nb::handle self, nb::handle load, const std::string& framework, bool copy_merged) {
            return nb::cast<PyEngine&>(self).receive_into(self, load, framework, copy_merged);
          },
          nb::arg("load"), nb::arg("framework") = "numpy", nb::arg("copy_merged") = true)
      .def("finalize", &PyEngine::finalize)
      .def("close", &PyEngine::close)
      .def_prop_ro("stale", &PyEngine::stale)
      .def_prop_ro("bucket_bytes", &PyEngine::bucket_bytes)
      .def_prop_ro("closed", &PyEngine::closed)
      .def_prop_ro("config", &PyEngine::config)
      .def("target_layout", &PyEngine::target_layout)
      .def("transport_name", &PyEngine::transport_name);
}

}  // namespace refit::py
