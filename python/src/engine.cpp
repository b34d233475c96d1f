// The checkpoint engine for Python.
//
// Sending: send(iterable) runs the C++ send() with the GIL released; its WeightSource pulls the
// next (name, tensor) pair from the Python iterator on demand, holding the GIL only for that
// call and the DLPack import, and keeps the tensor alive until the following pull.
//
// Receiving: the engine's pull-style receive (begin_receive / next_batch / release_batch /
// finish_receive) drives both forms: a BatchIterator takes one batch per __next__ (waiting with
// the GIL released, in slices that let Ctrl-C through) and releases it at the following one;
// receive_into() runs the same loop with a callback. A batch's views into transfer buffers keep
// the engine object alive and are valid until the next batch; tensors merged from chunks keep
// their own memory, which the engine gives up to them. A consumer that stops iterating (close(),
// garbage collection, finalize()) or holds a batch longer than timeout_s fails the refit, never
// hangs, and the destination stays stale.

#include <fmt/ranges.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
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
#include "refit/parameter_loader.h"

namespace refit::py {
namespace {

using namespace std::chrono_literals;

// ---- stats --------------------------------------------------------------------------------------

nb::dict send_stats(const SendStats& s) {
  nb::dict d;
  d["tensors"] = s.tensors;
  d["dropped"] = s.dropped;
  d["buckets"] = s.buckets;
  d["replayed_buckets"] = s.replayed_buckets;
  d["payload_bytes"] = s.payload_bytes;
  d["in_place_bytes"] = s.in_place_bytes;
  d["seconds"] = s.seconds;
  d["had_peer"] = s.had_peer;
  d["delta_tensors"] = s.delta_tensors;
  d["delta_bytes"] = s.delta_bytes;
  d["delta_seconds"] = s.delta_seconds;
  return d;
}

nb::dict receive_stats(const ReceiveStats& s) {
  nb::dict d;
  d["tensors"] = s.tensors;
  d["batches"] = s.batches;
  d["buckets"] = s.buckets;
  d["replayed_buckets"] = s.replayed_buckets;
  d["payload_bytes"] = s.payload_bytes;
  d["wire_bytes"] = s.wire_bytes;
  d["in_place_bytes"] = s.in_place_bytes;
  d["mapped"] = s.mapped;
  d["buffer_bytes"] = s.buffer_bytes;
  d["route"] = s.route;
  d["delta_tensors"] = s.delta_tensors;
  d["delta_bytes"] = s.delta_bytes;
  d["delta_seconds"] = s.delta_seconds;
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
  // `in_place`: every tensor is kept until send() returns (not only until the next pull), so that
  // destinations that map this process's memory may load straight from it (direct_reads).
  PySource(nb::object iterator, bool device_ok, bool in_place)
      : iterator_(std::move(iterator)), device_ok_(device_ok), in_place_(in_place) {}

  bool views_outlive_send() const override { return in_place_; }

  bool next(TensorView* out) override {
    nb::gil_scoped_acquire gil;
    current_ = ImportedTensor{};  // the previous tensor may go now (unless kept)
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
    const ImportedTensor* tensor = &current_;
    if (in_place_) {
      kept_.push_back(std::move(current_));  // a deque: earlier views stay where they are
      current_ = ImportedTensor{};
      tensor = &kept_.back();
    }
    out->info = &tensor->info;
    out->data = tensor->data;
    out->memory = tensor->memory;
    return true;
  }

  // With the GIL: the Python exception the iterator raised, if any; drops every reference.
  nb::object finish() {
    current_ = ImportedTensor{};
    kept_.clear();
    iterator_ = nb::object();
    return std::move(exception_);
  }

 private:
  nb::object iterator_;
  bool device_ok_;
  bool in_place_;
  uint64_t index_ = 0;
  ImportedTensor current_;
  std::deque<ImportedTensor> kept_;  // with in_place_: every tensor of this send
  nb::object exception_;
};

// refit.TensorSet: a source's tensors by name, read from Python once, sent by every
// send_weights(tensor_set) with no Python call per tensor. The caller promises what in_place=True
// promises (the tensors keep their memory and do not change during a send), so destinations that
// map this process's memory load straight from them. Keeps every tensor alive.
class PyTensorSet {
 public:
  PyTensorSet(nb::handle named, bool device_ok) {
    nb::object items = nb::hasattr(named, "items") ? named.attr("items")() : nb::borrow(named);
    for (nb::handle item : items) {
      if (!nb::isinstance<nb::tuple>(item) || nb::len(item) != 2 || !nb::isinstance<nb::str>(item[0]))
        throw Error(ErrorKind::kInvalidArgument,
                    "refit.TensorSet(tensors): expected a mapping or (name, tensor) pairs, such as "
                    "model.named_parameters()");
      tensors_.push_back(import_tensor(item[1], nb::cast<std::string>(item[0]), device_ok, /*copies_ok=*/false));
    }
  }
  size_t size() const { return tensors_.size(); }

  // One pass over the tensors, as a send's stream.
  class Source final : public WeightSource {
   public:
    explicit Source(const std::deque<ImportedTensor>& tensors) : tensors_(tensors) {}
    bool next(TensorView* out) override {
      if (index_ == tensors_.size()) return false;
      const ImportedTensor& t = tensors_[index_++];
      *out = {&t.info, t.data, t.memory};
      return true;
    }
    bool views_outlive_send() const override { return true; }

   private:
    const std::deque<ImportedTensor>& tensors_;
    size_t index_ = 0;
  };
  Source source() const { return Source(tensors_); }

 private:
  std::deque<ImportedTensor> tensors_;
};

// ---- the receive side ---------------------------------------------------------------------------

// Python (name, tensor) pairs for a batch. Views keep `engine_obj` (the engine, and so its
// buffers) alive; a merged tensor keeps its memory. Needs the GIL.
nb::list convert_batch(const ReceivedBatch& batch, Framework framework, int device_id, nb::handle engine_obj) {
  nb::list out;
  for (size_t i = 0; i < batch.tensors.size(); ++i) {
    const TensorView& v = batch.tensors[i];
    nb::object owner = nb::borrow(engine_obj);
    if (batch.owners[i]) {
      auto* memory = new std::shared_ptr<const void>(batch.owners[i]);
      owner = nb::capsule(memory, [](void* p) noexcept { delete static_cast<std::shared_ptr<const void>*>(p); });
    }
    nb::object tensor = export_tensor(*v.info, v.data, v.memory, device_id, owner, framework);
    out.append(nb::make_tuple(nb::str(v.info->name.data(), v.info->name.size()), tensor));
  }
  return out;
}

// One refit pulled batch by batch. One thread at a time takes batches; close() may come from any
// thread (an async consumer's cancellation): while a take is waiting it asks that thread to give
// up and waits for it, since the engine is driven by one thread at a time.
class PullSession {
 public:
  explicit PullSession(CheckpointEngine* engine) : engine_(engine) {}

  // The next batch, or nothing at the end of the refit (then stats() is set). Needs the GIL;
  // releases it while waiting. Raises the refit's error, or KeyboardInterrupt.
  std::optional<ReceivedBatch> take() {
    {
      std::lock_guard lock(mu_);
      // A refit that failed (closed, finalized, cancelled) fails every later take too: a loop that
      // went on would otherwise end as if the refit were complete.
      if (finished_ && error_) throw *error_;
      if (finished_) return std::nullopt;
      if (busy_)
        throw Error(ErrorKind::kInvalidArgument,
                    "receive_weight_batches(): two threads asked for the next batch at once");
      busy_ = true;
    }
    struct NotBusy {
      PullSession& s;
      ~NotBusy() {
        std::lock_guard lock(s.mu_);
        s.busy_ = false;
        s.idle_.notify_all();
      }
    } not_busy{*this};
    try {
      for (;;) {
        ReceivedBatch batch;
        ReceiveProgress progress;
        {
          GilRelease nogil;
          if (!started_) {
            started_ = true;
            engine_->begin_receive();
          }
          if (holding_) {
            holding_ = false;
            engine_->release_batch();
          }
          if (auto reason = cancel_requested()) throw engine_->abort_receive(*reason);
          progress = engine_->next_batch(deadline_after(std::chrono::milliseconds(100)), &batch);
          if (progress == ReceiveProgress::kDone) stats_ = engine_->finish_receive();
        }
        if (progress == ReceiveProgress::kBatch) {
          holding_ = true;
          ++taken_;
          return batch;
        }
        if (progress == ReceiveProgress::kDone) {
          finish(std::nullopt);
          return std::nullopt;
        }
        // Waiting: let Ctrl-C through (main thread only); an interrupt fails the refit.
        if (PyErr_CheckSignals() != 0) {
          nb::python_error interrupt;
          {
            GilRelease nogil;
            engine_->abort_receive("receive_weight_batches() was interrupted by a signal");
          }
          finish(Error(ErrorKind::kInvalidArgument, "receive_weight_batches() was interrupted by a signal"));
          interrupt.restore();
          throw nb::python_error();
        }
      }
    } catch (const Error& e) {
      finish(e);
      throw;
    }
  }

  // Fails the refit with `reason` (of `kind`: the sources fail with it too) unless it ended
  // already; returns the error it made (none when the refit had ended). Needs the GIL; releases it
  // while it waits.
  std::optional<Error> close(const std::string& reason, ErrorKind kind = ErrorKind::kInvalidArgument) {
    // Without the GIL when we have it (a destructor at interpreter exit may not).
    std::optional<GilRelease> nogil;
    if (PyGILState_Check()) nogil.emplace();
    std::unique_lock lock(mu_);
    if (finished_) return std::nullopt;
    if (busy_) {
      cancel_ = reason;
      idle_.wait(lock, [&] { return !busy_; });
      return std::nullopt;
    }
    std::optional<Error> error;
    if (started_) error = engine_->abort_receive(reason, kind);
    finished_ = true;
    error_ = error ? *error : Error(kind, reason);
    return error;
  }

  bool finished() {
    std::lock_guard lock(mu_);
    return finished_;
  }
  bool started() const { return started_; }
  const std::optional<ReceiveStats>& stats() const { return stats_; }
  const std::optional<Error>& error() const { return error_; }
  uint64_t taken() const { return taken_; }

 private:
  std::optional<std::string> cancel_requested() {
    std::lock_guard lock(mu_);
    return cancel_;
  }
  void finish(std::optional<Error> error) {
    std::lock_guard lock(mu_);
    finished_ = true;
    error_ = std::move(error);
  }

  CheckpointEngine* engine_;
  std::mutex mu_;
  std::condition_variable idle_;
  bool busy_ = false;                  // a thread is in take()
  std::optional<std::string> cancel_;  // close() asked the taking thread to give up
  bool finished_ = false;              // ended: done, failed or closed
  std::optional<Error> error_;         // why it failed
  // Touched by the taking thread only.
  bool started_ = false;
  bool holding_ = false;  // the consumer has the latest batch
  uint64_t taken_ = 0;
  std::optional<ReceiveStats> stats_;
};

// refit.ParameterLoader: the destination's parameters by name, loaded by C++ (ParameterLoader)
// with no Python object per tensor. Keeps every parameter tensor alive.
class PyParameterLoader {
 public:
  PyParameterLoader(nb::handle parameters, double timeout_s) {
    nb::object items = nb::hasattr(parameters, "items") ? parameters.attr("items")() : nb::borrow(parameters);
    std::optional<int> gpu;
    std::vector<std::pair<std::string, WritableTensor>> tensors;
    for (nb::handle item : items) {
      if (!nb::isinstance<nb::tuple>(item) || nb::len(item) != 2)
        throw Error(ErrorKind::kInvalidArgument,
                    "refit.ParameterLoader(parameters): expected a mapping or (name, tensor) pairs, such as "
                    "model.named_parameters()");
      const std::string name = nb::cast<std::string>(item[0]);
      WritableTensor t;
      try {
        t = import_writable(item[1], cuda_built());
      } catch (const Error& e) {
        throw Error(e.kind(), fmt::format("refit.ParameterLoader: parameter '{}': {}", name, e.what()));
      }
      if (t.memory == MemoryKind::kCuda) {
        if (gpu && *gpu != t.device_id)
          throw Error(ErrorKind::kInvalidArgument,
                      fmt::format("refit.ParameterLoader: parameter '{}' is on cuda:{}, others on cuda:{}: one loader "
                                  "per GPU",
                                  name, t.device_id, *gpu));
        gpu = t.device_id;
      }
      tensors.emplace_back(name, std::move(t));
    }
    loader_ = std::make_unique<ParameterLoader>(gpu ? Device{Device::Kind::kCuda, *gpu} : Device{}, timeout_s);
    for (auto& [name, t] : tensors) {
      t.info.name = name;
      loader_->add(t.info, t.data, t.memory);
      keep_.push_back(std::move(t));
    }
  }
  ParameterLoader& loader() { return *loader_; }
  size_t size() const { return loader_->size(); }

 private:
  std::unique_ptr<ParameterLoader> loader_;
  std::vector<WritableTensor> keep_;
};

// convert_batch, failing the refit on both sides when it throws (a tensor the framework cannot
// take): the source is told at once instead of waiting out its deadline.
nb::list convert_or_fail(PullSession& session, const ReceivedBatch& batch, Framework framework, int device_id,
                         nb::handle engine_obj) {
  try {
    return convert_batch(batch, framework, device_id, engine_obj);
  } catch (const std::exception& e) {
    session.close(fmt::format("converting batch {} to Python objects failed: {}", batch.index, e.what()));
    throw;
  }
}
class BatchIterator {
 public:
  BatchIterator(nb::object engine_obj, std::shared_ptr<PullSession> session, Framework framework, int device_id)
      : engine_obj_(std::move(engine_obj)),
        session_(std::move(session)),
        framework_(framework),
        device_id_(device_id) {}
  BatchIterator(BatchIterator&&) = default;
  BatchIterator& operator=(BatchIterator&&) = delete;
  ~BatchIterator() {
    if (session_) close();
  }

  nb::object next() {
    std::optional<ReceivedBatch> batch = session_->take();
    if (!batch) throw nb::stop_iteration();
    return convert_or_fail(*session_, *batch, framework_, device_id_, engine_obj_);
  }
  void close() {
    session_->close(fmt::format(
        "receive_weight_batches(): the consumer stopped iterating after {} batch(es), before the refit ended "
        "(the iterator was closed or garbage-collected); the refit is incomplete",
        session_->taken()));
  }

  nb::object stats() const {
    const auto& s = session_->stats();
    return s ? nb::object(receive_stats(*s)) : nb::none();
  }
  nb::object error() const {
    const auto& e = session_->error();
    return e ? nb::object(nb::str(e->what())) : nb::none();
  }
  uint64_t batches() const { return session_->taken(); }
  bool running() const { return session_->started() && !session_->finished(); }

 private:
  nb::object engine_obj_;  // keeps the engine (and its transfer buffers) alive
  std::shared_ptr<PullSession> session_;
  Framework framework_;
  int device_id_;
};
class PyEngine {
 public:
  PyEngine(uint64_t bucket_bytes, const RefitConfig& config, nb::handle session, uint64_t model_fingerprint,
           std::optional<Layout> layout, bool receives_only, std::optional<Layout> holds,
           std::optional<ModelInventory> model, const std::string& kv_cache_dtype, std::optional<int64_t> num_layers,
           nb::handle transport)
      : config_(config), bucket_bytes_(bucket_bytes) {
    EngineOptions options;
    options.config = config;
    options.bucket_bytes = bucket_bytes;
    options.model_fingerprint = model_fingerprint;
    options.layout = std::move(layout);
    options.receives_only = receives_only;
    options.holds = std::move(holds);
    // A backend written in Python (NIXL) instead of one of the C++ library's.
    if (transport.is_valid() && !transport.is_none()) options.transport = python_transport(transport, config.device);
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
    GilRelease nogil;
    engine_ = std::make_unique<CheckpointEngine>(std::move(options));
  }

  ~PyEngine() { close_now(); }

  nb::bytes prepare() {
    CheckpointEngine& e = idle("prepare()");
    Metadata md;
    {
      GilRelease nogil;
      md = e.prepare();
    }
    return nb::bytes(reinterpret_cast<const char*>(md.data()), md.size());
  }

  void init(bool source, int rank, int train, int rollout, nb::handle metadata) {
    CheckpointEngine& e = idle(source ? "init_policy_process_group()" : "init_rollout_process_group()");
    std::vector<Metadata> md;
    for (nb::handle item : metadata) md.push_back(bytes_of(item, "every metadata entry"));
    GilRelease nogil;
    if (source) {
      e.init_source(rank, train, rollout, md);
    } else {
      e.init_destination(rank, train, rollout, md);
    }
  }

  std::optional<int64_t> kv_scale_layers() const { return fp8_kv_cache_ ? kv_layers_ : std::nullopt; }

  nb::dict send(nb::handle iterable, nb::handle kv_scales, bool in_place) {
    CheckpointEngine& e = idle("send_weights()");
    const Sending sending(sending_);
    std::optional<KvScales> scales;
    try {
      scales = kv_scales_for_send(kv_scales);
    } catch (const Error& bad) {
      fail_send(e, bad);
    }
    // Without the GIL: the weights, followed by the KV-cache scales if any.
    auto send_all = [&](WeightSource& weights) {
      GilRelease nogil;
      if (!scales) return e.send(weights);
      WeightSourceWithKvScales with_scales(weights, std::move(*scales));
      return e.send(with_scales);
    };
    if (nb::isinstance<PyTensorSet>(iterable)) {
      PyTensorSet::Source source = nb::cast<PyTensorSet&>(iterable).source();
      return send_stats(send_all(source));
    }
    nb::object iterator = nb::steal(PyObject_GetIter(iterable.ptr()));
    if (!iterator.is_valid()) throw nb::python_error();
    PySource source(std::move(iterator), device_ok_, in_place);
    SendStats stats;
    try {
      stats = send_all(source);
    } catch (const Error& err) {
      nb::object cause = source.finish();
      raise_error(err, cause);
    }
    source.finish();
    return send_stats(stats);
  }

  // A send refused before its first tensor (its arguments are wrong) is still this refit's
  // failure: the engine sends nothing but tells its destinations why, so that they fail now
  // instead of at their deadline; the caller gets `bad` itself.
  [[noreturn]] void fail_send(CheckpointEngine& e, const Error& bad) {
    struct Refused final : WeightSource {
      const Error& why;
      explicit Refused(const Error& e) : why(e) {}
      bool next(TensorView*) override { throw why; }
    } refused(bad);
    try {
      GilRelease nogil;
      e.send(refused);
    } catch (const Error&) {
      // The engine's own words for it (phase, refit): the caller gets the argument error as it was.
    }
    throw bad;
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
        // True is a number to Python (1.0), not a scale anyone meant.
        const bool is_bool = PyBool_Check(value.ptr());
        const double v = is_bool ? 0.0 : PyFloat_AsDouble(value.ptr());
        if (is_bool || (v == -1.0 && PyErr_Occurred())) {
          PyErr_Clear();
          throw Error(ErrorKind::kInvalidArgument,
                      fmt::format("send_weights(): kv_scales['{}'] must be a number, got a {}", name,
                                  Py_TYPE(value.ptr())->tp_name));
        }
        values[std::move(name)] = static_cast<float>(v);
      }
    }
    KvScales scales = kv_scale_tensors(*kv_layers_, values);
    if (!scales.ignored.empty())
      spdlog::warn("send_weights(): kv_scales names no q/k/v scale of the model's {} layers, ignored: '{}'",
                   *kv_layers_, fmt::join(scales.ignored, "', '"));
    return scales;
  }

  BatchIterator receive(nb::handle self, const std::string& framework) {
    CheckpointEngine& e = idle("receive_weight_batches()");
    Framework fw = parse_framework(framework);
    active_ = std::make_shared<PullSession>(&e);
    return BatchIterator(nb::borrow(self), active_, fw, device_id_);
  }

  // One refit with a Python callback: the iterator's loop, each batch going to `load(batch)` on
  // the calling thread. The same lifetime rules: views die when load returns. A
  // refit.ParameterLoader as `load` copies each batch in C++, with the GIL released.
  nb::dict receive_into(nb::handle self, nb::handle load, const std::string& framework) {
    CheckpointEngine& e = idle("receive_weights()");
    const Framework fw = parse_framework(framework);
    struct Busy {
      bool& flag;
      explicit Busy(bool& f) : flag(f) { flag = true; }
      ~Busy() { flag = false; }
    } busy(in_receive_);
    PullSession session(&e);
    if (nb::isinstance<PyParameterLoader>(load)) {
      ParameterLoader& parameters = nb::cast<PyParameterLoader&>(load).loader();
      while (std::optional<ReceivedBatch> batch = session.take()) {
        std::optional<Error> failed;
        {
          GilRelease nogil;
          try {
            parameters.load(batch->tensors);
          } catch (const Error& err) {
            failed = err;
          }
        }
        if (failed) {
          std::optional<Error> error = session.close(failed->what(), failed->kind());
          throw error ? Error(failed->kind(), error->what()) : *failed;
        }
      }
      return receive_stats(*session.stats());
    }
    while (std::optional<ReceivedBatch> batch = session.take()) {
      nb::list out = convert_or_fail(session, *batch, fw, device_id_, self);
      try {
        load(out);
      } catch (nb::python_error& err) {
        nb::object cause = nb::borrow(err.value());
        std::optional<Error> error =
            session.close(fmt::format("the loader raised {}", describe_exception(cause)), error_kind_of(cause));
        raise_error(*error, cause);
      }
    }
    return receive_stats(*session.stats());
  }

  void request_full_refit() { idle("request_full_refit()").request_full_refit(); }

  void finalize() {
    if (in_receive_) throw Error(ErrorKind::kInvalidArgument, "finalize() inside receive_weights()'s load callback");
    refuse_while_sending("finalize()");
    cancel_active("finalize() was called during receive_weight_batches()");
    CheckpointEngine& e = engine();
    {
      GilRelease nogil;
      e.finalize();
    }
  }

  // Destroys the C++ engine now (buffers, transport); later calls raise.
  void close() {
    if (in_receive_) throw Error(ErrorKind::kInvalidArgument, "close() inside receive_weights()'s load callback");
    refuse_while_sending("close()");
    close_now();
  }

 private:
  void close_now() noexcept {
    cancel_active("the checkpoint engine was closed during receive_weight_batches()");
    if (!engine_) return;
    if (PyGILState_Check() && !interpreter_finalizing()) {
      GilRelease nogil;
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
    refuse_while_sending(what);
    if (in_receive_)
      throw Error(
          ErrorKind::kInvalidArgument,
          fmt::format("{}: receive_weights() is running on this engine (called from its load callback?)", what));
    if (active_) {
      // An iterator that never started is superseded; a running one must end first.
      if (active_->started() && !active_->finished())
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("{}: a receive_weight_batches() iteration is still running on this engine; iterate it "
                                "to the end or close() it first",
                                what));
      active_->close(
          "this receive_weight_batches() iterator was superseded (a later call, finalize() or close()) before it "
          "started; call receive_weight_batches() again");
      active_.reset();
    }
    return e;
  }

  void cancel_active(const std::string& reason) {
    if (!active_) return;
    auto session = std::move(active_);
    session->close(reason);
  }

  RefitConfig config_;
  uint64_t bucket_bytes_;
  bool device_ok_ = false;
  std::string kv_cache_dtype_ = "auto";
  bool fp8_kv_cache_ = false;
  std::optional<int64_t> kv_layers_;  // decoder layers whose KV scales a send appends
  int device_id_ = 0;
  std::unique_ptr<CheckpointEngine> engine_;
  std::shared_ptr<PullSession> active_;
  bool in_receive_ = false;  // receive_into() is running (its callback holds the GIL)
  bool sending_ = false;     // send_weights() is running (set and read under the GIL)

  // One send at a time, and nothing that replaces or frees what it works from while it runs.
  void refuse_while_sending(const char* what) const {
    if (sending_)
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("{}: send_weights() is running on this engine in another thread; wait for it (it ends "
                              "by timeout_s)",
                              what));
  }
  struct Sending {
    bool& flag;
    explicit Sending(bool& f) : flag(f) { flag = true; }
    ~Sending() { flag = false; }
  };
};

}  // namespace

void register_engine(nb::module_& m) {
  nb::class_<PyTensorSet>(
      m, "TensorSet",
      "A source's tensors by name, read once, for send_weights(tensor_set): every send streams them from C++ with "
      "no Python call per tensor, and destinations that map this process's memory (CUDA IPC) load straight from "
      "them. `tensors`: a mapping or (name, tensor) pairs such as model.named_parameters(), contiguous, whose memory "
      "stays where it is (in-place updates are seen by the next send) and does not change during a send, as "
      "send_weights(..., in_place=True) promises. Keeps them alive.")
      .def(
          "__init__", [](PyTensorSet* self, nb::handle tensors) { new (self) PyTensorSet(tensors, cuda_built()); },
          nb::arg("tensors"))
      .def("__len__", &PyTensorSet::size);

  nb::class_<PyParameterLoader>(
      m, "ParameterLoader",
      "A destination's parameters by name, for receive_weights(loader): each received tensor is copied into its "
      "parameter in C++ (no Python object per tensor; on a GPU one kernel per ~100 tensors). `parameters`: a mapping "
      "or (name, tensor) pairs such as model.named_parameters(), contiguous, in host memory or on one GPU; the loader "
      "keeps them alive. A received tensor with no parameter, or of another size, fails the refit (LayoutError).")
      .def(nb::init<nb::handle, double>(), nb::arg("parameters"), nb::arg("timeout_s") = 300.0)
      .def("__len__", &PyParameterLoader::size)
      .def_prop_ro("tensors_loaded", [](PyParameterLoader& l) { return l.loader().tensors_loaded(); })
      .def_prop_ro("bytes_loaded", [](PyParameterLoader& l) { return l.loader().bytes_loaded(); })
      .def(
          "take_not_loaded", [](PyParameterLoader& l) { return l.loader().take_not_loaded(); },
          "The names of the parameters that no batch loaded since the loader was made or this was last "
          "called (after a refit: what no source sent; they keep their old values). Starts the count anew.");

  nb::class_<BatchIterator>(m, "BatchIterator",
                            "Iterator over the batches of one refit (lists of (name, tensor)). Each batch's zero-copy "
                            "views are valid until the next batch is requested; merged tensors (split over buckets) "
                            "keep their own memory. Stopping early (close(), garbage collection) fails the refit.")
      // nb::sig: the stub's types for what the bindings return as bare Python objects.
      .def(
          "__iter__", [](nb::handle self) { return self; }, nb::sig("def __iter__(self) -> BatchIterator"))
      .def("__next__", &BatchIterator::next, nb::sig("def __next__(self) -> list[tuple[str, typing.Any]]"))
      .def("close", &BatchIterator::close,
           "Stops the refit if it is still running (it then fails and the destination stays stale).")
      .def(
          "__enter__", [](nb::handle self) { return self; }, nb::sig("def __enter__(self) -> BatchIterator"))
      .def(
          "__exit__", [](BatchIterator& it, nb::handle, nb::handle, nb::handle) { it.close(); }, nb::arg().none(),
          nb::arg().none(), nb::arg().none())
      .def_prop_ro("stats", &BatchIterator::stats, nb::sig("def stats(self) -> dict[str, typing.Any] | None"),
                   "Receive statistics once the refit succeeded, else None.")
      .def_prop_ro("error", &BatchIterator::error, nb::sig("def error(self) -> str | None"),
                   "The refit's error message once it failed, else None.")
      .def_prop_ro("batches", &BatchIterator::batches, "Batches handed out so far.")
      .def_prop_ro("running", &BatchIterator::running, "Whether the refit is in progress.");

  nb::class_<PyEngine>(m, "CheckpointEngine",
                       "The C++ checkpoint engine. Use refit.create_checkpoint_engine(), which wraps it with the "
                       "reference's method names.")
      .def(nb::init<uint64_t, const RefitConfig&, nb::handle, uint64_t, std::optional<Layout>, bool,
                    std::optional<Layout>, std::optional<ModelInventory>, const std::string&, std::optional<int64_t>,
                    nb::handle>(),
           nb::arg("bucket_bytes"), nb::arg("config"), nb::arg("session").none() = nb::none(),
           nb::arg("model_fingerprint") = 0, nb::arg("layout").none() = nb::none(), nb::arg("receives_only") = false,
           nb::arg("holds").none() = nb::none(), nb::arg("model").none() = nb::none(),
           nb::arg("kv_cache_dtype") = "auto", nb::arg("num_layers").none() = nb::none(),
           nb::arg("transport").none() = nb::none())
      .def("prepare", &PyEngine::prepare)
      .def(
          "init_source",
          [](PyEngine& e, int rank, int train, int rollout, nb::handle md) { e.init(true, rank, train, rollout, md); },
          nb::arg("worker_rank"), nb::arg("train_world_size"), nb::arg("rollout_world_size"), nb::arg("metadata"))
      .def(
          "init_destination",
          [](PyEngine& e, int rank, int train, int rollout, nb::handle md) { e.init(false, rank, train, rollout, md); },
          nb::arg("rollout_rank"), nb::arg("train_world_size"), nb::arg("rollout_world_size"), nb::arg("metadata"))
      .def("send", &PyEngine::send, nb::arg("weights"), nb::arg("kv_scales").none() = nb::none(),
           nb::arg("in_place") = false)
      .def_prop_ro("kv_scale_layers", &PyEngine::kv_scale_layers,
                   "Decoder layers whose KV-cache scales every send appends (None: no scales are appended).")
      .def(
          "receive",
          [](nb::handle self, const std::string& framework) {
            return nb::cast<PyEngine&>(self).receive(self, framework);
          },
          nb::arg("framework") = "numpy")
      .def(
          "receive_into",
          [](nb::handle self, nb::handle load, const std::string& framework) {
            return nb::cast<PyEngine&>(self).receive_into(self, load, framework);
          },
          nb::arg("load"), nb::arg("framework") = "numpy")
      .def("request_full_refit", &PyEngine::request_full_refit)
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
