// The refit configuration: the reference's keys with their names and meaning, in YAML, with
// dotted `key=value` overrides. Parsing validates everything that can be checked without
// peers; each error names the key and the value (Error kind kConfig).
//
//   refit_transport: nixl
//   refit_cfg:
//     nixl:
//       update_weights_bucket_memory_ratio: 0.05
//       device: cpu
//       backend_name: UCX
//       backend_init_params: {ucx_error_handling_mode: peer}
//       release_after_refit: false
//       shard_expert_weights: false
//       bucket_bytes: null        # refit extension
//       timeout_s: 300           # refit extension
//       verify_checksums: false  # refit extension
//       map_source_buffers: true # refit extension
//       direct_reads: true       # refit extension
//       delta: false             # refit extension
//
// The keys may also sit under `policy.generation`, as in a NeMo RL config. Two layouts:
//  * refit layout (no `policy` key at the root): the root holds only refit_transport and
//    refit_cfg; any other root key is an error, so a typo is never silently ignored.
//  * NeMo RL layout (a `policy` key at the root): the file is a whole NeMo RL run config, so
//    every key outside policy.generation (grpo, cluster, ...) and NeMo's own keys inside it
//    (backend, colocated, vllm_cfg, ...) are ignored; `defaults:` is not followed. refit_transport
//    or refit_cfg at the root of such a file is an error (which one would win is unclear).
// In both, refit_cfg holds the `nixl` scope, with only the keys below, and for a plugin transport
// (refit_transport: "module:ClassName", a Python class deriving from refit.CheckpointEngineBase)
// the plugin's scope, refit_cfg["module:ClassName"], which it requires: its
// update_weights_bucket_memory_ratio (0 < r < 1) and release_after_refit take the place of the
// nixl scope's, and every other key goes to the plugin's constructor. An absent refit_transport
// means "nixl"; an explicit null (the reference's default, refit without a checkpoint engine) is
// an error, as is any other transport of the reference (nccl_reshard, vllm_*_sparse).
// Quoted scalars are strings: `release_after_refit: "true"` is rejected, not coerced.
// docs/CONFIG.md lists every key, its validation and the differences from the reference.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace refit {

// Where transfer buffers live: "cpu", "cuda" (current device) or "cuda:N".
// refit_cfg.nixl.delta: false, true or auto.
enum class DeltaMode : uint8_t { kOff = 0, kOn = 1, kAuto = 2 };
std::string_view to_string(DeltaMode mode);

struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = -1;  // -1: the current CUDA device
  bool operator==(const Device&) const = default;
};

// Throws Error(kConfig) naming `key` when `text` is not cpu, cuda or cuda:N.
Device parse_device(std::string_view text, std::string_view key = "device");
std::string to_string(const Device& device);

struct RefitConfig {
  // The checkpoint-engine transport: "nixl" (refit's checkpoint engine; its scope is
  // refit_cfg.nixl) or "module:ClassName" (a Python plugin; the C++ engine and process groups
  // refuse it, refit.WeightSynchronizer creates it).
  std::string refit_transport = "nixl";
  // A plugin transport's scope, but for the two keys it shares with nixl: each value as JSON text
  // (types as YAML read them), for the plugin's constructor.
  std::map<std::string, std::string> plugin_params;
  bool uses_plugin() const { return refit_transport != "nixl"; }
  // Fraction of the smallest worker's total memory used by EACH of the two transfer buffers;
  // strictly between 0 and 0.5, since two buffers must fit (a plugin's: between 0 and 1).
  double update_weights_bucket_memory_ratio = 0.05;
  // Transfer-buffer device. The reference defaults to cuda; refit defaults to cpu so that a
  // machine without a GPU works out of the box.
  Device device;
  // Transport backend: "UCX", "CUDA_IPC" or "NCCL" (any case), checked by create_transport().
  std::string backend_name = "UCX";
  // Passed to the backend, values as strings (the reference converts them with str()).
  std::map<std::string, std::string> backend_init_params;
  // Deregister and free the transfer buffers after every refit; prepare() allocates again.
  bool release_after_refit = false;
  // Send each destination only its expert shards and pipeline stage.
  bool shard_expert_weights = false;
  // refit extension: a fixed bucket size in bytes, instead of the memory ratio.
  std::optional<uint64_t> bucket_bytes;
  // refit extension: the deadline, in seconds, of every wait of one refit phase.
  double timeout_s = 300.0;
  // refit extension: the source sends an xxh3 checksum of every bucket and the destination
  // checks it after reading, so corruption in flight fails the refit (kIntegrity).
  bool verify_checksums = false;
  // refit extension: a destination whose transport can map its source's transfer buffers (shared
  // memory or CUDA IPC on one host) loads straight from them, one copy fewer per byte; the source
  // then refills a buffer only once the destination has loaded it. false: every bucket is read
  // into the destination's own buffer first (the staged path).
  bool map_source_buffers = true;
  // refit extension: a destination loads straight from its source's own tensors wherever it can
  // map them (CUDA IPC; UCX shared memory for weights in memory the source's engine allocated),
  // one copy per byte with no bucket on either side; other tensors still go through buckets.
  // Needs map_source_buffers. false: every tensor goes through a bucket.
  bool direct_reads = true;
  // refit extension: delta refit. A source keeps a copy of what its destination last received and
  // sends, per tensor, only the elements that changed (positions and values, bit-exact), or the
  // tensor whole where that is smaller; the destination keeps the same copy and patches it. A
  // destination that does not hold the source's base (new, restarted, failed refit) gets the whole
  // model. Costs one copy of the link's tensors on each side, where they lie (host or GPU); pays
  // on links slower than the comparison (another host). kAuto: off on a link whose destination
  // maps the source's memory (a full refit there is one copy per byte), elsewhere each refit goes
  // the way (changes or whole) that was faster when last measured. Every topology: a destination
  // with a layout gets its slices as changes, a resharding one the plan's pieces (per link).
  DeltaMode delta = DeltaMode::kOff;

  bool operator==(const RefitConfig&) const = default;
};

// Parses YAML text then applies overrides ("refit_cfg.nixl.device=cpu"; a key without a dot
// prefix that belongs to the nixl scope, such as "device=cpu", is accepted too, and so are the
// prefix "policy.generation.", Hydra's leading "+"/"++" and "backend_init_params.<param>=v").
// An override's value is parsed as YAML ("null" resets bucket_bytes); values are validated
// after all overrides are applied, so an override may fix a bad value in the file. The
// environment variables refit checks are checked here too (REFIT_HOST_COPY_THREADS).
RefitConfig parse_config(std::string_view yaml_text, std::span<const std::string> overrides = {});

// Reads the YAML file (empty path: defaults only) and applies overrides. An error about a key or
// value of the file names the file and the key's line ("f.yaml, line 3: unknown key ...").
RefitConfig load_config(const std::string& yaml_path, std::span<const std::string> overrides = {});

// YAML that parse_config reads back to the same config.
std::string to_yaml(const RefitConfig& config);

// "268435456", "256MiB", "256 MiB", "1GiB": a positive integer with an optional binary (IEC)
// suffix. Throws Error(kConfig) naming `key`.
uint64_t parse_byte_count(std::string_view text, std::string_view key);

}  // namespace refit
