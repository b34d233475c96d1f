#include "refit/config_keys.h"

#include <algorithm>
#include <cctype>

#include "core/config_rows.h"

namespace refit {
namespace {

// The backends' init params and the environment; the nixl scope's rows come from the parser.
const ConfigKey kOtherRows[] = {
    {ConfigScope::kBackendParam, "device", "cpu | cuda | cuda:N", "refit_cfg.nixl.device", "UCX CUDA_IPC NCCL NIXL",
     false, "the transfer buffers' device; the engine sets it from refit_cfg.nixl.device"},
    {ConfigScope::kBackendParam, "ucx_error_handling_mode", "peer | none", "peer", "UCX", false,
     "peer: a lost peer is a transport error (with 1 s keepalives), not an endless wait"},
    {ConfigScope::kBackendParam, "device_list", "comma-separated list", "", "UCX", false,
     "the NICs (rails) UCX may use: UCX NET_DEVICES"},
    {ConfigScope::kBackendParam, "tls", "comma-separated list", "", "UCX", false, "the UCX transports: UCX TLS"},
    {ConfigScope::kBackendParam, "engine_config", "KEY=VALUE;KEY=VALUE", "", "UCX", false,
     "raw UCX settings, with or without the UCX_ prefix"},
    {ConfigScope::kBackendParam, "connect_timeout_s", "number", "30", "CUDA_IPC", false,
     "deadline of connecting to a peer's control socket, seconds"},
    {ConfigScope::kBackendParam, "timeout_s", "number", "300", "NCCL", false,
     "deadline of the communicator setup and of one send, seconds"},
    {ConfigScope::kBackendParam, "backend", "string", "UCX", "NIXL", false,
     "NIXL's backend plugin; every param refit does not read goes to NIXL's create_backend"},
    {ConfigScope::kBackendParam, "read_source_memory", "true | false", "false", "NIXL", false,
     "with direct_reads, destinations read the sources' large tensors where they lie"},
    {ConfigScope::kEnvironment,
     "REFIT_HOST_COPY_THREADS",
     "0-64",
     "a quarter of the cores, at most 8",
     {},
     false,
     "threads that share each host-to-host copy of 32 MiB or more"},
    {ConfigScope::kEnvironment,
     "REFIT_RENDEZVOUS",
     "HOST:PORT",
     "",
     {},
     false,
     "where rank 0 listens with `refit bench --launcher env` (else MASTER_ADDR:MASTER_PORT)"},
    {ConfigScope::kEnvironment,
     "REFIT_LOG_FORMAT",
     "plain",
     "",
     {},
     false,
     "plain: each log line is its message alone, so the reference's markers start the line"},
    {ConfigScope::kEnvironment,
     "REFIT_TEST_FLIP_READ_BYTES",
     "N",
     "",
     {},
     false,
     "a test hook: flips one byte of every N-th read a transport completes"},
};

bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::toupper(static_cast<unsigned char>(x)) == std::toupper(static_cast<unsigned char>(y));
         });
}

// Whether a space-separated list of backends holds `backend`.
bool takes(std::string_view backends, std::string_view backend) {
  while (!backends.empty()) {
    const size_t space = backends.find(' ');
    if (same_name(backends.substr(0, space), backend)) return true;
    backends = space == std::string_view::npos ? std::string_view() : backends.substr(space + 1);
  }
  return false;
}

}  // namespace

std::string_view to_string(ConfigScope scope) {
  switch (scope) {
    case ConfigScope::kNixl:
      return "nixl";
    case ConfigScope::kBackendParam:
      return "backend_init_params";
    case ConfigScope::kEnvironment:
      return "environment";
  }
  return "?";
}

std::span<const ConfigKey> config_keys() {
  static const std::vector<ConfigKey> rows = [] {
    std::vector<ConfigKey> out = nixl_config_rows();
    out.insert(out.end(), std::begin(kOtherRows), std::end(kOtherRows));
    return out;
  }();
  return rows;
}

std::vector<std::string_view> config_key_names(ConfigScope scope, std::string_view backend) {
  std::vector<std::string_view> out;
  for (const ConfigKey& key : config_keys())
    if (key.scope == scope && (scope != ConfigScope::kBackendParam || backend.empty() || takes(key.backends, backend)))
      out.push_back(key.name);
  return out;
}

}  // namespace refit
