// The direct-copy expert loader for Python: refit::ExpertLoader writes received routed-expert
// slices (HF names, e.g. model.layers.0.mlp.experts.3.gate_proj.weight) straight into a
// destination's fused expert storage (<prefix>.routed_experts.w13_weight / w2_weight), as the
// reference's VllmShardedExpertRefitMixin does, and hands the other tensors back.
//
// The storage is the caller's host tensors (NumPy arrays, CPU torch tensors: anything writable
// through DLPack or the buffer protocol), written in place; the loader keeps them alive. Each
// batch is a list of (name, tensor) pairs, as receive_weight_batches() gives; the copies run
// without the GIL.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "refit/expert_loader.h"

namespace refit::py {
namespace {

const std::set<std::string, std::less<>> kStorageKeys = {
    "name",    "tensor", "transposed", "loader_inspectable",  "quant_method",       "moe_backend", "tp_rank",
    "tp_size", "use_ep", "eplb",       "num_logical_experts", "global_num_experts", "expert_map"};

// One fused expert parameter from a mapping {"name": ..., "tensor": ..., "tp_rank": ...}; its
// dtype and shape are the tensor's.
ExpertStorage storage_of(nb::handle spec, std::vector<nb::object>& keep) {
  if (!PyDict_Check(spec.ptr()))
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("expert storage: each entry must be a dict with 'name' and 'tensor', got a {}",
                            Py_TYPE(spec.ptr())->tp_name));
  nb::dict d = nb::borrow<nb::dict>(spec);
  if (!d.contains("name") || !d.contains("tensor"))
    throw Error(ErrorKind::kInvalidArgument, "expert storage: each entry needs 'name' and 'tensor'");
  ExpertStorage s;
  nb::object name = d["name"];
  if (!PyUnicode_Check(name.ptr())) throw Error(ErrorKind::kInvalidArgument, "expert storage: 'name' must be a str");
  s.name = nb::cast<std::string>(name);
  for (auto [key, value] : d) {
    const std::string k = nb::cast<std::string>(nb::str(key));
    if (!kStorageKeys.contains(k))
      throw Error(ErrorKind::kInvalidArgument, fmt::format("expert storage '{}': unknown key '{}'", s.name, k));
  }
  nb::object tensor = d["tensor"];
  WritableTensor w;
  ImportedTensor t;
  try {
    w = import_writable(tensor);
    t = import_tensor(tensor, s.name, /*device_ok=*/false);
  } catch (const Error& e) {
    throw Error(e.kind(), fmt::format("expert storage '{}': {}", s.name, e.what()));
  }
  if (reinterpret_cast<const std::byte*>(w.data) != t.data)
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("expert storage '{}': refit cannot write into this tensor in place", s.name));
  s.dtype = t.info.dtype;
  s.shape = t.info.shape;
  s.data = w.data;
  auto get = [&](const char* key, auto& field) {
    using T = std::remove_reference_t<decltype(field)>;
    if (!d.contains(key)) return;
    try {
      field = nb::cast<T>(nb::object(d[key]));
    } catch (const nb::cast_error&) {
      throw Error(ErrorKind::kInvalidArgument, fmt::format("expert storage '{}': '{}' has the wrong type ({})", s.name,
                                                           key, Py_TYPE(nb::object(d[key]).ptr())->tp_name));
    }
  };
  get("transposed", s.transposed);
  get("loader_inspectable", s.loader_inspectable);
  get("quant_method", s.quant_method);
  get("moe_backend", s.moe_backend);
  get("tp_rank", s.tp_rank);
  get("tp_size", s.tp_size);
  get("use_ep", s.use_ep);
  get("eplb", s.eplb);
  get("num_logical_experts", s.num_logical_experts);
  get("global_num_experts", s.global_num_experts);
  if (d.contains("expert_map") && !nb::object(d["expert_map"]).is_none()) {
    std::vector<int64_t> map;
    get("expert_map", map);
    s.expert_map = std::move(map);
  }
  keep.push_back(std::move(tensor));
  return s;
}

class PyExpertLoader {
 public:
  PyExpertLoader(const ModelInventory& model, nb::handle storage, int destination_rank) {
    std::vector<ExpertStorage> params;
    for (nb::handle spec : storage) params.push_back(storage_of(spec, keep_));
    loader_ = std::make_unique<ExpertLoader>(model, std::move(params), destination_rank);
  }

  // Writes the batch's expert tensors into the storage; returns {"remaining": [(name, tensor)...]
  // (the other tensors, as given), "experts": count, "copies": block copies}.
  nb::dict load(nb::handle batch) {
    std::vector<ImportedTensor> tensors;
    std::vector<nb::object> names, objects;
    for (nb::handle item : batch) {
      if (!PySequence_Check(item.ptr()) || PyUnicode_Check(item.ptr()) || PySequence_Size(item.ptr()) != 2) {
        PyErr_Clear();
        throw Error(ErrorKind::kInvalidArgument,
                    fmt::format("an expert loader's batch must hold (name, tensor) pairs, got a {}",
                                Py_TYPE(item.ptr())->tp_name));
      }
      nb::object name = nb::steal(PySequence_GetItem(item.ptr(), 0));
      nb::object obj = nb::steal(PySequence_GetItem(item.ptr(), 1));
      if (!name.is_valid() || !obj.is_valid()) throw nb::python_error();
      if (!PyUnicode_Check(name.ptr()))
        throw Error(ErrorKind::kInvalidArgument, "an expert loader's batch: a tensor name must be a str");
      tensors.push_back(import_tensor(obj, nb::cast<std::string>(name), /*device_ok=*/false));
      names.push_back(std::move(name));
      objects.push_back(std::move(obj));
    }
    std::vector<TensorView> views;
    views.reserve(tensors.size());
    for (const auto& t : tensors) views.push_back({&t.info, t.data, t.memory});
    ExpertLoadResult result;
    {
      GilRelease nogil;
      result = loader_->load(views);
    }
    // The other tensors, in batch order, as the objects given.
    nb::list remaining;
    for (size_t i = 0, r = 0; i < views.size() && r < result.remaining.size(); ++i) {
      if (result.remaining[r].info != views[i].info) continue;
      remaining.append(nb::make_tuple(names[i], objects[i]));
      ++r;
    }
    nb::dict out;
    out["remaining"] = remaining;
    out["experts"] = result.experts;
    out["copies"] = result.copies;
    return out;
  }

 private:
  std::vector<nb::object> keep_;  // the storage tensors, written in place
  std::unique_ptr<ExpertLoader> loader_;
};

}  // namespace

void register_expert_loader(nb::module_& m) {
  nb::class_<PyExpertLoader>(
      m, "ExpertLoader",
      "The reference's direct copy of received sharded routed experts into a destination's fused expert storage "
      "(w13 [E_local, 2*I/tp, H]: gate into [:, :S], up into [:, S:2S]; w2 [E_local, H, I/tp]: down), with no "
      "loader callback. Call load(batch) with each received batch; the other tensors come back for the model's "
      "own loader.")
      .def(nb::init<const ModelInventory&, nb::handle, int>(), nb::arg("model"), nb::arg("storage"),
           nb::arg("destination_rank") = 0,
           "model: the full model (refit.load_model_inventory), for the experts' unsharded shapes. storage: one dict "
           "per fused parameter, {'name': '<prefix>.routed_experts.w13_weight' or '...w2_weight', 'tensor': a "
           "writable contiguous host tensor (its dtype and shape are the parameter's)}, and as the destination "
           "reports them: tp_rank, tp_size (default 0, 1), use_ep, expert_map (global id -> local slot or -1), "
           "num_logical_experts, global_num_experts, eplb, transposed, loader_inspectable, quant_method, moe_backend "
           "('TRITON'). Raises UnsupportedError / LayoutError for storage refit cannot fill (as the reference's "
           "checks), naming the parameter and the destination rank.")
      .def("load", &PyExpertLoader::load, nb::arg("batch"),
           "Writes the batch's expert tensors (a list of (name, tensor) pairs) into the storage and returns "
           "{'remaining': the other (name, tensor) pairs in order, 'experts': tensors written, 'copies': block "
           "copies}. Every tensor is checked before anything is written: a received expert the storage cannot "
           "place raises LayoutError naming the tensor and the destination rank.")
      .def("__call__", &PyExpertLoader::load, nb::arg("batch"));
}

}  // namespace refit::py
