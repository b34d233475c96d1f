// Shared declarations of the refit Python extension (`refit._refit`).
//
// The extension is a thin layer over the C++ library: it converts arguments, releases the GIL
// around every transfer and wait, moves tensors in and out through DLPack, and turns
// refit::Error into the Python exception class of its kind with the same message.
#pragma once

#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "refit/config.h"
#include "refit/error.h"
#include "refit/ext/transport.h"
#include "refit/tensor.h"

namespace nb = nanobind;

namespace refit::py {

// Whether the interpreter is shutting down (then the GIL must not be released).
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Releases the GIL for a blocking call and takes it back after. A daemon thread still in a refit
// call when the program ends parks here instead of taking the GIL back, until the process exits
// around it: CPython 3.13 and older end a thread that wants the GIL once finalizing has begun by
// unwinding it, which through the C++ frames here aborts the process. An atexit hook (module.cpp,
// run once only daemon threads are left) marks the end, then lets every thread already on its way
// back to the GIL get there before finalizing starts. Finalizing already (a destructor run at
// exit), it keeps the GIL.
class GilRelease {
 public:
  GilRelease() : state_(interpreter_finalizing() ? nullptr : PyEval_SaveThread()) {}
  ~GilRelease() {
    if (state_ != nullptr) take_back(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  static void take_back(PyThreadState* state);
  PyThreadState* state_;
};

// ---- errors (errors.cpp) ---------------------------------------------------------------------

// Creates RefitError and one subclass per ErrorKind in `m`, and registers the translator that
// turns a refit::Error escaping any binding into the class of its kind (message unchanged).
void register_errors(nb::module_& m);

// The Python exception class for `kind`.
nb::handle error_type(ErrorKind kind);
// The kind of a raised Python exception: its refit error class's, else kInvalidArgument.
ErrorKind error_kind_of(nb::handle exception);

// Raises `e` as its Python class with `cause` (if any) as __cause__: sets the Python error and
// throws nb::python_error. Needs the GIL.
[[noreturn]] void raise_error(const Error& e, nb::handle cause = nb::handle());

// ---- transports written in Python (python_transport.cpp) ------------------------------------

// The engine's transport for a Python backend object (refit.nixl.NixlTransport; its methods are
// listed in python_transport.cpp). With a cuda `device` the transfer buffers are GPU memory that
// the object registers as such. Needs the GIL.
std::shared_ptr<Transport> python_transport(nb::handle impl, const Device& device);

// ---- tensors (tensors.cpp) -------------------------------------------------------------------

// How received tensors are handed to Python.
enum class Framework { kNumpy, kTorch, kCupy, kDlpack };
Framework parse_framework(std::string_view name);

// A tensor read from a Python object (anything with __dlpack__ or the buffer protocol): its
// metadata, where its bytes are, and the objects that keep those bytes alive.
struct ImportedTensor {
  TensorInfo info;
  const std::byte* data = nullptr;
  MemoryKind memory = MemoryKind::kHost;
  nb::object keep;            // the (possibly converted) Python object
  nb::ndarray<nb::ro> array;  // the DLPack view of it
};

// Reads `obj` as a contiguous tensor named `name`. Needs the GIL. Torch tensors that require
// grad are detached; non-contiguous tensors are made contiguous (torch: .contiguous(), NumPy:
// ascontiguousarray); NumPy arrays of ml_dtypes (bfloat16, float8_*) are read as their bits;
// GPU tensors are staged through host memory (.cpu() / .get()) unless `device_ok`. Without
// `copies_ok` the tensor must be read where it lies: a non-contiguous one (or one to stage) is an
// error. Throws Error(kInvalidArgument / kUnsupported) naming the tensor.
ImportedTensor import_tensor(nb::handle obj, const std::string& name, bool device_ok, bool copies_ok = true);

// The same for a tensor refit writes into in place: writable, contiguous, in host memory, or on a
// GPU with `device_ok`. A torch tensor that requires grad is written through its detached view
// (the same memory). Throws Error(kInvalidArgument / kUnsupported).
struct WritableTensor {
  TensorInfo info;  // dtype and shape (no name)
  std::byte* data = nullptr;
  uint64_t nbytes = 0;
  MemoryKind memory = MemoryKind::kHost;
  int device_id = 0;  // of GPU memory
  nb::ndarray<> array;
  nb::object keep;  // the object viewed (a detached view, maybe)
};
WritableTensor import_writable(nb::handle obj, bool device_ok = false);

// A Python tensor (of `framework`) viewing `data`, which `owner` keeps alive. Needs the GIL.
nb::object export_tensor(const TensorInfo& info, const std::byte* data, MemoryKind memory, int device_id,
                         nb::handle owner, Framework framework);

// ---- bindings (one register function per file) ------------------------------------------------

void register_tensors(nb::module_& m);
void register_config(nb::module_& m);
void register_engine(nb::module_& m);
void register_fp8(nb::module_& m);
void register_synchronizer(nb::module_& m);
void register_expert_loader(nb::module_& m);

// Bytes of a bytes-like object (bytes, bytearray, memoryview). Needs the GIL.
std::vector<uint8_t> bytes_of(nb::handle obj, std::string_view what);

}  // namespace refit::py
