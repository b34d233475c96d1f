// refit::WeightSynchronizer for Python: the one driver, over a Python object of the
// refit.WorkerGroup protocol (python/refit/synchronizer.py documents it).
//
// PyWorkerGroup is the C++ WorkerGroup that calls that object, taking the GIL for each call; the
// synchronizer runs with the GIL released. An exception the Python group raises crosses the C++
// driver as a PythonCallError (a refit::Error that holds the exception object) and comes out of
// sync_weights() & co. as itself, traceback and notes included.
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "refit/synchronizer.h"

namespace refit::py {
namespace {

// An exception raised by the Python worker group, held (with a reference that is dropped under
// the GIL, from any thread) until it is raised again in Python.
class PythonCallError : public Error {
 public:
  PythonCallError(ErrorKind kind, std::string message, PyObject* exception)
      : Error(kind, std::move(message)), exception_(exception, [](PyObject* p) {
          if (interpreter_finalizing()) return;  // leaked: nothing may run Python code any more
          PyGILState_STATE state = PyGILState_Ensure();
          Py_DECREF(p);
          PyGILState_Release(state);
        }) {}

  // Sets the Python error indicator to the exception as it was raised. Needs the GIL.
  void restore() const {
    PyObject* value = exception_.get();
    Py_INCREF(value);
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(value));
    Py_INCREF(type);
    PyErr_Restore(type, value, PyException_GetTraceback(value));
  }

 private:
  std::shared_ptr<PyObject> exception_;
};

// The ErrorKind of a Python exception: its refit class's, else internal.
ErrorKind kind_of(nb::handle exception) {
  for (int k = 0; k < static_cast<int>(ErrorKind::kInternal); ++k) {
    nb::handle type = error_type(static_cast<ErrorKind>(k));
    if (type.is_valid() && PyObject_IsInstance(exception.ptr(), type.ptr()) == 1) return static_cast<ErrorKind>(k);
  }
  return ErrorKind::kInternal;
}

// Runs `f` (which calls into Python) with the GIL; a Python exception becomes a PythonCallError.
template <typename F>
auto call_python(const char* what, F&& f) {
  nb::gil_scoped_acquire gil;
  try {
    return f();
  } catch (nb::python_error& e) {
    nb::handle value = e.value();
    std::string message;
    try {
      message = fmt::format("{}: {}", nb::cast<std::string>(nb::str(nb::handle(Py_TYPE(value.ptr())).attr("__name__"))),
                            nb::cast<std::string>(nb::str(value)));
    } catch (...) {
      PyErr_Clear();
      message = fmt::format("the worker group's {} raised an exception", what);
    }
    Py_INCREF(value.ptr());
    throw PythonCallError(kind_of(value), std::move(message), value.ptr());
  } catch (const nb::cast_error&) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("the worker group's {} returned a value of the wrong type", what));
  }
}

class PyWorkerGroup final : public WorkerGroup {
 public:
  // `device`: what total_memory_bytes(device) is asked for; `backend` and `engine_kwargs`
  // (a callable: session bytes -> the engine_kwargs mapping): what create_engines gets.
  PyWorkerGroup(nb::object group, std::string device, std::string backend, nb::object engine_kwargs)
      : group_(std::move(group)),
        device_(std::move(device)),
        backend_(std::move(backend)),
        engine_kwargs_(std::move(engine_kwargs)) {}

  ~PyWorkerGroup() override {
    nb::gil_scoped_acquire gil;
    results_.reset();
    metadata_.reset();
    engine_kwargs_.reset();
    group_.reset();
  }

  int train_world_size() const override {
    return call_python("train_world_size", [&] { return nb::cast<int>(group_.attr("train_world_size")); });
  }
  int rollout_world_size() const override {
    return call_python("rollout_world_size", [&] { return nb::cast<int>(group_.attr("rollout_world_size")); });
  }

  std::vector<uint64_t> total_memory_bytes() override {
    return call_python("total_memory_bytes", [&] {
      std::vector<uint64_t> out;
      for (nb::handle m : group_.attr("total_memory_bytes")(device_)) {
        nb::object n = nb::steal(PyNumber_Index(m.ptr()));
        if (!n.is_valid()) throw nb::python_error();
        out.push_back(nb::cast<uint64_t>(n));
      }
      return out;
    });
  }

  void create_engines(uint64_t bucket_bytes, const SessionId& session) override {
    call_python("create_engines", [&] {
      nb::bytes id(reinterpret_cast<const char*>(session.data()), session.size());
      group_.attr("create_engines")(backend_, bucket_bytes, engine_kwargs_(id));
    });
  }

  // The metadata stay Python objects, handed back as they came: refit's engines give bytes, a
  // module:ClassName plugin whatever it likes (the reference's give dicts). The driver sees only
  // how many there are.
  std::vector<Metadata> prepare() override {
    return call_python("prepare", [&] {
      metadata_ = nb::list(group_.attr("prepare")());
      return std::vector<Metadata>(nb::len(metadata_));
    });
  }

  void init_process_groups(std::span<const Metadata> metadata) override {
    call_python("init_process_groups", [&] {
      if (nb::len(metadata_) != metadata.size())
        throw Error(ErrorKind::kInternal, "init_process_groups() without the metadata of the latest prepare()");
      group_.attr("init_process_groups")(metadata_);
    });
  }

  // One report per result, sources first; a destination whose result is False reports failure
  // (the reference's convention). The results themselves stay here for the Python report.
  RefitReport refit(uint64_t index) override {
    return call_python("refit", [&] {
      nb::object returned = group_.attr("refit")(index);
      nb::list results = nb::steal<nb::list>(PySequence_List(returned.ptr()));
      if (!results.is_valid()) throw nb::python_error();
      const int train = nb::cast<int>(group_.attr("train_world_size"));
      RefitReport report;
      // A group that does untimed work inside refit() (making synthetic weights) says how long
      // the transfer itself took.
      nb::object seconds = nb::getattr(group_, "last_refit_seconds", nb::none());
      if (!seconds.is_none() && PyObject_IsTrue(seconds.ptr()) == 1) report.seconds = nb::cast<double>(seconds);
      int i = 0;
      for (nb::handle result : results) {
        WorkerRefitReport w;
        w.is_source = i < train;
        w.rank = w.is_source ? i : i - train;
        w.failed = !w.is_source && result.ptr() == Py_False;
        report.workers.push_back(std::move(w));
        ++i;
      }
      results_ = std::move(results);
      train_ = train;
      return report;
    });
  }

  void finalize() override {
    call_python("finalize", [&] { group_.attr("finalize")(); });
  }

  // The Python results of the last refit and the sources' count then. Needs the GIL.
  std::pair<nb::object, int> take_results() {
    nb::object r = results_.is_valid() ? std::move(results_) : nb::object(nb::list());
    results_.reset();
    return {std::move(r), train_};
  }
  nb::handle group() const { return group_; }

 private:
  nb::object group_;
  std::string device_;
  std::string backend_;
  nb::object engine_kwargs_;
  nb::object results_;
  nb::list metadata_;  // of the latest prepare()
  int train_ = 0;
};

// Runs `f` (a driver call) without the GIL; an exception of the Python group is raised as itself.
template <typename F>
auto drive(F&& f) {
  try {
    GilRelease nogil;
    return f();
  } catch (const PythonCallError& e) {
    e.restore();
    throw nb::python_error();
  }
}

class PySynchronizer {
 public:
  PySynchronizer(const RefitConfig& config, nb::object group, const std::string& backend, nb::object engine_kwargs,
                 uint64_t model_bytes)
      : group_(std::move(group), to_string(config.device), backend, std::move(engine_kwargs)),
        sync_(config, group_, backend) {
    sync_.set_model_bytes(model_bytes);
  }

  nb::tuple sync_weights() {
    RefitReport report = drive([&] { return sync_.sync_weights(); });
    auto [results, train] = group_.take_results();
    const int rollout = static_cast<int>(nb::len(results)) - train;
    return nb::make_tuple(report.index, report.seconds, results, train, rollout);
  }
  void ensure_ready() {
    drive([&] { sync_.ensure_ready(); });
  }
  void shutdown() {
    drive([&] { sync_.shutdown(); });
  }
  BucketSize bucket_size() {
    return drive([&] { return sync_.bucket_size(); });
  }
  bool stale() const { return sync_.stale(); }
  bool ready() const { return sync_.ready(); }

 private:
  PyWorkerGroup group_;
  WeightSynchronizer sync_;
};

}  // namespace

void register_synchronizer(nb::module_& m) {
  nb::class_<PySynchronizer>(m, "WeightSynchronizer",
                             "refit::WeightSynchronizer (the C++ driver) over a Python refit.WorkerGroup. Use "
                             "refit.WeightSynchronizer, which wraps it.")
      .def(nb::init<const RefitConfig&, nb::object, const std::string&, nb::object, uint64_t>(), nb::arg("config"),
           nb::arg("workers"), nb::arg("backend"), nb::arg("engine_kwargs"), nb::arg("model_bytes") = 0,
           "engine_kwargs(session: bytes) -> the mapping create_engines() passes to the workers; model_bytes: the "
           "most one source sends (0: unknown), which caps the bucket size.")
      .def("sync_weights", &PySynchronizer::sync_weights,
           "One refit; returns (index, seconds, results, train_world_size, rollout_world_size). Raises the worker "
           "group's own exception, or a RefitError of the driver's.")
      .def("ensure_ready", &PySynchronizer::ensure_ready)
      .def("shutdown", &PySynchronizer::shutdown)
      .def_prop_ro("bucket_size", &PySynchronizer::bucket_size)
      .def_prop_ro("stale", &PySynchronizer::stale)
      .def_prop_ro("ready", &PySynchronizer::ready);
}

}  // namespace refit::py
