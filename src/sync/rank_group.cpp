#include "refit/rank_group.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <thread>

#include "core/fail.h"
#include "core/log_pattern.h"
#include "sync/tcp.h"
#include "sync/worker_links.h"

namespace refit {

using nlohmann::json;

namespace {

constexpr const char* kHello = "refit rank hello v1";

std::optional<int> env_int(const char* name) {
  const char* text = std::getenv(name);
  if (!text || !*text) return std::nullopt;
  int value = 0;
  auto [end, ec] = std::from_chars(text, text + std::strlen(text), value);
  if (ec != std::errc() || *end != '\0')
    fail(ErrorKind::kConfig, "environment variable {}='{}': expected an integer", name, text);
  return value;
}

// The first of `names` that is set.
std::optional<std::pair<const char*, int>> first_set(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (auto v = env_int(name)) return std::make_pair(name, *v);
  return std::nullopt;
}

std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& what) {
  const auto colon = text.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      std::from_chars(text.data() + colon + 1, text.data() + text.size(), port).ec != std::errc() || port < 1 ||
      port > 65535)
    fail(ErrorKind::kConfig, "{} '{}': expected HOST:PORT with a port in 1..65535", what, text);
  std::string host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return {host, port};
}

std::string this_hostname() {
  char name[HOST_NAME_MAX + 1] = {};
  return gethostname(name, sizeof name - 1) == 0 ? name : "?";
}

// Launchers start ranks over seconds (containers, many hosts): joining gets at least a minute
// unless the launcher's caller says otherwise.
double join_timeout_s(const RefitConfig& config, const RankEnvironment& env) {
  return env.join_timeout_s > 0 ? env.join_timeout_s : std::max(config.timeout_s, 60.0);
}

bool worker_is_source(const GroupOptions& o, int rank) { return rank < o.sources; }
int worker_rank(const GroupOptions& o, int rank) { return rank < o.sources ? rank : rank - o.sources; }

void check_world(const GroupOptions& o, const RankEnvironment& env) {
  if (o.sources < 1 || o.destinations < 1)
    fail(ErrorKind::kTopology, "a rank group needs at least one source and one destination, got {} and {}", o.sources,
         o.destinations);
  if (env.world_size != o.sources + o.destinations)
    fail(ErrorKind::kTopology,
         "the launcher started {} ranks, but {} sources + {} destinations need {} (ranks 0..{} are sources, the rest "
         "destinations)",
         env.world_size, o.sources, o.destinations, o.sources + o.destinations, o.sources - 1);
  if (env.rank < 0 || env.rank >= env.world_size)
    fail(ErrorKind::kTopology, "rank {} is outside the world of {} ranks", env.rank, env.world_size);
  ProcessGroup::check_topology(o);
}

}  // namespace

RankEnvironment rank_environment(const std::string& rendezvous) {
  RankEnvironment env;
  auto rank = first_set({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"});
  auto size = first_set({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"});
  if (!rank || !size)
    fail(ErrorKind::kConfig,
         "no rank environment: set RANK and WORLD_SIZE (as torchrun does), or start under mpirun "
         "(OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE) or srun (SLURM_PROCID/NTASKS)");
  env.rank = rank->second;
  env.world_size = size->second;
  if (env.world_size < 1) fail(ErrorKind::kConfig, "{}={}: expected at least 1", size->first, env.world_size);
  if (env.rank < 0 || env.rank >= env.world_size)
    fail(ErrorKind::kConfig, "{}={} is outside 0..{} ({}={})", rank->first, env.rank, env.world_size - 1, size->first,
         env.world_size);
  std::string where = rendezvous;
  std::string what = "--rendezvous";
  if (where.empty() && std::getenv("REFIT_RENDEZVOUS")) {
    where = std::getenv("REFIT_RENDEZVOUS");
    what = "REFIT_RENDEZVOUS";
  }
  if (where.empty()) {
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    if (!addr || !port)
      fail(ErrorKind::kConfig,
           "no rendezvous address: pass --rendezvous HOST:PORT, or set REFIT_RENDEZVOUS=HOST:PORT, or MASTER_ADDR and "
           "MASTER_PORT (as torchrun does); HOST is an address of rank 0's host");
    where = fmt::format("{}:{}", addr, port);
    what = "MASTER_ADDR:MASTER_PORT";
  }
  std::tie(env.rendezvous_host, env.rendezvous_port) = parse_host_port(where, what);
  env.rendezvous_origin = what;
  return env;
}

RankGroup::RankGroup(GroupOptions options, RankEnvironment env)
    : ProcessGroup(std::move(options)), env_(std::move(env)) {
  check_world(options_, env_);
  if (env_.rank != 0)
    fail(ErrorKind::kTopology, "rank {} is not rank 0: only rank 0 drives the group (serve_rank)", env_.rank);
  if (!options_.program) fail(ErrorKind::kInvalidArgument, "a rank group needs a worker program");
  const int listener = tcp_listen(env_.rendezvous_host, env_.rendezvous_port);
  spdlog::info("rank 0 on host {}: waiting for {} ranks at {}:{}", this_hostname(), env_.world_size,
               env_.rendezvous_host, env_.rendezvous_port);

  std::fflush(nullptr);
  spdlog::default_logger()->flush();
  const pid_t driver = getpid();
  own_worker_ = fork();
  if (own_worker_ < 0) {
    ::close(listener);
    fail(ErrorKind::kIo, "fork for rank 0's worker: {}", std::strerror(errno));
  }
  if (own_worker_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // a worker must not outlive its driver
    if (getppid() != driver) _exit(1);
    ::close(listener);
    int code = 1;
    try {
      code = serve_rank(options_, env_);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
    }
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    _exit(code);
  }

  std::vector<std::unique_ptr<WorkerLink>> by_rank(env_.world_size);
  const auto deadline = deadline_after(std::chrono::duration<double>(join_timeout_s(options_.config, env_)));
  try {
    for (int joined = 0; joined < env_.world_size;) {
      int fd;
      try {
        fd = tcp_accept(listener, deadline, options_.config.timeout_s);
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kTimeout) throw;
        std::string missing;
        for (int r = 0; r < env_.world_size; ++r)
          if (!by_rank[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        fail(ErrorKind::kTimeout, "rendezvous at {}:{}: rank(s) {} did not join within {} s", env_.rendezvous_host,
             env_.rendezvous_port, missing, join_timeout_s(options_.config, env_));
      }
      auto link = std::make_unique<WorkerLink>();
      link->channel = Channel(fd, "a joining rank");
      json hello = link->channel.receive(deadline);
      const int rank = hello.value("rank", -1);
      const std::string host = hello.value("host", std::string("?"));
      std::string refusal;
      if (hello.value("hello", "") != kHello) {
        refusal = "it does not speak this refit's rank protocol (another program, or another refit version)";
      } else if (rank < 0 || rank >= env_.world_size) {
        refusal = fmt::format("its rank {} is outside 0..{}", rank, env_.world_size - 1);
      } else if (by_rank[rank]) {
        refusal = fmt::format("rank {} joined already (from host {})", rank, by_rank[rank]->host);
      } else if (hello.value("world_size", -1) != env_.world_size || hello.value("sources", -1) != options_.sources ||
                 hello.value("destinations", -1) != options_.destinations) {
        refusal =
            fmt::format("it has world size {}, {} sources and {} destinations; rank 0 has {}, {} and {}",
                        hello.value("world_size", -1), hello.value("sources", -1), hello.value("destinations", -1),
                        env_.world_size, options_.sources, options_.destinations);
      } else if (hello.value("fingerprint", uint64_t{0}) != options_.model_fingerprint) {
        refusal = fmt::format("it has another model (fingerprint {:016x}, rank 0 has {:016x})",
                              hello.value("fingerprint", uint64_t{0}), options_.model_fingerprint);
      }
      if (!refusal.empty()) {
        const std::string message = fmt::format("rank {} on host {} cannot join: {}", rank, host, refusal);
        try {
          link->channel.send({{"ok", false}, {"error", message}}, deadline_after(std::chrono::seconds(2)));
        } catch (const Error&) {
        }
        fail(ErrorKind::kProtocol, "rendezvous at {}:{}: {}", env_.rendezvous_host, env_.rendezvous_port, message);
      }
      link->is_source = worker_is_source(options_, rank);
      link->rank = worker_rank(options_, rank);
      link->host = host;
      link->pid = hello.value("pid", -1);
      link->channel.set_peer(link->label());
      link->channel.send({{"ok", true}}, deadline);
      by_rank[rank] = std::move(link);
      ++joined;
    }
  } catch (...) {
    ::close(listener);
    for (auto& link : by_rank)
      if (link) links_->links().push_back(std::move(link));
    links_->ask_all_to_exit();
    kill(own_worker_, SIGKILL);
    waitpid(own_worker_, nullptr, 0);
    throw;
  }
  ::close(listener);
  for (auto& link : by_rank) links_->links().push_back(std::move(link));
  spdlog::info("rank 0: all {} ranks joined", env_.world_size);
}

RankGroup::~RankGroup() {
  links_->ask_all_to_exit();
  links_->links().clear();  // closing the channels tells every worker its driver is gone
  const auto deadline = deadline_after(std::chrono::seconds(10));
  int status;
  while (waitpid(own_worker_, &status, WNOHANG) == 0) {
    if (expired(deadline)) {
      kill(own_worker_, SIGKILL);
      waitpid(own_worker_, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::vector<std::string> RankGroup::hosts() const {
  std::vector<std::string> out;
  for (const auto& link : links_->links()) out.push_back(link->host);
  return out;
}

int serve_rank(const GroupOptions& options, const RankEnvironment& env) {
  check_world(options, env);
  const bool is_source = worker_is_source(options, env.rank);
  const int rank = worker_rank(options, env.rank);
  const std::string host = this_hostname();
  const std::string self = fmt::format("{} rank {} on host {}", is_source ? "source" : "destination", rank, host);
  spdlog::set_pattern(log_pattern(self));
  const double join_s = join_timeout_s(options.config, env);
  const auto deadline = deadline_after(std::chrono::duration<double>(join_s));
  const std::string driver = fmt::format("the driver (rank 0) at {}:{}", env.rendezvous_host, env.rendezvous_port);
  int fd = -1;
  try {
    fd = tcp_connect(env.rendezvous_host, env.rendezvous_port, deadline, options.config.timeout_s);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kTimeout) throw;
    fail(ErrorKind::kTimeout,
         "rank {} ({}) could not reach rank 0 at {}:{} ({}) within {} s ({}): check that rank 0 is started, that "
         "this is an address of its host and a port it can listen on, and that no firewall blocks the port",
         env.rank, self, env.rendezvous_host, env.rendezvous_port,
         env.rendezvous_origin.empty() ? "the rendezvous" : env.rendezvous_origin, join_s, e.what());
  }
  Channel channel(fd, driver);
  channel.send({{"hello", kHello},
                {"rank", env.rank},
                {"world_size", env.world_size},
                {"sources", options.sources},
                {"destinations", options.destinations},
                {"fingerprint", options.model_fingerprint},
                {"host", host},
                {"pid", static_cast<int>(getpid())}},
               deadline);
  json welcome = channel.receive(deadline);
  if (!welcome.value("ok", false))
    fail(ErrorKind::kProtocol, "{}", welcome.value("error", driver + " refused this rank"));
  return serve_worker(is_source, rank, channel, options);
}

}  // namespace refit
