// refit::Error as Python exceptions: RefitError (a RuntimeError) and one subclass per ErrorKind,
// each also deriving from the built-in exception a Python caller would expect (ConfigError is a
// ValueError, RefitTimeoutError a TimeoutError, PeerLostError a ConnectionError...). The message
// is the C++ message unchanged; the class attribute `kind` names the ErrorKind.
#include <string>

#include "common.h"

namespace refit::py {
namespace {

struct KindSpec {
  ErrorKind kind;
  const char* name;  // class name in package `refit`
  PyObject* extra;   // second base class, or null
  const char* doc;
};

constexpr int kKinds = 13;
PyObject* g_base = nullptr;
PyObject* g_types[kKinds] = {};

std::string kind_name(ErrorKind kind) {
  std::string s(to_string(kind));
  for (char& c : s)
    if (c == ' ') c = '_';
  return s;
}

}  // namespace

nb::handle error_type(ErrorKind kind) {
  const int i = static_cast<int>(kind);
  if (i >= 0 && i < kKinds && g_types[i]) return g_types[i];
  return g_base;
}

ErrorKind error_kind_of(nb::handle exception) {
  for (int i = 0; i < kKinds; ++i)
    if (g_types[i] && PyObject_IsInstance(exception.ptr(), g_types[i]) == 1) return static_cast<ErrorKind>(i);
  PyErr_Clear();
  return ErrorKind::kInvalidArgument;  // not refit's: the caller's code failed
}

void register_errors(nb::module_& m) {
  // Named after the package that holds the module, "refit.X", so that pickling (multiprocessing,
  // Ray) finds them through the package. The module imported alone (nanobind's stubgen imports it
  // as the top-level `_refit` at build time) names them after itself, so that its stub declares them.
  const std::string module_name = nb::cast<std::string>(m.attr("__name__"));
  const std::string owner = module_name.substr(0, module_name.rfind('.'));  // npos: the whole name
  nb::dict base_dict;
  base_dict["kind"] = "internal";
  g_base = PyErr_NewExceptionWithDoc((owner + ".RefitError").c_str(),
                                     "Base class of every error refit raises; `kind` names its ErrorKind.",
                                     PyExc_RuntimeError, base_dict.ptr());
  if (!g_base) throw nb::python_error();
  m.attr("RefitError") = nb::borrow(g_base);

  const KindSpec specs[] = {
      {ErrorKind::kConfig, "ConfigError", PyExc_ValueError, "A configuration key has a bad value, or is unknown."},
      {ErrorKind::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
       "A call got an argument it cannot use (a repeated tensor name, a bad tensor, a misuse of the lifecycle)."},
      {ErrorKind::kModel, "ModelError", PyExc_ValueError, "A model description is missing or malformed."},
      {ErrorKind::kTopology, "TopologyError", PyExc_ValueError, "World sizes and ranks do not form a valid pairing."},
      {ErrorKind::kLayout, "LayoutError", PyExc_ValueError, "A destination layout does not match the model."},
      {ErrorKind::kTransport, "TransportError", nullptr, "The transport failed to set up or to move bytes."},
      {ErrorKind::kTimeout, "RefitTimeoutError", PyExc_TimeoutError, "A wait passed its deadline."},
      {ErrorKind::kPeerLost, "PeerLostError", PyExc_ConnectionError, "A peer process went away."},
      {ErrorKind::kIntegrity, "IntegrityError", nullptr, "Received bytes do not match what was sent."},
      {ErrorKind::kProtocol, "ProtocolError", nullptr,
       "A peer sent metadata or a message that is malformed or does not match ours."},
      {ErrorKind::kIo, "RefitIOError", PyExc_OSError, "A file could not be read or written."},
      {ErrorKind::kUnsupported, "UnsupportedError", PyExc_NotImplementedError,
       "Asked for something this build or machine cannot do."},
      {ErrorKind::kInternal, "InternalError", nullptr, "A bug in refit."},
  };
  for (const auto& spec : specs) {
    nb::dict dict;
    dict["kind"] = kind_name(spec.kind);
    nb::object bases =
        spec.extra ? nb::object(nb::make_tuple(nb::handle(g_base), nb::handle(spec.extra))) : nb::borrow(g_base);
    const std::string qualified = owner + "." + spec.name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), spec.doc, bases.ptr(), dict.ptr());
    if (!type) throw nb::python_error();
    g_types[static_cast<int>(spec.kind)] = type;  // kept for the life of the process
    m.attr(spec.name) = nb::borrow(type);
  }

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_type(e.kind()).ptr(), e.what());
    }
  });
}

void raise_error(const Error& e, nb::handle cause) {
  // Ctrl-C and sys.exit() from caller code stay what they are (`except Exception` must not catch
  // them); the refit failed all the same, everywhere, and its error comes along as a note.
  if (cause.is_valid() && !cause.is_none() && PyObject_IsInstance(cause.ptr(), PyExc_Exception) == 0) {
    if (nb::hasattr(cause, "add_note")) cause.attr("add_note")(nb::str(("refit: " + std::string(e.what())).c_str()));
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(cause.ptr())), cause.ptr());
    throw nb::python_error();
  }
  nb::handle type = error_type(e.kind());
  nb::object value = type(nb::str(e.what()));
  if (cause.is_valid() && !cause.is_none()) {
    // PyException_SetCause steals a reference.
    PyException_SetCause(value.ptr(), nb::borrow(cause).release().ptr());
  }
  PyErr_SetObject(type.ptr(), value.ptr());
  throw nb::python_error();
}

}  // namespace refit::py
