// Configuration, bucket sizing, memory and GPU queries, model inventories, layouts and logging.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <spdlog/spdlog.h>

#include "common.h"
#include "refit/bucket_size.h"
#include "refit/checkpoint_engine.h"
#include "refit/config_keys.h"
#include "refit/device.h"
#include "refit/dtype.h"
#include "refit/fp8.h"
#include "refit/layout.h"
#include "refit/layout_builders.h"
#include "refit/memory.h"
#include "refit/model.h"
#include "refit/transfer_plan.h"

namespace refit::py {
namespace {

nb::tuple request_tuple(const Request& r) {
  switch (r.take) {
    case Take::kWhole:
      return nb::make_tuple("whole");
    case Take::kDrop:
      return nb::make_tuple("drop");
    case Take::kSlice:
      return nb::make_tuple("narrow", r.slice.dim, r.slice.start, r.slice.length);
  }
  return nb::make_tuple("whole");
}

Take parse_take(const std::string& s, std::string_view what) {
  if (s == "whole") return Take::kWhole;
  if (s == "drop") return Take::kDrop;
  if (s == "narrow") return Take::kSlice;
  throw Error(ErrorKind::kInvalidArgument, fmt::format("{}: expected 'whole', 'drop' or 'narrow', got '{}'", what, s));
}

// "whole" | "drop" | ("whole",) | ("drop",) | ("narrow", dim, start, length)
Request parse_request(nb::handle obj, const std::string& name) {
  const std::string what = fmt::format("layout entry '{}'", name);
  if (nb::isinstance<nb::str>(obj)) {
    Take t = parse_take(nb::cast<std::string>(obj), what);
    if (t == Take::kSlice)
      throw Error(ErrorKind::kInvalidArgument, what + ": 'narrow' needs (\"narrow\", dim, start, length)");
    return t == Take::kDrop ? Request::drop() : Request::whole();
  }
  nb::tuple t = nb::tuple(obj);
  if (t.size() == 0) throw Error(ErrorKind::kInvalidArgument, what + ": empty request");
  Take take = parse_take(nb::cast<std::string>(t[0]), what);
  if (take != Take::kSlice) return take == Take::kDrop ? Request::drop() : Request::whole();
  if (t.size() != 4) throw Error(ErrorKind::kInvalidArgument, what + ": expected (\"narrow\", dim, start, length)");
  return Request::narrow(nb::cast<int32_t>(t[1]), nb::cast<int64_t>(t[2]), nb::cast<int64_t>(t[3]));
}

Layout make_layout(nb::handle tensors, std::vector<std::string> drop_prefixes, const std::string& fallback) {
  Layout layout;
  if (tensors.is_valid() && !tensors.is_none()) {
    for (auto [k, v] : nb::borrow<nb::dict>(tensors)) {
      std::string name = nb::cast<std::string>(k);
      layout.tensors.emplace(name, parse_request(v, name));
    }
  }
  layout.drop_prefixes = std::move(drop_prefixes);
  Take fb = parse_take(fallback, "layout fallback");
  if (fb == Take::kSlice) throw Error(ErrorKind::kInvalidArgument, "layout fallback must be 'whole' or 'drop'");
  layout.fallback = fb;
  return layout;
}

nb::bytes to_bytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

// A config.json's inventory, in its FP8 checkpoint form when `fp8`.
ModelInventory inventory_of(const std::string& config_path, bool fp8) {
  ModelInventory inventory = inventory_from_hf_config(config_path);
  return fp8 ? fp8_block_inventory(inventory) : inventory;
}

}  // namespace

void register_config(nb::module_& m) {
  // ---- configuration ----
  nb::class_<RefitConfig>(
      m, "RefitConfig",
      "The refit configuration (the reference's refit_cfg.nixl keys plus refit's extensions). Build "
      "it with parse_config() or load_config(); it is read-only and picklable.")
      .def(nb::init<>())
      .def_ro("refit_transport", &RefitConfig::refit_transport)
      .def_prop_ro("uses_plugin", &RefitConfig::uses_plugin,
                   "Whether refit_transport is a 'module:ClassName' checkpoint-engine plugin.")
      .def_ro("plugin_params", &RefitConfig::plugin_params,
              "A plugin transport's constructor arguments from its refit_cfg scope, each value as JSON text.")
      .def_ro("update_weights_bucket_memory_ratio", &RefitConfig::update_weights_bucket_memory_ratio)
      .def_prop_ro("device", [](const RefitConfig& c) { return to_string(c.device); })
      .def_ro("backend_name", &RefitConfig::backend_name)
      .def_ro("backend_init_params", &RefitConfig::backend_init_params)
      .def_ro("release_after_refit", &RefitConfig::release_after_refit)
      .def_ro("shard_expert_weights", &RefitConfig::shard_expert_weights)
      .def_ro("bucket_bytes", &RefitConfig::bucket_bytes)
      .def_ro("timeout_s", &RefitConfig::timeout_s)
      .def_ro("verify_checksums", &RefitConfig::verify_checksums)
      .def_ro("map_source_buffers", &RefitConfig::map_source_buffers)
      .def_ro("direct_reads", &RefitConfig::direct_reads)
      .def_prop_ro(
          "delta",
          [](const RefitConfig& c) -> nb::object {
            if (c.delta == DeltaMode::kAuto) return nb::str("auto");
            return nb::bool_(c.delta == DeltaMode::kOn);
          },
          "False, True or 'auto' (refit_cfg.nixl.delta)")
      .def(
          "to_yaml", [](const RefitConfig& c) { return to_yaml(c); }, "YAML that parse_config() reads back.")
      .def("__eq__", [](const RefitConfig& a, const RefitConfig& b) { return a == b; })
      .def("__repr__",
           [](const RefitConfig& c) {
             return fmt::format(
                 "RefitConfig(device='{}', backend_name='{}', ratio={}, bucket_bytes={}, release_after_refit={}, "
                 "timeout_s={})",
                 to_string(c.device), c.backend_name, c.update_weights_bucket_memory_ratio,
                 c.bucket_bytes ? std::to_string(*c.bucket_bytes) : "None", c.release_after_refit ? "True" : "False",
                 c.timeout_s);
           })
      .def("__getstate__", [](const RefitConfig& c) { return to_yaml(c); })
      .def("__setstate__", [](RefitConfig& c, const std::string& yaml) { new (&c) RefitConfig(parse_config(yaml)); });

  m.def(
      "config_keys",
      [] {
        nb::list rows;
        for (const ConfigKey& key : config_keys()) {
          nb::dict row;
          row["scope"] = std::string(to_string(key.scope));
          row["name"] = std::string(key.name);
          row["type"] = std::string(key.type);
          row["default"] = std::string(key.default_value);
          row["backends"] = std::string(key.backends);
          row["extension"] = key.extension;
          row["summary"] = std::string(key.summary);
          rows.append(row);
        }
        return rows;
      },
      "refit's configuration table: every refit_cfg.nixl key (scope 'nixl'), backend init param "
      "('backend_init_params', with the backends that take it) and environment variable ('environment'), "
      "each a dict of scope, name, type, default, backends, extension and summary.");

  m.def(
      "parse_config",
      [](const std::string& text, const std::vector<std::string>& overrides) { return parse_config(text, overrides); },
      nb::arg("yaml_text") = "", nb::arg("overrides") = std::vector<std::string>{},
      "Parses refit YAML (or a NeMo RL config) and applies dotted key=value overrides. Raises ConfigError naming the "
      "key.");
  m.def(
      "load_config",
      [](const std::string& path, const std::vector<std::string>& overrides) { return load_config(path, overrides); },
      nb::arg("path") = "", nb::arg("overrides") = std::vector<std::string>{},
      "Reads a YAML file (empty path: defaults) and applies overrides.");

  // ---- bucket sizing ----
  nb::class_<BucketSize>(m, "BucketSize", "A resolved bucket size (bytes per transfer buffer).")
      .def_ro("bytes", &BucketSize::bytes)
      .def_ro("min_total_memory", &BucketSize::min_total_memory)
      .def_ro("ratio", &BucketSize::ratio)
      .def_ro("uncapped_bytes", &BucketSize::uncapped_bytes)
      .def("__repr__", [](const BucketSize& b) {
        return fmt::format("BucketSize(bytes={}, min_total_memory={}, ratio={}, uncapped_bytes={})", b.bytes,
                           b.min_total_memory, b.ratio, b.uncapped_bytes);
      });
  m.def(
      "resolve_bucket_size",
      [](const RefitConfig& config, const std::vector<uint64_t>& memory, uint64_t model_bytes) {
        return resolve_bucket_size(config, memory, model_bytes);
      },
      nb::arg("config"), nb::arg("worker_total_memory"), nb::arg("model_bytes") = 0,
      "min(worker_total_memory) * ratio floored to whole MiB, no larger than model_bytes rounded up to whole MiB "
      "when given (or config.bucket_bytes); raises ConfigError below 1 MiB.");
  m.def(
      "bucket_size_line",
      [](const BucketSize& size, const RefitConfig& config) { return bucket_size_line(size, config.device); },
      nb::arg("size"), nb::arg("config"), "The reference's '[checkpoint engine] Bucket size: ...' log line.");

  // ---- machine ----
  m.def("total_host_memory_bytes", &total_host_memory_bytes, "Total physical memory of this host.");
  m.def(
      "total_device_memory_bytes",
      [](const std::string& device) {
        Device d = parse_device(device);
        GilRelease nogil;
        return total_device_memory_bytes(d);
      },
      nb::arg("device") = "cpu",
      "Total memory of a transfer device ('cpu': host RAM; 'cuda', 'cuda:N': the GPU's), for bucket sizing.");
  m.def("cuda_built", &cuda_built, "Whether this build of refit has the CUDA data path.");
  m.def(
      "cuda_device_count",
      []() {
        std::string reason;
        int n = cuda_device_count(&reason);
        return nb::make_tuple(n, reason);
      },
      nb::sig("def cuda_device_count() -> tuple[int, str]"), "(number of usable GPUs, reason when 0).");

  // ---- sessions and topology ----
  m.def(
      "new_session_id",
      []() {
        SessionId id = new_session_id();
        return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
      },
      "16 random bytes: give the same one to every engine of a refit group.");
  m.def("source_rank_for_destination", &source_rank_for_destination, nb::arg("rollout_rank"),
        nb::arg("train_world_size"), nb::arg("rollout_world_size"),
        "The source rank that feeds a destination (the reference's pairing); raises TopologyError.");

  // ---- dtypes and models ----
  m.def(
      "dtype_size", [](const std::string& name) { return dtype_size(parse_dtype(name)); }, nb::arg("dtype"));
  m.def(
      "canonical_dtype", [](const std::string& name) { return std::string(dtype_name(parse_dtype(name))); },
      nb::arg("dtype"), "PyTorch's name of a dtype ('BF16' -> 'bfloat16').");

  nb::class_<TensorInfo>(m, "TensorInfo", "A tensor's name, dtype and shape.")
      .def_ro("name", &TensorInfo::name)
      .def_prop_ro("dtype", [](const TensorInfo& t) { return std::string(dtype_name(t.dtype)); })
      .def_prop_ro(
          "shape",
          [](const TensorInfo& t) {
            nb::list l;
            for (int64_t d : t.shape) l.append(d);
            return nb::tuple(l);
          },
          nb::sig("def shape(self) -> tuple[int, ...]"))
      .def_prop_ro("nbytes", &TensorInfo::nbytes)
      .def_prop_ro("numel", &TensorInfo::numel)
      .def("__repr__", [](const TensorInfo& t) {
        return fmt::format("TensorInfo('{}', {}, {})", t.name, dtype_name(t.dtype), shape_string(t.shape));
      });

  nb::class_<ModelInventory>(m, "ModelInventory", "The tensors of a model, in the order a policy streams them.")
      .def_ro("name", &ModelInventory::name)
      .def_ro("tensors", &ModelInventory::tensors)
      .def_prop_ro("total_bytes", &ModelInventory::total_bytes)
      .def_prop_ro("fingerprint", &ModelInventory::fingerprint)
      .def("__len__", [](const ModelInventory& m) { return m.tensors.size(); });
  m.def("load_model_inventory", &load_model_inventory, nb::arg("path"),
        "Tensors of a model from a config.json (or its directory), safetensors files, or a built-in model "
        "('builtin:refit-tiny-moe'); raises ModelError.");
  m.attr("DEFAULT_MODEL") = kDefaultModel;
  m.def("fp8_block_inventory", &fp8_block_inventory, nb::arg("model"),
        "The model as DeepSeek-V3's and Qwen3's FP8 checkpoints hold it: each linear weight float8_e4m3fn followed "
        "by '<name>_scale_inv' (float32, its 128 x 128 block scales); embeddings, lm_head, norms and routers as "
        "they are.");

  // ---- layouts ----
  nb::class_<Layout>(m, "Layout",
                     "What a destination holds of each source tensor: 'whole', 'drop' or ('narrow', dim, start, "
                     "length), by name; names under drop_prefixes are dropped; the rest get `fallback`.")
      .def(
          "__init__",
          [](Layout* self, nb::handle tensors, std::vector<std::string> drop_prefixes, const std::string& fallback) {
            new (self) Layout(make_layout(tensors, std::move(drop_prefixes), fallback));
          },
          nb::arg("tensors") = nb::none(), nb::arg("drop_prefixes") = std::vector<std::string>{},
          nb::arg("fallback") = "whole")
      .def_prop_ro("tensors",
                   [](const Layout& l) {
                     nb::dict d;
                     for (const auto& [name, r] : l.tensors) d[nb::str(name.c_str())] = request_tuple(r);
                     return d;
                   })
      .def_ro("drop_prefixes", &Layout::drop_prefixes)
      .def_prop_ro("fallback",
                   [](const Layout& l) { return std::string(l.fallback == Take::kDrop ? "drop" : "whole"); })
      .def(
          "request_for", [](const Layout& l, const std::string& name) { return request_tuple(l.request_for(name)); },
          nb::arg("name"), "The rule for one tensor name.")
      .def("to_bytes", [](const Layout& l) { return to_bytes(encode_layout(l)); })
      .def_static("from_bytes", [](nb::handle b) { return decode_layout(bytes_of(b, "layout"), "layout"); })
      .def("__eq__", [](const Layout& a, const Layout& b) { return a == b; })
      .def("__getstate__", [](const Layout& l) { return to_bytes(encode_layout(l)); })
      .def("__setstate__",
           [](Layout& l, nb::handle b) { new (&l) Layout(decode_layout(bytes_of(b, "layout"), "layout")); });

  // ---- resharding: what sources hold, and the transfer plan ----
  m.def(
      "dtensor_request",
      [](const std::string& name, std::vector<int64_t> shape, nb::handle placements, std::vector<int> mesh_shape,
         std::vector<int> coordinate) {
        std::vector<Placement> ps;
        for (nb::handle p : placements) {
          // ("shard", dim) or ("replicate",)
          auto t = nb::cast<nb::tuple>(p);
          const std::string kind = nb::cast<std::string>(t[0]);
          if (kind == "shard" && t.size() == 2)
            ps.push_back(Placement::shard_dim(nb::cast<int32_t>(t[1])));
          else if (kind == "replicate" && t.size() == 1)
            ps.push_back(Placement::replicate());
          else
            throw Error(ErrorKind::kLayout,
                        fmt::format("tensor '{}': placement {} is not ('shard', dim) or ('replicate',) (a Partial "
                                    "tensor must be reduced before a refit)",
                                    name, nb::cast<std::string>(nb::repr(p))));
        }
        return request_tuple(dtensor_request(name, shape, ps, mesh_shape, coordinate));
      },
      nb::arg("name"), nb::arg("shape"), nb::arg("placements"), nb::arg("mesh_shape"), nb::arg("coordinate"),
      "What the rank at `coordinate` of a device mesh holds of a DTensor of global `shape` with `placements` "
      "(('shard', dim) or ('replicate',) per mesh dim): ('whole',) or ('narrow', dim, start, length), as torch "
      "shards.");
  m.def(
      "megatron_source_layouts",
      [](const std::string& config_path, int tp, int pp, int dp, int ep, std::optional<int> expert_tp, bool fp8) {
        return megatron_source_layouts(inventory_of(config_path, fp8), model_dims_from_hf_config(config_path),
                                       TrainingParallel{tp, pp, dp, ep, expert_tp});
      },
      nb::arg("config_path"), nb::arg("tp") = 1, nb::arg("pp") = 1, nb::arg("dp") = 1, nb::arg("ep") = 1,
      nb::arg("expert_tp").none() = nb::none(), nb::arg("fp8") = false,
      "Every Megatron rank's holdings (rank = tp_rank + tp * (dp_rank + dp * pp_rank)) for a model's config.json; "
      "fp8: of its FP8 form (fp8_block_inventory), each scale sliced with its weight.");
  // ---- what a destination keeps (its layout: EngineOptions::layout, the `layout=` engine option) ----
  m.def(
      "destination_layout",
      [](const std::string& config_path, int tp_size, int tp_rank, int ep_size, int ep_rank,
         std::vector<int64_t> expert_map, std::optional<int> expert_tp_size, std::optional<int> expert_tp_rank,
         int pp_size, int pp_rank, std::vector<std::string> missing_prefixes, bool shard_experts, bool shard_dense,
         std::optional<int> destination_rank, bool fp8) {
        ModelParallel p;
        p.tp_size = tp_size;
        p.tp_rank = tp_rank;
        p.ep_size = ep_size;
        p.ep_rank = ep_rank;
        p.expert_map = std::move(expert_map);
        p.expert_tp_size = expert_tp_size;
        p.expert_tp_rank = expert_tp_rank;
        p.pp_size = pp_size;
        p.pp_rank = pp_rank;
        p.missing_prefixes = std::move(missing_prefixes);
        p.shard_experts = shard_experts;
        p.shard_dense = shard_dense;
        p.destination_rank = destination_rank.value_or(tp_rank + tp_size * pp_rank);
        return build_layout(inventory_of(config_path, fp8), model_dims_from_hf_config(config_path), p);
      },
      nb::arg("config_path"), nb::kw_only(), nb::arg("tp_size") = 1, nb::arg("tp_rank") = 0, nb::arg("ep_size") = 1,
      nb::arg("ep_rank") = 0, nb::arg("expert_map") = std::vector<int64_t>{},
      nb::arg("expert_tp_size").none() = nb::none(), nb::arg("expert_tp_rank").none() = nb::none(),
      nb::arg("pp_size") = 1, nb::arg("pp_rank") = 0, nb::arg("missing_prefixes") = std::vector<std::string>{},
      nb::arg("shard_experts") = false, nb::arg("shard_dense") = false, nb::arg("destination_rank").none() = nb::none(),
      nb::arg("fp8") = false,
      "A vLLM destination's layout for a model's config.json (fp8: for its FP8 form, fp8_block_inventory, each "
      "scale sliced with its weight): pipeline stages drop other stages' layers; "
      "shard_experts (the reference's shard_expert_weights) keeps the routed experts this rank owns (EP by "
      "linear placement, or vLLM's expert_map), TP-sliced; shard_dense TP-slices dense tensors as vLLM does. "
      "Raises LayoutError naming the rank for sizes that do not divide.");
  m.def(
      "layout_from_compact",
      [](const std::map<std::string, nb::tuple>& expert_params, std::vector<std::string> missing_weight_prefixes,
         const ModelInventory& model, int destination_rank) {
        CompactLayout compact;
        compact.missing_weight_prefixes = std::move(missing_weight_prefixes);
        for (const auto& [name, t] : expert_params) {
          if (t.size() != 3)
            throw Error(
                ErrorKind::kLayout,
                fmt::format("expert_params['{}']: expected (tp_rank, tp_size, local_expert_ids or None)", name));
          ExpertParamLayout e;
          e.tp_rank = nb::cast<int>(t[0]);
          e.tp_size = nb::cast<int>(t[1]);
          if (!t[2].is_none()) e.local_expert_ids = nb::cast<std::vector<int64_t>>(t[2]);
          compact.expert_params[name] = std::move(e);
        }
        return layout_from_compact(compact, model, destination_rank);
      },
      nb::arg("expert_params"), nb::arg("missing_weight_prefixes"), nb::arg("model"), nb::arg("destination_rank"),
      "The reference's compact layout (VllmWeightLayout: per vLLM expert parameter name (tp_rank, tp_size, "
      "local_expert_ids or None for all), and the missing weight prefixes) as a Layout over `model` "
      "(refit.load_model_inventory). Raises LayoutError naming the rank.");
  m.def("fsdp_source_layout", &fsdp_source_layout, nb::arg("model"), nb::arg("world"), nb::arg("rank"),
        "FSDP2's holdings of `rank` of `world`: every tensor Shard(0).");

  nb::class_<TransferPlan>(m, "TransferPlan",
                           "Which bytes each destination reads from which source (refit.plan_transfers).")
      .def_prop_ro("pieces", [](const TransferPlan& p) { return p.pieces().size(); })
      .def_prop_ro(
          "egress", [](const TransferPlan& p) { return p.egress(); }, "Bytes each source sends.")
      .def_prop_ro(
          "ingress", [](const TransferPlan& p) { return p.ingress(); }, "Bytes each destination receives.")
      .def("sources_of", &TransferPlan::sources_of, nb::arg("destination"))
      .def("destinations_of", &TransferPlan::destinations_of, nb::arg("source"));
  m.def(
      "plan_transfers",
      [](const ModelInventory& model, const std::vector<Layout>& sources, const std::vector<Layout>& destinations) {
        GilRelease nogil;
        return plan_transfers(model, sources, destinations);
      },
      nb::arg("model"), nb::arg("sources"), nb::arg("destinations"),
      "The transfer plan from what every source holds to what every destination needs; raises LayoutError for "
      "overlapping holdings or a needed slice no source holds, naming the tensor and the rank.");

  // ---- logging ----
  m.def(
      "set_log_level",
      [](const std::string& level) {
        auto l = spdlog::level::from_str(level);
        if (l == spdlog::level::off && level != "off")
          throw Error(
              ErrorKind::kInvalidArgument,
              fmt::format("log level must be trace, debug, info, warning, error, critical or off, got '{}'", level));
        spdlog::set_level(l);
      },
      nb::arg("level"), "Level of refit's C++ log (spdlog, on stderr).");
  m.def(
      "log",
      [](const std::string& level, const std::string& message) {
        auto l = spdlog::level::from_str(level);
        spdlog::log(l, "{}", message);
      },
      nb::arg("level"), nb::arg("message"), "Writes a line to refit's log, in the same format as the C++ lines.");
}

}  // namespace refit::py
