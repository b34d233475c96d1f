// The destination side of the FP8 refit path for Python: refit::Fp8QuantizingLoader over
// batches of (name, tensor) pairs, and the name predicates a Python loader needs.
//
// The loader runs with the GIL held (its callbacks are Python callables, called once per
// tensor); tensors are read as refit reads tensors to send (GPU tensors are copied to host
// first), and the quantized ones are handed out as new host tensors the callback may keep.
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <unordered_map>

#include "common.h"
#include "refit/dtype.h"
#include "refit/fp8_loading.h"

namespace refit::py {
namespace {

Fp8Scaling parse_scaling(const std::string& name) {
  if (name == "block128") return Fp8Scaling::kBlock128;
  if (name == "per_tensor") return Fp8Scaling::kPerTensor;
  throw Error(ErrorKind::kInvalidArgument, fmt::format("scaling must be 'block128' or 'per_tensor', got '{}'", name));
}

class PyFp8Loader {
 public:
  PyFp8Loader(nb::object store_fp8, nb::object store_other, nb::object post_load, nb::object quantize,
              const std::string& scaling, const std::string& framework)
      : store_fp8_(std::move(store_fp8)),
        store_other_(std::move(store_other)),
        post_load_(std::move(post_load)),
        quantize_(std::move(quantize)),
        framework_(parse_framework(framework)) {
    Fp8LoaderOptions options;
    options.scaling = parse_scaling(scaling);
    if (quantize_.is_valid() && !quantize_.is_none())
      options.quantize = [this](const TensorInfo& info) { return nb::cast<bool>(quantize_(info)); };
    options.store_fp8 = [this](const TensorInfo& source, const Fp8Tensor& q) { on_fp8(source, q); };
    options.store_other = [this](const TensorView& v) { store_other_(nb::str(v.info->name.c_str()), object_of(v)); };
    options.post_load = [this](const std::map<std::string, float>& scales) {
      if (post_load_.is_valid() && !post_load_.is_none()) post_load_(nb::cast(scales));
    };
    loader_ = std::make_unique<Fp8QuantizingLoader>(std::move(options));
    load_ = loader_->loader();
  }

  // One batch: a list (any iterable) of (name, tensor) pairs, as receive_weight_batches() gives.
  void load(nb::handle batch) {
    std::vector<ImportedTensor> tensors;
    std::vector<nb::object> objects;
    for (nb::handle item : batch) {
      if (!PySequence_Check(item.ptr()) || PyUnicode_Check(item.ptr()) || PySequence_Size(item.ptr()) != 2) {
        PyErr_Clear();
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("an FP8 loader's batch must hold (name, tensor) pairs, got a {}",
                                Py_TYPE(item.ptr())->tp_name));
      }
      nb::object name_obj = nb::steal(PySequence_GetItem(item.ptr(), 0));
      nb::object obj = nb::steal(PySequence_GetItem(item.ptr(), 1));
      if (!name_obj.is_valid() || !obj.is_valid()) throw nb::python_error();
      if (!PyUnicode_Check(name_obj.ptr()))
        throw Error(ErrorKind::kInvalidArgument, "an FP8 loader's batch: a tensor name must be a str");
      std::string name = nb::cast<std::string>(name_obj);
      tensors.push_back(import_tensor(obj, name, /*device_ok=*/false));
      objects.push_back(std::move(obj));
    }
    std::vector<TensorView> views;
    views.reserve(tensors.size());
    objects_.clear();
    for (size_t i = 0; i < tensors.size(); ++i) {
      views.push_back({&tensors[i].info, tensors[i].data, tensors[i].memory});
      objects_[&tensors[i].info] = objects[i];
    }
    struct Clear {
      std::unordered_map<const TensorInfo*, nb::object>& map;
      ~Clear() { map.clear(); }
    } clear{objects_};
    load_(LoadBatch(views.data(), views.size()));
  }

  void finish_refit() { loader_->finish_refit(); }

 private:
  nb::object object_of(const TensorView& v) {
    auto it = objects_.find(v.info);
    return it == objects_.end() ? nb::none() : it->second;
  }

  void on_fp8(const TensorInfo& source, const Fp8Tensor& q) {
    auto* owned = new Fp8Tensor(q);
    nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<Fp8Tensor*>(p); });
    TensorInfo data_info{source.name, DType::kFloat8E4M3FN, source.shape};
    TensorInfo scale_info{source.name + "_scale_inv", DType::kFloat32, owned->scale_shape};
    nb::object data = export_tensor(data_info, reinterpret_cast<const std::byte*>(owned->data.data()),
                                    MemoryKind::kHost, 0, owner, framework_);
    nb::object scales = export_tensor(scale_info, reinterpret_cast<const std::byte*>(owned->scales.data()),
                                      MemoryKind::kHost, 0, owner, framework_);
    store_fp8_(nb::str(source.name.c_str()), data, scales);
  }

  nb::object store_fp8_, store_other_, post_load_, quantize_;
  Framework framework_;
  std::unique_ptr<Fp8QuantizingLoader> loader_;
  BatchLoader load_;
  std::unordered_map<const TensorInfo*, nb::object> objects_;  // during load(): the batch's objects
};

}  // namespace

void register_fp8(nb::module_& m) {
  m.def(
      "is_kv_scale_name", [](const std::string& name) { return is_kv_scale_name(name); }, nb::arg("name"),
      "True for the reference's FP8 KV-cache scale names (model.layers.{i}.self_attn.attn.q_scale, "
      "...self_attn.k_scale, ...self_attn.v_scale).");
  m.def(
      "is_fp8_linear_weight",
      [](const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) {
        return is_fp8_linear_weight(TensorInfo{name, parse_dtype(dtype), shape});
      },
      nb::arg("name"), nb::arg("dtype"), nb::arg("shape"),
      "Whether Fp8QuantizingLoader quantizes this tensor by default: a 2-D bfloat16/float32 '*.weight' other "
      "than embeddings, lm_head, norms and routers.");

  nb::class_<PyFp8Loader>(
      m, "Fp8QuantizingLoader",
      "A destination's loader for the FP8 path: quantizes received bfloat16/float32 linear weights to "
      "float8_e4m3fn (on the host), hands every other tensor through, and collects the FP8 KV-cache scales. "
      "Call it with each batch (a list of (name, tensor)), then finish_refit() once after the refit's last batch.")
      .def(nb::init<nb::object, nb::object, nb::object, nb::object, const std::string&, const std::string&>(),
           nb::arg("store_fp8"), nb::arg("store_other"), nb::arg("post_load").none() = nb::none(),
           nb::arg("quantize").none() = nb::none(), nb::arg("scaling") = "block128", nb::arg("framework") = "numpy",
           "store_fp8(name, data, scale_inv): a quantized tensor (float8_e4m3fn, the source's shape) and its "
           "float32 dequantization scales ([ceil(M/128), ceil(N/128)] for 'block128', [1] for 'per_tensor'), new "
           "tensors of `framework` ('numpy' needs ml_dtypes; 'torch'). store_other(name, tensor): every other "
           "tensor but KV scales, the object received (valid as long as the batch's). post_load(scales): once per "
           "refit from finish_refit(), with {name: float} of the KV scales received (maybe empty). quantize(info: "
           "TensorInfo) -> bool replaces the default choice (is_fp8_linear_weight).")
      .def("load", &PyFp8Loader::load, nb::arg("batch"))
      .def("__call__", &PyFp8Loader::load, nb::arg("batch"))
      .def("finish_refit", &PyFp8Loader::finish_refit,
           "After the refit's last batch: calls post_load with the KV scales of this refit, then forgets them.");
}

}  // namespace refit::py
