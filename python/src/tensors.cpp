// Tensors in and out through DLPack.
//
// In: anything nanobind can read as an ndarray (objects with __dlpack__, and the buffer
// protocol): NumPy, PyTorch (CPU and CUDA), CuPy, JAX... The dtype maps to refit's DType; a
// dtype refit does not move (uint16, complex...) is an error naming the tensor.
// Out: a view on refit's memory as a NumPy array, a torch.Tensor, a CuPy array, or a bare
// DLPack object (`dlpack`: has __dlpack__ / __dlpack_device__ and the buffer protocol).
#include <xxhash.h>

#include <fmt/format.h>

#include <cstring>

#include "common.h"
#include "refit/device.h"
#include "refit/dtype.h"

namespace refit::py {
namespace {

namespace dl = nb::dlpack;
using Code = dl::dtype_code;

constexpr int kDevCpu = nb::device::cpu::value;
constexpr int kDevCuda = nb::device::cuda::value;
constexpr int kDevCudaHost = nb::device::cuda_host::value;
constexpr int kDevCudaManaged = nb::device::cuda_managed::value;

dl::dtype make_dtype(Code code, int bits) {
  return dl::dtype{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
}

std::string dlpack_dtype_name(dl::dtype d) {
  const char* code = "code";
  switch (static_cast<Code>(d.code)) {
    case Code::Int:
      code = "int";
      break;
    case Code::UInt:
      code = "uint";
      break;
    case Code::Float:
      code = "float";
      break;
    case Code::Bfloat:
      code = "bfloat";
      break;
    case Code::Complex:
      code = "complex";
      break;
    case Code::Bool:
      code = "bool";
      break;
    default:
      return fmt::format("DLPack dtype code {} with {} bits", d.code, d.bits);
  }
  return fmt::format("{}{}{}", code, d.bits, d.lanes != 1 ? fmt::format("x{}", d.lanes) : "");
}

std::optional<DType> dtype_from_dlpack(dl::dtype d) {
  if (d.lanes != 1) return std::nullopt;
  switch (static_cast<Code>(d.code)) {
    case Code::Bool:
      return d.bits == 8 ? std::optional(DType::kBool) : std::nullopt;
    case Code::UInt:
      return d.bits == 8 ? std::optional(DType::kUInt8) : std::nullopt;
    case Code::Int:
      switch (d.bits) {
        case 8:
          return DType::kInt8;
        case 16:
          return DType::kInt16;
        case 32:
          return DType::kInt32;
        case 64:
          return DType::kInt64;
        default:
          return std::nullopt;
      }
    case Code::Float:
      switch (d.bits) {
        case 16:
          return DType::kFloat16;
        case 32:
          return DType::kFloat32;
        case 64:
          return DType::kFloat64;
        default:
          return std::nullopt;
      }
    case Code::Bfloat:
      return d.bits == 16 ? std::optional(DType::kBFloat16) : std::nullopt;
    case Code::Float8_E4M3FN:
      return d.bits == 8 ? std::optional(DType::kFloat8E4M3FN) : std::nullopt;
    case Code::Float8_E5M2:
      return d.bits == 8 ? std::optional(DType::kFloat8E5M2) : std::nullopt;
    default:
      return std::nullopt;
  }
}

dl::dtype dtype_to_dlpack(DType t) {
  switch (t) {
    case DType::kBool:
      return make_dtype(Code::Bool, 8);
    case DType::kUInt8:
      return make_dtype(Code::UInt, 8);
    case DType::kInt8:
      return make_dtype(Code::Int, 8);
    case DType::kInt16:
      return make_dtype(Code::Int, 16);
    case DType::kInt32:
      return make_dtype(Code::Int, 32);
    case DType::kInt64:
      return make_dtype(Code::Int, 64);
    case DType::kFloat16:
      return make_dtype(Code::Float, 16);
    case DType::kBFloat16:
      return make_dtype(Code::Bfloat, 16);
    case DType::kFloat32:
      return make_dtype(Code::Float, 32);
    case DType::kFloat64:
      return make_dtype(Code::Float, 64);
    case DType::kFloat8E4M3FN:
      return make_dtype(Code::Float8_E4M3FN, 8);
    case DType::kFloat8E5M2:
      return make_dtype(Code::Float8_E5M2, 8);
  }
  return make_dtype(Code::UInt, 8);
}

// Dtypes NumPy lacks (and torch's DLPack may lack, for float8): exported as unsigned integers
// of the same width and re-viewed as the framework's own type.
bool numpy_lacks(DType t) { return t == DType::kBFloat16 || t == DType::kFloat8E4M3FN || t == DType::kFloat8E5M2; }
bool torch_dlpack_lacks(DType t) { return t == DType::kFloat8E4M3FN || t == DType::kFloat8E5M2; }

dl::dtype raw_bits(DType t) { return make_dtype(Code::UInt, static_cast<int>(dtype_size(t)) * 8); }

// Fast check before DLPack import: a NumPy array whose dtype comes from ml_dtypes (only possible
// once ml_dtypes is imported). Their DLPack export fails, so they are read as raw bits.
std::optional<DType> ml_dtype_fast(nb::handle obj) {
  static PyTypeObject* ndarray_type = nullptr;
  if (!ndarray_type) {
    PyObject* numpy = PyImport_GetModule(nb::str("numpy").ptr());
    if (!numpy) {
      PyErr_Clear();
      return std::nullopt;
    }
    PyObject* t = PyObject_GetAttrString(numpy, "ndarray");
    Py_DECREF(numpy);
    if (!t) {
      PyErr_Clear();
      return std::nullopt;
    }
    ndarray_type = reinterpret_cast<PyTypeObject*>(t);  // kept
  }
  if (Py_TYPE(obj.ptr()) != ndarray_type) return std::nullopt;
  static PyObject* kinds[3] = {};
  if (!kinds[0]) {
    PyObject* ml = PyImport_GetModule(nb::str("ml_dtypes").ptr());
    if (!ml) {
      PyErr_Clear();
      return std::nullopt;
    }
    const char* names[3] = {"bfloat16", "float8_e4m3fn", "float8_e5m2"};
    for (int i = 0; i < 3; ++i) kinds[i] = PyObject_GetAttrString(ml, names[i]);  // kept
    Py_DECREF(ml);
    if (!kinds[0] || !kinds[1] || !kinds[2]) {
      PyErr_Clear();
      kinds[0] = kinds[1] = kinds[2] = nullptr;
      return std::nullopt;
    }
  }
  PyObject* dtype = PyObject_GetAttrString(obj.ptr(), "dtype");
  if (!dtype) {
    PyErr_Clear();
    return std::nullopt;
  }
  PyObject* scalar = PyObject_GetAttrString(dtype, "type");
  Py_DECREF(dtype);
  if (!scalar) {
    PyErr_Clear();
    return std::nullopt;
  }
  std::optional<DType> out;
  if (scalar == kinds[0])
    out = DType::kBFloat16;
  else if (scalar == kinds[1])
    out = DType::kFloat8E4M3FN;
  else if (scalar == kinds[2])
    out = DType::kFloat8E5M2;
  Py_DECREF(scalar);
  return out;
}

// A NumPy array of an ml_dtypes type: refit's DType for it, if any.
std::optional<DType> ml_dtype_of(nb::handle obj) {
  if (!nb::hasattr(obj, "dtype") || !nb::hasattr(obj, "view")) return std::nullopt;
  nb::object dtype = obj.attr("dtype");
  if (!nb::hasattr(dtype, "name")) return std::nullopt;
  const std::string name = nb::cast<std::string>(nb::str(dtype.attr("name")));
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float8_e4m3fn") return DType::kFloat8E4M3FN;
  if (name == "float8_e5m2") return DType::kFloat8E5M2;
  return std::nullopt;
}

bool is_c_contiguous(const nb::ndarray<nb::ro>& a) {
  if (a.stride_ptr() == nullptr) return true;
  const size_t ndim = a.ndim();
  for (size_t i = 0; i < ndim; ++i)
    if (a.shape(i) == 0) return true;
  int64_t expected = 1;
  for (size_t i = ndim; i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

std::string py_type_name(nb::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

std::string shape_of(const nb::ndarray<nb::ro>& a, bool strides) {
  std::string out = "[";
  for (size_t i = 0; i < a.ndim(); ++i) {
    if (i) out += ", ";
    out += std::to_string(strides ? a.stride(i) : static_cast<int64_t>(a.shape(i)));
  }
  return out + "]";
}

nb::handle cached_attr(const char* module, const char* attr, nb::handle* slot) {
  // Kept for the life of the process (never released: module teardown order is unknown).
  if (!slot->is_valid()) *slot = nb::object(nb::module_::import_(module).attr(attr)).release();
  return *slot;
}

nb::handle numpy_ascontiguousarray() {
  static nb::handle h;
  return cached_attr("numpy", "ascontiguousarray", &h);
}

nb::handle ml_dtype(DType t) {
  static nb::handle bf16, e4m3, e5m2;
  try {
    switch (t) {
      case DType::kBFloat16:
        return cached_attr("ml_dtypes", "bfloat16", &bf16);
      case DType::kFloat8E4M3FN:
        return cached_attr("ml_dtypes", "float8_e4m3fn", &e4m3);
      default:
        return cached_attr("ml_dtypes", "float8_e5m2", &e5m2);
    }
  } catch (const nb::python_error&) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("NumPy has no {} dtype: install ml_dtypes (pip install ml-dtypes) to receive {} tensors "
                            "as NumPy arrays, or receive them with framework='torch' or 'dlpack'",
                            dtype_name(t), dtype_name(t)));
  }
}

nb::handle torch_dtype(DType t) {
  static nb::handle e4m3, e5m2;
  return t == DType::kFloat8E4M3FN ? cached_attr("torch", "float8_e4m3fn", &e4m3)
                                   : cached_attr("torch", "float8_e5m2", &e5m2);
}

// Everything but the data is the same whatever the element type; refit's zero-byte tensors may
// have no address, which some consumers dislike.
alignas(64) std::byte g_empty[64];

}  // namespace

Framework parse_framework(std::string_view name) {
  if (name == "numpy") return Framework::kNumpy;
  if (name == "torch" || name == "pytorch") return Framework::kTorch;
  if (name == "cupy") return Framework::kCupy;
  if (name == "dlpack") return Framework::kDlpack;
  throw Error(ErrorKind::kInvalidArgument,
              fmt::format("framework must be 'numpy', 'torch', 'cupy' or 'dlpack', got '{}'", name));
}

// torch's lazy negation and conjugation (`.conj().imag`, torch._neg_view): the memory holds the
// values before it, and DLPack exports that memory as it is. Its name, or null.
const char* torch_lazy_bit(nb::handle obj) {
  for (const char* bit : {"is_neg", "is_conj"})
    if (nb::hasattr(obj, bit) && nb::cast<bool>(obj.attr(bit)())) return bit;
  return nullptr;
}

ImportedTensor import_tensor(nb::handle obj_in, const std::string& name, bool device_ok, bool copies_ok) {
  nb::object obj = nb::borrow(obj_in);
  if (const char* bit = torch_lazy_bit(obj)) {
    if (!copies_ok)
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("tensor '{}' has torch's {} bit set: its memory holds other values than it reads as, and "
                              "it is read where it lies; pass t.resolve_neg().resolve_conj()",
                              name, bit == std::string_view("is_neg") ? "negative" : "conjugate"));
    obj = obj.attr("resolve_neg")().attr("resolve_conj")();  // a copy with the values it reads as
  }
  std::optional<DType> forced;  // an ml_dtypes array read as its bits
  bool detached = false, contiguous_made = false, staged = false;
  if ((forced = ml_dtype_fast(obj))) obj = obj.attr("view")(dtype_size(*forced) == 2 ? "uint16" : "uint8");
  for (;;) {
    nb::ndarray<nb::ro> a;
    if (!nb::try_cast(obj, a, false)) {
      PyErr_Clear();
      // torch refuses to export tensors that require grad.
      if (!detached && nb::hasattr(obj, "detach") && nb::hasattr(obj, "requires_grad") &&
          nb::cast<bool>(obj.attr("requires_grad"))) {
        obj = obj.attr("detach")();
        detached = true;
        continue;
      }
      if (!forced) {
        if (auto t = ml_dtype_of(obj)) {
          forced = t;
          obj = obj.attr("view")(dtype_size(*t) == 2 ? "uint16" : "uint8");
          continue;
        }
      }
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("tensor '{}': cannot read a {} as a tensor (it supports neither DLPack nor the buffer "
                              "protocol, or its dtype has no DLPack code)",
                              name, py_type_name(obj)));
    }

    MemoryKind memory = MemoryKind::kHost;
    const int dev = a.device_type();
    if (dev == kDevCuda || dev == kDevCudaManaged) {
      if (!device_ok) {
        // This build cannot read GPU memory: stage through host memory (one copy per tensor).
        if (!copies_ok)
          throw Error(
              ErrorKind::kUnsupported,
              fmt::format("tensor '{}' is in GPU memory, which this build of refit cannot read where it lies", name));
        if (staged) throw Error(ErrorKind::kInternal, fmt::format("tensor '{}': staging to host memory failed", name));
        if (nb::hasattr(obj, "cpu")) {
          obj = obj.attr("cpu")();
        } else if (nb::hasattr(obj, "get")) {
          obj = obj.attr("get")();
        } else {
          throw Error(ErrorKind::kUnsupported,
                      fmt::format("tensor '{}' ({}) is in GPU memory, which this build of refit cannot read, and it "
                                  "has no .cpu() or .get() to copy it to host memory",
                                  name, py_type_name(obj)));
        }
        staged = true;
        continue;
      }
      memory = MemoryKind::kCuda;
    } else if (dev != kDevCpu && dev != kDevCudaHost) {
      throw Error(ErrorKind::kUnsupported,
                  fmt::format("tensor '{}' ({}) lives on DLPack device type {}, which refit cannot read", name,
                              py_type_name(obj), dev));
    }

    DType dtype;
    if (forced) {
      dtype = *forced;
    } else if (auto t = dtype_from_dlpack(a.dtype())) {
      dtype = *t;
    } else {
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("tensor '{}' has dtype {}, which refit does not move (bool, uint8, int8/16/32/64, "
                              "float16/32/64, bfloat16, float8_e4m3fn, float8_e5m2)",
                              name, dlpack_dtype_name(a.dtype())));
    }

    if (!is_c_contiguous(a)) {
      if (!copies_ok)
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("tensor '{}' is not contiguous (shape {}, strides {}): it is read where it lies, so "
                                "pass a contiguous tensor",
                                name, shape_of(a, false), shape_of(a, true)));
      if (contiguous_made)
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("tensor '{}' is not contiguous (shape {}, strides {}) even after making it contiguous",
                                name, shape_of(a, false), shape_of(a, true)));
      if (nb::hasattr(obj, "contiguous")) {
        obj = obj.attr("contiguous")();
      } else if (std::string_view(py_type_name(obj)) == "numpy.ndarray") {
        obj = numpy_ascontiguousarray()(obj);
      } else {
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("tensor '{}' ({}) is not contiguous (shape {}, strides {}): make it contiguous before "
                                "sending",
                                name, py_type_name(obj), shape_of(a, false), shape_of(a, true)));
      }
      contiguous_made = true;
      continue;
    }

    ImportedTensor out;
    out.info.name = name;
    out.info.dtype = dtype;
    out.info.shape.resize(a.ndim());
    for (size_t i = 0; i < a.ndim(); ++i) out.info.shape[i] = static_cast<int64_t>(a.shape(i));
    if (forced && a.itemsize() != dtype_size(dtype))
      throw Error(ErrorKind::kInternal, fmt::format("tensor '{}': raw view has the wrong element size", name));
    out.data = static_cast<const std::byte*>(a.data());
    out.memory = memory;
    out.keep = std::move(obj);
    out.array = std::move(a);
    return out;
  }
}

WritableTensor import_writable(nb::handle obj, bool device_ok) {
  nb::ndarray<> a;
  nb::object target = nb::borrow(obj);
  if (const char* bit = torch_lazy_bit(target))
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("expected a tensor whose memory holds its values, got one with torch's {} bit set (bytes "
                            "written into it would read negated or conjugated)",
                            bit == std::string_view("is_neg") ? "negative" : "conjugate"));
  // torch refuses to export a tensor that requires grad; its detached view is the same memory.
  if (nb::hasattr(target, "detach") && nb::hasattr(target, "requires_grad") &&
      nb::cast<bool>(target.attr("requires_grad")))
    target = target.attr("detach")();
  std::optional<DType> forced;  // an ml_dtypes array, viewed as its bits
  if (!nb::try_cast(target, a, false)) {
    PyErr_Clear();
    if ((forced = ml_dtype_of(target))) target = target.attr("view")(dtype_size(*forced) == 2 ? "uint16" : "uint8");
    if (!nb::try_cast(target, a, false)) {
      PyErr_Clear();
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("expected a writable tensor (NumPy array, torch.Tensor...), got {}", py_type_name(obj)));
    }
  }
  WritableTensor out;
  if (a.device_type() == kDevCuda && device_ok) {
    out.memory = MemoryKind::kCuda;
    out.device_id = a.device_id();
  } else if (a.device_type() != kDevCpu && a.device_type() != kDevCudaHost) {
    throw Error(ErrorKind::kUnsupported, device_ok ? fmt::format("expected a tensor in host or GPU memory, got DLPack "
                                                                 "device type {}",
                                                                 a.device_type())
                                                   : std::string("expected a tensor in host memory"));
  }
  nb::ndarray<nb::ro> ro(a);
  if (!is_c_contiguous(ro)) throw Error(ErrorKind::kInvalidArgument, "expected a contiguous tensor");
  if (forced) {
    out.info.dtype = *forced;
  } else if (auto t = dtype_from_dlpack(a.dtype())) {
    out.info.dtype = *t;
  } else {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("dtype {} is not one refit moves", dlpack_dtype_name(a.dtype())));
  }
  out.info.shape.resize(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) out.info.shape[i] = static_cast<int64_t>(a.shape(i));
  out.data = static_cast<std::byte*>(a.data());
  out.nbytes = a.nbytes();
  out.array = std::move(a);
  out.keep = std::move(target);
  return out;
}

nb::object export_tensor(const TensorInfo& info, const std::byte* data, MemoryKind memory, int device_id,
                         nb::handle owner, Framework framework) {
  const size_t ndim = info.shape.size();
  size_t shape_small[8];
  std::vector<size_t> shape_large;
  size_t* shape = shape_small;
  if (ndim > 8) {
    shape_large.resize(ndim);
    shape = shape_large.data();
  }
  for (size_t i = 0; i < ndim; ++i) shape[i] = static_cast<size_t>(info.shape[i]);

  bool reinterpret = false;
  dl::dtype dtype = dtype_to_dlpack(info.dtype);
  if ((framework == Framework::kNumpy && numpy_lacks(info.dtype)) ||
      (framework == Framework::kTorch && torch_dlpack_lacks(info.dtype))) {
    dtype = raw_bits(info.dtype);
    reinterpret = true;
  }
  void* ptr = const_cast<std::byte*>(data);
  if (ptr == nullptr) ptr = g_empty;
  const int device_type = memory == MemoryKind::kCuda ? kDevCuda : kDevCpu;
  if (framework == Framework::kNumpy && memory == MemoryKind::kCuda)
    throw Error(ErrorKind::kUnsupported,
                fmt::format("tensor '{}' is in GPU memory: receive it with framework='torch' or 'cupy', not 'numpy'",
                            info.name));
  nb::ndarray<> array(ptr, ndim, shape, owner, nullptr, dtype, device_type,
                      memory == MemoryKind::kCuda ? device_id : 0);

  nb::object out;
  switch (framework) {
    case Framework::kNumpy:
      out = nb::ndarray<nb::numpy>(array).cast();
      break;
    case Framework::kTorch:
      out = nb::ndarray<nb::pytorch>(array).cast();
      break;
    case Framework::kCupy:
      out = nb::ndarray<nb::cupy>(array).cast();
      break;
    case Framework::kDlpack:
      out = nb::ndarray<nb::array_api>(array).cast();
      break;
  }
  if (reinterpret) {
    nb::handle target = framework == Framework::kNumpy ? ml_dtype(info.dtype) : torch_dtype(info.dtype);
    out = out.attr("view")(target);
  }
  return out;
}

std::vector<uint8_t> bytes_of(nb::handle obj, std::string_view what) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) {
    PyErr_Clear();
    throw Error(ErrorKind::kInvalidArgument, fmt::format("{} must be bytes, got {}", what, py_type_name(obj)));
  }
  const auto* p = static_cast<const uint8_t*>(view.buf);
  std::vector<uint8_t> out(p, p + view.len);
  PyBuffer_Release(&view);
  return out;
}

namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

void register_tensors(nb::module_& m) {
  m.def(
      "xxh3_64",
      [](nb::handle tensor) {
        ImportedTensor t = import_tensor(tensor, "argument", /*device_ok=*/false);
        const uint64_t n = t.info.nbytes();
        uint64_t h;
        {
          GilRelease nogil;
          h = XXH3_64bits(t.data, n);
        }
        return h;
      },
      nb::arg("tensor"),
      "XXH3-64 of a host tensor's bytes (GPU tensors are copied to host first). The same hash `refit bench` "
      "uses to check every tensor.");

  m.def(
      "fill_synthetic",
      [](nb::handle tensor, uint64_t seed) {
        WritableTensor t = import_writable(tensor);
        GilRelease nogil;
        uint64_t state = seed;
        uint64_t i = 0;
        const uint64_t n = t.nbytes;
        for (; i + 8 <= n; i += 8) {
          uint64_t v = splitmix64(state);
          std::memcpy(t.data + i, &v, 8);
        }
        if (i < n) {
          uint64_t v = splitmix64(state);
          std::memcpy(t.data + i, &v, n - i);
        }
      },
      nb::arg("tensor"), nb::arg("seed"),
      "Fills a writable host tensor with deterministic pseudo-random bytes (splitmix64 from `seed`), as "
      "`refit bench` fills its synthetic weights.");

  m.def(
      "tensor_info",
      [](nb::handle tensor) {
        ImportedTensor t = import_tensor(tensor, "argument", /*device_ok=*/true);
        nb::list shape;
        for (int64_t d : t.info.shape) shape.append(d);
        return nb::make_tuple(std::string(dtype_name(t.info.dtype)), nb::tuple(shape), t.info.nbytes());
      },
      nb::arg("tensor"), nb::sig("def tensor_info(tensor: object) -> tuple[str, tuple[int, ...], int]"),
      "(dtype name, shape, nbytes) of a tensor as refit reads it (for checks and tests).");
}

}  // namespace refit::py
