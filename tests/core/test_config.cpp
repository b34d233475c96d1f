#include "refit/config.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "refit/config_keys.h"
#include "refit/error.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// The Error thrown by parse_config; fails the test when nothing or something else is thrown.
Error config_error(const std::string& yaml, std::vector<std::string> overrides = {}) {
  try {
    parse_config(yaml, overrides);
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no refit::Error for:\n" << yaml;
  return Error(ErrorKind::kInternal, "");
}

// A refit-layout config with one refit_cfg.nixl key set.
std::string nixl(const std::string& key_value) {
  return "refit_transport: nixl\nrefit_cfg:\n  nixl:\n    " + key_value + "\n";
}

// Asserts a kConfig error whose message contains every piece.
#define EXPECT_CONFIG_ERROR(call, ...)                                                  \
  do {                                                                                  \
    Error e_ = call;                                                                    \
    EXPECT_EQ(e_.kind(), ErrorKind::kConfig) << e_.what();                              \
    for (const std::string& piece_ : std::initializer_list<std::string>{__VA_ARGS__}) { \
      EXPECT_THAT(e_.what(), HasSubstr(piece_));                                        \
    }                                                                                   \
  } while (0)

TEST(Config, DefaultsFromEmptyText) {
  for (const char* text : {"", "# only a comment\n", "~"}) {
    RefitConfig c = parse_config(text);
    EXPECT_EQ(c, RefitConfig{}) << text;
    EXPECT_EQ(c.refit_transport, "nixl");
    EXPECT_DOUBLE_EQ(c.update_weights_bucket_memory_ratio, 0.05);
    EXPECT_EQ(c.device, (Device{Device::Kind::kCpu, -1}));
    EXPECT_EQ(c.backend_name, "UCX");
    EXPECT_TRUE(c.backend_init_params.empty());
    EXPECT_FALSE(c.release_after_refit);
    EXPECT_FALSE(c.shard_expert_weights);
    EXPECT_FALSE(c.bucket_bytes.has_value());
    EXPECT_DOUBLE_EQ(c.timeout_s, 300.0);
    EXPECT_FALSE(c.verify_checksums);
    EXPECT_TRUE(c.map_source_buffers);
    EXPECT_TRUE(c.direct_reads);
  }
  EXPECT_EQ(load_config(""), RefitConfig{});
  EXPECT_EQ(parse_config("refit_cfg: null"), RefitConfig{});
  EXPECT_EQ(parse_config("refit_cfg:\n  nixl: null"), RefitConfig{});
}

TEST(Config, DeltaIsTrueFalseOrAuto) {
  EXPECT_EQ(parse_config(nixl("delta: auto")).delta, DeltaMode::kAuto);
  EXPECT_EQ(parse_config(nixl("delta: \"auto\"")).delta, DeltaMode::kAuto);  // from JSON
  EXPECT_EQ(parse_config(nixl("delta: true")).delta, DeltaMode::kOn);
  EXPECT_EQ(parse_config(nixl("delta: false")).delta, DeltaMode::kOff);
  EXPECT_EQ(parse_config("").delta, DeltaMode::kOff);
  RefitConfig c;
  c.delta = DeltaMode::kAuto;
  EXPECT_EQ(parse_config(to_yaml(c)).delta, DeltaMode::kAuto);
  EXPECT_CONFIG_ERROR(config_error(nixl("delta: sometimes")), "refit_cfg.nixl.delta", "true, false or auto",
                      "sometimes");
}

TEST(Config, FullRefitLayout) {
  RefitConfig c = parse_config(R"(
refit_transport: nixl
refit_cfg:
  nixl:
    update_weights_bucket_memory_ratio: 0.1
    device: cuda:3
    backend_name: UCX
    backend_init_params:
      ucx_error_handling_mode: peer
      engine_config: "MAX_RMA_RAILS=8;UCX_TLS=rc"
      device_list: mlx5_0,mlx5_1
      num_threads: 8
      progress: true
    release_after_refit: true
    shard_expert_weights: true
    bucket_bytes: 256MiB
    timeout_s: 12.5
)");
  EXPECT_DOUBLE_EQ(c.update_weights_bucket_memory_ratio, 0.1);
  EXPECT_EQ(c.device, (Device{Device::Kind::kCuda, 3}));
  EXPECT_EQ(c.backend_name, "UCX");
  std::map<std::string, std::string> params = {{"ucx_error_handling_mode", "peer"},
                                               {"engine_config", "MAX_RMA_RAILS=8;UCX_TLS=rc"},
                                               {"device_list", "mlx5_0,mlx5_1"},
                                               {"num_threads", "8"},
                                               {"progress", "true"}};
  EXPECT_EQ(c.backend_init_params, params);
  EXPECT_TRUE(c.release_after_refit);
  EXPECT_TRUE(c.shard_expert_weights);
  EXPECT_EQ(c.bucket_bytes, 256u << 20);
  EXPECT_DOUBLE_EQ(c.timeout_s, 12.5);
}

TEST(Config, NemoLayoutIgnoresNemoKeys) {
  RefitConfig c = parse_config(R"(
defaults: grpo_math_8B_megatron.yaml
grpo: {num_prompts_per_step: 32}
cluster: {num_nodes: 2}
policy:
  model_name: meta-llama/Llama-3.1-8B
  generation:
    backend: vllm
    colocated:
      enabled: false
    vllm_cfg: {tensor_parallel_size: 8}
    vllm_kwargs: {moe_backend: triton}
    checkpoint_engine: null
    refit_transport: nixl
    refit_cfg:
      nixl:
        update_weights_bucket_memory_ratio: 0.05
        device: cuda
        release_after_refit: false
        backend_name: UCX
        backend_init_params:
          engine_config: MAX_RMA_RAILS=8
)");
  EXPECT_EQ(c.device, (Device{Device::Kind::kCuda, -1}));
  EXPECT_EQ(c.backend_init_params.at("engine_config"), "MAX_RMA_RAILS=8");
  // Without refit keys, a NeMo config gives the defaults.
  EXPECT_EQ(parse_config("policy:\n  generation:\n    backend: vllm\n"), RefitConfig{});
}

TEST(Config, NemoLayoutErrorsNameTheFullKey) {
  EXPECT_CONFIG_ERROR(config_error("policy:\n  generation:\n    refit_cfg:\n      nixl:\n        device: gpu\n"),
                      "policy.generation.refit_cfg.nixl.device", "'gpu'");
  EXPECT_CONFIG_ERROR(config_error("policy:\n  generation:\n    refit_cfg:\n      nixl:\n        bucket_size: 5\n"),
                      "policy.generation.refit_cfg.nixl.bucket_size");
  EXPECT_CONFIG_ERROR(config_error("policy:\n  generation:\n    refit_transport: null\n"),
                      "policy.generation.refit_transport", "null");
}

TEST(Config, NemoLayoutStructure) {
  EXPECT_CONFIG_ERROR(config_error("policy:\n  model_name: x\n"), "policy.generation");
  EXPECT_CONFIG_ERROR(config_error("policy:\n  generation: 3\n"), "policy.generation", "'3'");
  EXPECT_CONFIG_ERROR(config_error("refit_transport: nixl\npolicy:\n  generation: {}\n"), "refit_transport",
                      "policy.generation");
  // V1 of the reference.
  EXPECT_CONFIG_ERROR(config_error("policy:\n  generation:\n    checkpoint_engine: {enabled: true}\n"),
                      "policy.generation.checkpoint_engine was replaced by policy.generation.refit_transport='nixl'");
}

TEST(Config, UnknownKeys) {
  EXPECT_CONFIG_ERROR(config_error("refit_transprt: nixl\n"), "unknown key 'refit_transprt'", "<config text>");
  EXPECT_CONFIG_ERROR(config_error(nixl("bucket_size: 5")), "refit_cfg.nixl.bucket_size",
                      "update_weights_bucket_memory_ratio, device, backend_name, backend_init_params",
                      "bucket_bytes, timeout_s");
  EXPECT_CONFIG_ERROR(config_error("refit_cfg:\n  foo: {a: 1}\n"), "refit_cfg.foo", "nixl");
  EXPECT_CONFIG_ERROR(config_error("refit_cfg:\n  'mod:Cls': {a: 1}\n"),
                      "refit_cfg has the plugin scope 'mod:Cls' but refit_transport is 'nixl'");
  EXPECT_CONFIG_ERROR(config_error("refit_cfg:\n  nixl:\n    device: cpu\n    device: cuda\n"),
                      "duplicate key refit_cfg.nixl.device");
}

TEST(Config, Structure) {
  EXPECT_CONFIG_ERROR(config_error("- a\n- b\n"), "root must be a mapping");
  EXPECT_CONFIG_ERROR(config_error("refit_cfg: [1]\n"), "refit_cfg must be a mapping", "a list");
  EXPECT_CONFIG_ERROR(config_error("refit_cfg:\n  nixl: 5\n"), "refit_cfg.nixl must be a mapping", "'5'");
}

TEST(Config, Transport) {
  EXPECT_EQ(parse_config("refit_transport: nixl").refit_transport, "nixl");
  EXPECT_EQ(parse_config("refit_cfg: {nixl: {device: cpu}}").refit_transport, "nixl");  // absent: nixl
  EXPECT_CONFIG_ERROR(config_error("refit_transport: null\n"), "refit_transport is null", "nixl");
  EXPECT_CONFIG_ERROR(config_error("refit_transport:\n"), "refit_transport is null");
  for (const char* t : {"nccl_reshard", "vllm_s3_sparse", "vllm_zmq_sparse"}) {
    EXPECT_CONFIG_ERROR(config_error(std::string("refit_transport: '") + t + "'\n"), t, "refit does not implement");
  }
  for (const char* t : {":Engine", "my.module:", "a:b:c"}) {
    EXPECT_CONFIG_ERROR(config_error(std::string("refit_transport: '") + t + "'\n"), t,
                        "'module:ClassName' with both parts non-empty");
  }
  EXPECT_CONFIG_ERROR(config_error("refit_transport: nixl2\n"), "Unknown refit transport 'nixl2': expected 'nixl'");
  EXPECT_CONFIG_ERROR(config_error("refit_transport: NIXL\n"), "Unknown refit transport 'NIXL'");
  EXPECT_CONFIG_ERROR(config_error("refit_transport: [nixl]\n"), "refit_transport must be a string", "a list");
}

// The reference's plugin transport: refit_cfg["module:ClassName"] holds the ratio and
// release_after_refit (in place of the nixl scope's) and whatever else the plugin's constructor
// takes, with the types YAML gives them.
TEST(Config, PluginTransportAndItsScope) {
  const RefitConfig c = parse_config(R"(
refit_transport: "my.engines:LoopbackEngine"
refit_cfg:
  nixl: {device: cpu, update_weights_bucket_memory_ratio: 0.1}
  "my.engines:LoopbackEngine":
    update_weights_bucket_memory_ratio: 0.7
    release_after_refit: true
    rails: 8
    scale: 0.5
    name: fast
    quoted: "true"
    hosts: [a, b]
    nothing: null
)");
  EXPECT_TRUE(c.uses_plugin());
  EXPECT_EQ(c.refit_transport, "my.engines:LoopbackEngine");
  EXPECT_DOUBLE_EQ(c.update_weights_bucket_memory_ratio, 0.7);
  EXPECT_TRUE(c.release_after_refit);
  const std::map<std::string, std::string> params = {
      {"rails", "8"},         {"scale", "0.5"},          {"name", "\"fast\""},
      {"quoted", "\"true\""}, {"hosts", R"(["a","b"])"}, {"nothing", "null"}};
  EXPECT_EQ(c.plugin_params, params);
  EXPECT_EQ(parse_config(to_yaml(c)), c);  // written and read back with the same types

  // An empty scope: the reference's defaults.
  const RefitConfig d = parse_config("refit_transport: 'm:C'\nrefit_cfg: {'m:C': {}}\n");
  EXPECT_DOUBLE_EQ(d.update_weights_bucket_memory_ratio, 0.05);
  EXPECT_FALSE(d.release_after_refit);
  EXPECT_TRUE(d.plugin_params.empty());
  EXPECT_FALSE(parse_config("").uses_plugin());

  EXPECT_CONFIG_ERROR(config_error("refit_transport: 'm:C'\n"), "refit_transport 'm:C' needs its scope",
                      "refit_cfg['m:C']");
  EXPECT_CONFIG_ERROR(config_error("refit_transport: 'm:C'\nrefit_cfg: {'m:D': {}}\n"),
                      "plugin scope 'm:D' but refit_transport is 'm:C'");
  EXPECT_CONFIG_ERROR(config_error("refit_cfg: {'m:D': {}}\n"), "plugin scope 'm:D' but refit_transport is 'nixl'");
  EXPECT_CONFIG_ERROR(
      config_error("refit_transport: 'm:C'\nrefit_cfg: {'m:C': {update_weights_bucket_memory_ratio: 1}}\n"),
      "refit_cfg['m:C'].update_weights_bucket_memory_ratio must be > 0 and < 1");
  EXPECT_CONFIG_ERROR(config_error("refit_transport: 'm:C'\nrefit_cfg: {'m:C': {release_after_refit: 'yes'}}\n"),
                      "refit_cfg['m:C'].release_after_refit must be true or false");
  EXPECT_CONFIG_ERROR(config_error("refit_transport: 'm:C'\nrefit_cfg: {'m:C': [1]}\n"),
                      "refit_cfg['m:C'] must be a mapping");
  EXPECT_CONFIG_ERROR(config_error("refit_transport: 'm:C'\nrefit_cfg: {'m:C': {}, 'm:D': {}}\n"), "two plugin scopes");
  // NeMo RL layout: the same, under policy.generation.
  EXPECT_EQ(parse_config("policy:\n  generation:\n    refit_transport: 'm:C'\n    refit_cfg: {'m:C': {x: 1}}\n")
                .plugin_params.at("x"),
            "1");
}

TEST(Config, Ratio) {
  EXPECT_DOUBLE_EQ(parse_config(nixl("update_weights_bucket_memory_ratio: 0.25")).update_weights_bucket_memory_ratio,
                   0.25);
  EXPECT_DOUBLE_EQ(parse_config(nixl("update_weights_bucket_memory_ratio: 1e-3")).update_weights_bucket_memory_ratio,
                   1e-3);
  EXPECT_DOUBLE_EQ(parse_config(nixl("update_weights_bucket_memory_ratio: 0.4999")).update_weights_bucket_memory_ratio,
                   0.4999);
  // 0.5 and 0.6 are accepted by the reference, but two buffers of that size cannot fit.
  for (const char* bad : {"0", "-0.1", "0.5", "0.6", "1", "1.5", ".nan", ".inf", "-.inf"}) {
    EXPECT_CONFIG_ERROR(config_error(nixl(std::string("update_weights_bucket_memory_ratio: ") + bad)),
                        "refit_cfg.nixl.update_weights_bucket_memory_ratio", "< 0.5", std::string("'") + bad + "'");
  }
  for (const char* bad : {"abc", "'0.05'", "true", "[0.05]", "null"}) {
    EXPECT_CONFIG_ERROR(config_error(nixl(std::string("update_weights_bucket_memory_ratio: ") + bad)),
                        "refit_cfg.nixl.update_weights_bucket_memory_ratio must be a number");
  }
}

TEST(Config, Device) {
  EXPECT_EQ(parse_config(nixl("device: cpu")).device, (Device{Device::Kind::kCpu, -1}));
  EXPECT_EQ(parse_config(nixl("device: cuda")).device, (Device{Device::Kind::kCuda, -1}));
  EXPECT_EQ(parse_config(nixl("device: cuda:0")).device, (Device{Device::Kind::kCuda, 0}));
  EXPECT_EQ(parse_config(nixl("device: 'cuda:12'")).device, (Device{Device::Kind::kCuda, 12}));
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:+1", "cuda:1x", "CUDA", "cuda:99999999999", "cpu:0"}) {
    EXPECT_CONFIG_ERROR(config_error(nixl(std::string("device: '") + bad + "'")), "refit_cfg.nixl.device",
                        std::string("'") + bad + "'", "cpu, cuda or cuda:N");
  }
  EXPECT_CONFIG_ERROR(config_error(nixl("device: null")), "refit_cfg.nixl.device", "null");
}

TEST(Config, ParseDeviceDirect) {
  EXPECT_EQ(parse_device("cuda:7"), (Device{Device::Kind::kCuda, 7}));
  EXPECT_EQ(to_string(Device{}), "cpu");
  EXPECT_EQ(to_string(Device{Device::Kind::kCuda, -1}), "cuda");
  EXPECT_EQ(to_string(Device{Device::Kind::kCuda, 2}), "cuda:2");
  for (const char* text : {"cpu", "cuda", "cuda:0", "cuda:15"}) EXPECT_EQ(to_string(parse_device(text)), text);
  try {
    parse_device("tpu", "--device");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_THAT(e.what(), AllOf(HasSubstr("--device"), HasSubstr("'tpu'")));
  }
}

TEST(Config, BackendName) {
  EXPECT_EQ(parse_config(nixl("backend_name: LIBFABRIC")).backend_name, "LIBFABRIC");
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_name: ''")), "refit_cfg.nixl.backend_name", "non-empty");
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_name: null")), "refit_cfg.nixl.backend_name", "null");
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_name: {a: 1}")), "refit_cfg.nixl.backend_name", "a mapping");
}

TEST(Config, BackendInitParams) {
  EXPECT_TRUE(parse_config(nixl("backend_init_params: null")).backend_init_params.empty());
  EXPECT_TRUE(parse_config(nixl("backend_init_params: {}")).backend_init_params.empty());
  auto p = parse_config(nixl("backend_init_params: {a: 8, b: true, c: 1.5, d: 'x y'}")).backend_init_params;
  EXPECT_EQ(p, (std::map<std::string, std::string>{{"a", "8"}, {"b", "true"}, {"c", "1.5"}, {"d", "x y"}}));
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_init_params: {a: {b: 1}}")), "refit_cfg.nixl.backend_init_params.a",
                      "a mapping");
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_init_params: {a: [1, 2]}")), "refit_cfg.nixl.backend_init_params.a",
                      "a list");
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_init_params: {a: null}")), "refit_cfg.nixl.backend_init_params.a",
                      "null");
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_init_params: peer")), "refit_cfg.nixl.backend_init_params", "'peer'");
  EXPECT_CONFIG_ERROR(config_error(nixl("backend_init_params: [a]")), "refit_cfg.nixl.backend_init_params", "a list");
}

TEST(Config, Bools) {
  EXPECT_TRUE(parse_config(nixl("release_after_refit: true")).release_after_refit);
  EXPECT_TRUE(parse_config(nixl("release_after_refit: True")).release_after_refit);
  EXPECT_FALSE(parse_config(nixl("release_after_refit: false")).release_after_refit);
  EXPECT_TRUE(parse_config(nixl("shard_expert_weights: true")).shard_expert_weights);
  EXPECT_FALSE(parse_config(nixl("map_source_buffers: false")).map_source_buffers);
  EXPECT_FALSE(parse_config(nixl("direct_reads: false")).direct_reads);
  for (const char* key :
       {"release_after_refit", "shard_expert_weights", "verify_checksums", "map_source_buffers", "direct_reads"}) {
    for (const char* bad : {"maybe", "'true'", "1", "null", "[true]"}) {
      EXPECT_CONFIG_ERROR(config_error(nixl(std::string(key) + ": " + bad)), std::string("refit_cfg.nixl.") + key,
                          "true or false");
    }
    EXPECT_CONFIG_ERROR(config_error(nixl(std::string(key) + ": maybe")), "'maybe'");
    EXPECT_CONFIG_ERROR(config_error(nixl(std::string(key) + ": \"true\"")), "'true' (a quoted string");
  }
}

TEST(Config, BucketBytes) {
  auto bytes = [](const std::string& v) { return parse_config(nixl("bucket_bytes: " + v)).bucket_bytes; };
  EXPECT_EQ(bytes("null"), std::nullopt);
  EXPECT_EQ(bytes("17"), 17u);
  EXPECT_EQ(bytes("268435456"), 268435456u);
  EXPECT_EQ(bytes("'268435456'"), 268435456u);
  EXPECT_EQ(bytes("64KiB"), 64u << 10);
  EXPECT_EQ(bytes("256MiB"), 256u << 20);
  EXPECT_EQ(bytes("256 MiB"), 256u << 20);
  EXPECT_EQ(bytes("1GiB"), 1u << 30);
  EXPECT_EQ(bytes("2TiB"), uint64_t{2} << 40);
  EXPECT_EQ(bytes("100B"), 100u);
  for (const char* bad :
       {"0", "-5", "1.5GiB", "256MB", "256mib", "GiB", "abc", "1e9", "99999999999TiB", "18446744073709551616"}) {
    EXPECT_CONFIG_ERROR(config_error(nixl(std::string("bucket_bytes: ") + bad)), "refit_cfg.nixl.bucket_bytes",
                        std::string("'") + bad + "'", "positive byte count");
  }
  EXPECT_CONFIG_ERROR(config_error(nixl("bucket_bytes: [1]")), "refit_cfg.nixl.bucket_bytes", "a list");
}

TEST(Config, Timeout) {
  EXPECT_DOUBLE_EQ(parse_config(nixl("timeout_s: 5")).timeout_s, 5.0);
  EXPECT_DOUBLE_EQ(parse_config(nixl("timeout_s: 0.25")).timeout_s, 0.25);
  for (const char* bad : {"0", "-1", ".inf", ".nan"}) {
    EXPECT_CONFIG_ERROR(config_error(nixl(std::string("timeout_s: ") + bad)), "refit_cfg.nixl.timeout_s",
                        std::string("'") + bad + "'", "positive finite");
  }
  EXPECT_CONFIG_ERROR(config_error(nixl("timeout_s: soon")), "refit_cfg.nixl.timeout_s", "must be a number", "'soon'");
}

TEST(Config, OverridesOfEveryKey) {
  std::vector<std::string> overrides = {
      "refit_cfg.nixl.update_weights_bucket_memory_ratio=0.2",
      "device=cuda:1",
      "policy.generation.refit_cfg.nixl.backend_name=LIBFABRIC",
      "refit_cfg.nixl.backend_init_params.ucx_error_handling_mode=peer",
      "backend_init_params.device_list=mlx5_0,mlx5_1",
      "release_after_refit=true",
      "++refit_cfg.nixl.shard_expert_weights=true",
      "bucket_bytes=1GiB",
      "timeout_s=30",
      "refit_transport=nixl",
      "verify_checksums=true",
      "refit_cfg.nixl.map_source_buffers=false",
      "direct_reads=false",
  };
  RefitConfig c = parse_config("", overrides);
  EXPECT_DOUBLE_EQ(c.update_weights_bucket_memory_ratio, 0.2);
  EXPECT_EQ(c.device, (Device{Device::Kind::kCuda, 1}));
  EXPECT_EQ(c.backend_name, "LIBFABRIC");
  EXPECT_EQ(c.backend_init_params, (std::map<std::string, std::string>{{"ucx_error_handling_mode", "peer"},
                                                                       {"device_list", "mlx5_0,mlx5_1"}}));
  EXPECT_TRUE(c.release_after_refit);
  EXPECT_TRUE(c.shard_expert_weights);
  EXPECT_EQ(c.bucket_bytes, 1u << 30);
  EXPECT_DOUBLE_EQ(c.timeout_s, 30.0);
  EXPECT_TRUE(c.verify_checksums);
  EXPECT_FALSE(c.map_source_buffers);
  EXPECT_FALSE(c.direct_reads);
}

TEST(Config, OverridesReplaceFileValues) {
  const std::string file = nixl("bucket_bytes: 64MiB\n    backend_init_params: {a: '1', b: '2'}\n    device: gpu");
  std::vector<std::string> overrides = {"bucket_bytes=null", "backend_init_params.b=3", "device=cpu"};
  RefitConfig c = parse_config(file, overrides);
  EXPECT_EQ(c.bucket_bytes, std::nullopt);
  EXPECT_EQ(c.backend_init_params, (std::map<std::string, std::string>{{"a", "1"}, {"b", "3"}}));
  EXPECT_EQ(c.device.kind, Device::Kind::kCpu);  // the override fixed the file's bad device
  std::vector<std::string> reset = {"device=cpu", "backend_init_params=null"};
  EXPECT_TRUE(parse_config(file, reset).backend_init_params.empty());
  // A whole mapping as a value; the last override wins.
  std::vector<std::string> map = {"backend_init_params={x: 1}", "device=cuda", "device=cuda:2"};
  RefitConfig m = parse_config("", map);
  EXPECT_EQ(m.backend_init_params, (std::map<std::string, std::string>{{"x", "1"}}));
  EXPECT_EQ(m.device, (Device{Device::Kind::kCuda, 2}));
  // Overrides apply to the NeMo layout too.
  std::vector<std::string> nemo = {"policy.generation.refit_transport=nixl"};
  EXPECT_EQ(parse_config("policy:\n  generation:\n    refit_transport: null\n", nemo).refit_transport, "nixl");
}

TEST(Config, OverrideErrors) {
  EXPECT_CONFIG_ERROR(config_error("", {"device"}), "override 'device'", "=");
  EXPECT_CONFIG_ERROR(config_error("", {"refit_cfg.nixl.bucket_size=5"}), "override 'refit_cfg.nixl.bucket_size=5'",
                      "unknown key");
  EXPECT_CONFIG_ERROR(config_error("", {"foo=1"}), "override 'foo=1'");
  EXPECT_CONFIG_ERROR(config_error("", {"refit_cfg.nixl.refit_transport=nixl"}),
                      "override 'refit_cfg.nixl.refit_transport=nixl'");
  EXPECT_CONFIG_ERROR(config_error("", {"backend_init_params.=1"}), "override 'backend_init_params.=1'");
  EXPECT_CONFIG_ERROR(config_error("", {"device=[cuda"}), "override 'device=[cuda'", "not valid YAML");
  // Values are checked like file values, naming the key and the value.
  EXPECT_CONFIG_ERROR(config_error("", {"release_after_refit=yes please"}), "refit_cfg.nixl.release_after_refit",
                      "'yes please'");
  EXPECT_CONFIG_ERROR(config_error("", {"update_weights_bucket_memory_ratio=0.7"}),
                      "refit_cfg.nixl.update_weights_bucket_memory_ratio", "'0.7'");
  EXPECT_CONFIG_ERROR(config_error("", {"device="}), "refit_cfg.nixl.device", "null");
  EXPECT_CONFIG_ERROR(config_error("", {"refit_transport=null"}), "refit_transport is null");
  EXPECT_CONFIG_ERROR(config_error("", {"backend_init_params.a={b: 1}"}), "refit_cfg.nixl.backend_init_params.a");
}

TEST(Config, RoundTrip) {
  RefitConfig c;
  c.update_weights_bucket_memory_ratio = 0.123456789;
  c.device = {Device::Kind::kCuda, 5};
  c.backend_name = "null";  // would read back as null if written plain
  c.backend_init_params = {
      {"engine_config", "MAX_RMA_RAILS=8;UCX_TLS=rc"}, {"n", "8"}, {"quote", "a \"b\": c"}, {"empty", ""}};
  c.release_after_refit = true;
  c.shard_expert_weights = true;
  c.bucket_bytes = 17;
  c.timeout_s = 0.1;
  c.verify_checksums = true;
  c.map_source_buffers = false;
  c.direct_reads = false;
  const std::string yaml = to_yaml(c);
  EXPECT_EQ(parse_config(yaml), c) << yaml;
  EXPECT_EQ(parse_config(to_yaml(RefitConfig{})), RefitConfig{});
  EXPECT_THAT(to_yaml(RefitConfig{}),
              AllOf(HasSubstr("refit_transport: nixl"), HasSubstr("update_weights_bucket_memory_ratio: 0.05"),
                    HasSubstr("device: cpu"), HasSubstr("bucket_bytes: null"), HasSubstr("timeout_s: 300")));
}

TEST(Config, MalformedYaml) {
  EXPECT_CONFIG_ERROR(config_error("refit_transport: nixl\nrefit_cfg:\n  nixl: [unclosed\n"), "<config text>",
                      "invalid YAML", "line ");
  Error e = config_error("refit_transport: nixl\nrefit_cfg:\n  nixl:\n    device: cpu\n   timeout_s: 1\n");
  EXPECT_THAT(e.what(), HasSubstr("line 5"));
  Error tab = config_error("refit_cfg:\n\tnixl: {}\n");
  EXPECT_THAT(tab.what(), HasSubstr("line 2"));
}

class ConfigFile : public ::testing::Test {
 protected:
  std::filesystem::path path_ =
      std::filesystem::temp_directory_path() /
      ("refit_test_config_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".yaml");
  void write(const std::string& text) { std::ofstream(path_) << text; }
  void TearDown() override { std::filesystem::remove(path_); }
};

TEST_F(ConfigFile, LoadsWithOverrides) {
  write(nixl("device: cuda:2\n    bucket_bytes: 64KiB"));
  std::vector<std::string> overrides = {"timeout_s=7"};
  RefitConfig c = load_config(path_.string(), overrides);
  EXPECT_EQ(c.device, (Device{Device::Kind::kCuda, 2}));
  EXPECT_EQ(c.bucket_bytes, 64u << 10);
  EXPECT_DOUBLE_EQ(c.timeout_s, 7.0);
  std::vector<std::string> bad = {"nope=1"};
  EXPECT_THROW(load_config("", bad), Error);
}

TEST_F(ConfigFile, MalformedNamesFileAndLine) {
  write("refit_transport: nixl\nrefit_cfg:\n  nixl: {device: cpu\n");
  try {
    load_config(path_.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_THAT(e.what(), AllOf(HasSubstr(path_.string()), HasSubstr("line "), HasSubstr("column ")));
  }
}

TEST_F(ConfigFile, UnknownRootKeyNamesFile) {
  write("refit_transport: nixl\nfoo: 1\n");
  try {
    load_config(path_.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(path_.string()), HasSubstr("'foo'")));
  }
}

// An error about a key or value of a file names the file and the key's line; the same value from
// an override names no file.
TEST_F(ConfigFile, UnknownKeysAndBadValuesNameTheFileAndTheKeysLine) {
  auto error_at = [&](const std::string& text, std::vector<std::string> overrides = {}) {
    write(text);
    try {
      load_config(path_.string(), overrides);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
      return std::string(e.what());
    }
    ADD_FAILURE() << "no refit::Error for:\n" << text;
    return std::string();
  };
  const std::string file = path_.string();
  EXPECT_THAT(error_at(nixl("device: cpu\n    bucket_byte: 1MiB")),
              AllOf(HasSubstr(file + ", line 5: unknown key refit_cfg.nixl.bucket_byte: valid keys are"),
                    HasSubstr("bucket_bytes")));
  EXPECT_THAT(error_at("refit_transport: nixl\nrefit_cfg:\n  nixl:\n    timeout_s:\n    device: cpu\n"),
              HasSubstr(file + ", line 4: refit_cfg.nixl.timeout_s must be a number, got null"));
  EXPECT_THAT(error_at(nixl("backend_init_params:\n      tls: [tcp]")),
              HasSubstr(file + ", line 4: refit_cfg.nixl.backend_init_params.tls must be a string"));
  EXPECT_THAT(error_at("refit_transport: carrier_pigeon\n"), HasSubstr(file + ", line 1: Unknown refit transport"));
  EXPECT_THAT(error_at("refit_transport: nixl\nfoo: 1\n"), HasSubstr(file + ", line 2: unknown key 'foo'"));
  EXPECT_THAT(error_at("refit_cfg:\n  nixl: {}\n  nixel: {}\n"),
              HasSubstr(file + ", line 3: unknown key refit_cfg.nixel"));
  EXPECT_THAT(error_at("policy:\n  generation:\n    refit_cfg:\n      nixl:\n        bucket_size: 5\n"),
              HasSubstr(file + ", line 5: unknown key policy.generation.refit_cfg.nixl.bucket_size"));
  EXPECT_THAT(error_at("refit_transport: 'm:C'\nrefit_cfg:\n  'm:C':\n    x: 1\n    release_after_refit: 2\n"),
              HasSubstr(file + ", line 5: refit_cfg['m:C'].release_after_refit must be true or false"));
  // The value that fails is the override's: the file is not to blame.
  const std::string overridden = error_at(nixl("timeout_s: 5"), {"timeout_s=soon"});
  EXPECT_THAT(overridden, HasSubstr("refit_cfg.nixl.timeout_s must be a number, got 'soon'"));
  EXPECT_THAT(overridden, ::testing::Not(HasSubstr(file)));
}

// REFIT_HOST_COPY_THREADS is refused where the configuration is read, at start, not at the first
// large copy of a refit.
TEST(ConfigEnvironment, ABadHostCopyThreadCountIsRefusedWithTheConfig) {
  const char* before = std::getenv("REFIT_HOST_COPY_THREADS");
  const std::optional<std::string> saved = before ? std::optional<std::string>(before) : std::nullopt;
  setenv("REFIT_HOST_COPY_THREADS", "100", 1);
  EXPECT_CONFIG_ERROR(config_error(""), "REFIT_HOST_COPY_THREADS='100'", "from 0 to 64");
  EXPECT_THROW(load_config(""), Error);
  setenv("REFIT_HOST_COPY_THREADS", "4", 1);
  EXPECT_NO_THROW(parse_config(""));
  if (saved)
    setenv("REFIT_HOST_COPY_THREADS", saved->c_str(), 1);
  else
    unsetenv("REFIT_HOST_COPY_THREADS");
}

TEST(ConfigLoad, MissingFileNamesPath) {
  const std::string path = "/nonexistent/refit/config.yaml";
  try {
    load_config(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
  EXPECT_THROW(load_config(std::filesystem::temp_directory_path().string()), Error);  // a directory
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// The configuration table's nixl rows are the parser's keys: to_yaml writes exactly them, in
// their order, with their defaults; every one is accepted in a file and as an override; any other
// name is refused, and the refusal lists the table's keys.
TEST(ConfigTable, TheNixlRowsAreWhatTheParserReadsAndWrites) {
  std::vector<std::string> written;
  std::map<std::string, std::string> defaults;
  const std::string yaml = to_yaml(RefitConfig{});
  std::istringstream lines(yaml.substr(yaml.find("  nixl:\n") + 8));
  for (std::string line; std::getline(lines, line) && line.starts_with("    ");) {
    const size_t colon = line.find(':');
    written.push_back(line.substr(4, colon - 4));
    std::string value = line.substr(colon + 2);
    if (value.size() >= 2 && value.front() == '"') value = value.substr(1, value.size() - 2);
    defaults[written.back()] = value;
  }
  std::vector<std::string> rows;
  for (const ConfigKey& key : config_keys()) {
    if (key.scope != ConfigScope::kNixl) continue;
    rows.emplace_back(key.name);
    EXPECT_EQ(key.default_value, defaults[rows.back()]) << key.name;
    EXPECT_FALSE(key.type.empty() || key.summary.empty()) << key.name;
    // Its default, written back, parses as a file key and as an override.
    const std::string value = key.default_value.empty() ? "null" : std::string(key.default_value);
    EXPECT_EQ(parse_config(nixl(fmt::format("{}: {}", key.name, value))), RefitConfig{}) << key.name;
    const std::vector<std::string> override = {fmt::format("refit_cfg.nixl.{}={}", key.name, value)};
    EXPECT_EQ(parse_config("", override), RefitConfig{}) << key.name;
  }
  EXPECT_EQ(rows, written);
  EXPECT_EQ(rows.size(), 12u);
  const Error e = config_error(nixl("bucket_size: 1"));
  for (const std::string& name : rows) EXPECT_THAT(e.what(), HasSubstr(name));
}

TEST(ConfigTable, BackendParamsAndVariablesByScope) {
  using ::testing::ElementsAre;
  EXPECT_THAT(config_key_names(ConfigScope::kBackendParam, "ucx"),
              ElementsAre("device", "ucx_error_handling_mode", "device_list", "tls", "engine_config"));
  EXPECT_THAT(config_key_names(ConfigScope::kBackendParam, "CUDA_IPC"), ElementsAre("device", "connect_timeout_s"));
  EXPECT_THAT(config_key_names(ConfigScope::kBackendParam, "NCCL"), ElementsAre("device", "timeout_s"));
  EXPECT_THAT(config_key_names(ConfigScope::kBackendParam, "NIXL"),
              ElementsAre("device", "backend", "read_source_memory"));
  EXPECT_TRUE(config_key_names(ConfigScope::kBackendParam, "NO_SUCH_BACKEND").empty());
  for (std::string_view name : config_key_names(ConfigScope::kEnvironment)) EXPECT_TRUE(name.starts_with("REFIT_"));
  // Every row has a type and a summary; names are unique within a scope.
  std::set<std::pair<ConfigScope, std::string_view>> seen;
  for (const ConfigKey& key : config_keys()) {
    EXPECT_FALSE(key.type.empty() || key.summary.empty()) << key.name;
    EXPECT_TRUE(seen.insert({key.scope, key.name}).second) << key.name;
    EXPECT_EQ(key.scope == ConfigScope::kBackendParam, !key.backends.empty()) << key.name;
  }
}

}  // namespace
}  // namespace refit
