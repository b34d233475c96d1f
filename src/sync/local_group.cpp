#include "refit/local_group.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cstring>
#include <thread>

#include "core/fail.h"
#include "refit/device.h"
#include "refit/memory.h"
#include "sync/channel.h"

namespace refit {

using nlohmann::json;

struct LocalProcessGroup::Worker {
  bool is_source = false;
  int rank = 0;
  pid_t pid = -1;
  bool reaped = false;  // its exit was collected by waitpid
  Channel channel;
  std::string label() const { return fmt::format("{} rank {}", is_source ? "source" : "destination", rank); }
};

// Engine statistics cross the worker channel as JSON objects keyed by field name.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(SendStats, tensors, dropped, buckets, payload_bytes, seconds, had_peer)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ReceiveStats, tensors, batches, buckets, payload_bytes, wire_bytes, total_seconds,
                                   load_seconds, mapped, buffer_bytes)

namespace {

using Seconds = std::chrono::duration<double>;

// A worker's own waits end at timeout_s; the driver allows a margin on top so that it hears the
// worker's error rather than its own timeout.
constexpr Seconds kDriverMargin{15.0};

json binary(const Bytes& b) { return json::binary(std::vector<uint8_t>(b.begin(), b.end())); }

json create_command(uint64_t bucket_bytes, const SessionId& session) {
  return json{{"cmd", "create"}, {"bucket_bytes", bucket_bytes}, {"session", binary(Bytes(session.begin(), session.end()))}};
}
Bytes from_binary(const json& j) { return j.get_binary(); }


// The device of a worker: the configured one, except that a plain "cuda" deals the workers
// (sources first, then destinations) round-robin over the visible GPUs.
Device worker_device(const Device& configured, bool is_source, int rank, const LocalGroupOptions& options) {
  if (configured.kind == Device::Kind::kCpu) return configured;
  try {
    check_device(configured);
  } catch (const Error& e) {
    throw Error(e.kind(), fmt::format("refit_cfg.nixl.device: {}", e.what()));
  }
  if (configured.index >= 0) return configured;
  const int index = is_source ? rank : options.sources + rank;
  return Device{Device::Kind::kCuda, index % cuda_device_count()};
}

// The command loop of a worker process. Returns the process exit code.
int run_worker(bool is_source, int rank, Channel& channel, const LocalGroupOptions& options) {
  std::unique_ptr<WorkerProgram> program;
  std::unique_ptr<CheckpointEngine> engine;
  json last_stats;
  const std::string self = fmt::format("{} rank {}", is_source ? "source" : "destination", rank);
  while (true) {
    json cmd;
    try {
      cmd = channel.receive_forever();
    } catch (const Error&) {
      return 0;  // the driver went away; nothing left to do
    }
    const std::string name = cmd.value("cmd", "");
    json reply = {{"ok", true}};
    try {
      if (name == "exit") {
        engine.reset();
        channel.send(reply);
        return 0;
      } else if (name == "memory") {
        // Bucket sizing takes the minimum over every worker of its transfer-buffer device's memory.
        reply["bytes"] = total_device_memory_bytes(worker_device(options.config.device, is_source, rank, options));
      } else if (name == "create") {
        EngineOptions eo;
        eo.config = options.config;
        eo.config.device = worker_device(options.config.device, is_source, rank, options);
        // The worker program allocates its tensors on the current GPU.
        set_current_device(eo.config.device);
        eo.bucket_bytes = cmd.at("bucket_bytes").get<uint64_t>();
        auto session = cmd.at("session").get_binary();
        std::copy(session.begin(), session.end(), eo.session.begin());
        eo.model_fingerprint = options.model_fingerprint;
        if (!is_source && rank < static_cast<int>(options.destination_layouts.size()))
          eo.layout = options.destination_layouts[rank];
        eo.receives_only = !is_source;
        engine = std::make_unique<CheckpointEngine>(std::move(eo));
        program = options.program(is_source, rank);
      } else if (!engine) {
        fail(ErrorKind::kInvalidArgument, "{} got '{}' before its engine was created", self, name);
      } else if (name == "prepare") {
        reply["metadata"] = binary(engine->prepare());
      } else if (name == "init") {
        std::vector<Metadata> md;
        for (const auto& m : cmd.at("metadata")) md.push_back(from_binary(m));
        // World sizes come with the command: destinations may have joined or left since the fork.
        const int train = cmd.at("train").get<int>(), rollout = cmd.at("rollout").get<int>();
        if (is_source)
          engine->init_source(rank, train, rollout, md);
        else
          engine->init_destination(rank, train, rollout, md);
      } else if (name == "stage") {
        program->stage(cmd.at("index").get<uint64_t>());
      } else if (name == "refit") {
        uint64_t index = cmd.at("index").get<uint64_t>();
        if (is_source) {
          auto weights = program->weights(index);
          reply["send"] = engine->send(*weights);
        } else {
          reply["receive"] = engine->receive(program->loader(index));
        }
      } else if (name == "report") {
        reply["detail"] = program->report(cmd.at("index").get<uint64_t>());
      } else if (name == "finalize") {
        engine->finalize();
      } else {
        fail(ErrorKind::kProtocol, "{} got unknown driver command '{}'", self, name);
      }
    } catch (const std::exception& e) {
      const auto* err = dynamic_cast<const Error*>(&e);
      reply = {{"ok", false}, {"error", e.what()}, {"kind", static_cast<int>(err ? err->kind() : ErrorKind::kInternal)}};
    }
    try {
      channel.send(reply);
    } catch (const Error&) {
      return 1;
    }
  }
}

std::string exit_description(LocalProcessGroup::Worker& worker) {
  int status = 0;
  // The worker closed its channel; give it a moment to be reaped.
  for (int i = 0; i < 100 && !worker.reaped; ++i) {
    pid_t r = waitpid(worker.pid, &status, WNOHANG);
    if (r == worker.pid) {
      worker.reaped = true;
      if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
      return fmt::format("exited with status {}", WEXITSTATUS(status));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return "closed its channel";
}

}  // namespace

LocalProcessGroup::LocalProcessGroup(LocalGroupOptions options) : options_(std::move(options)) {
  if (options_.sources < 1 || options_.destinations < 1)
    fail(ErrorKind::kTopology, "a local group needs at least one source and one destination, got {} and {}",
         options_.sources, options_.destinations);
  if (!options_.program) fail(ErrorKind::kInvalidArgument, "a local group needs a worker program");
  for (int i = 0; i < options_.sources; ++i) workers_.push_back(spawn(true, i));
  for (int i = 0; i < options_.destinations; ++i) workers_.push_back(spawn(false, i));
}

std::unique_ptr<LocalProcessGroup::Worker> LocalProcessGroup::spawn(bool is_source, int rank) {
  std::fflush(nullptr);
  spdlog::default_logger()->flush();
  const pid_t driver = getpid();
  auto w = std::make_unique<Worker>();
  w->is_source = is_source;
  w->rank = rank;
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0)
    fail(ErrorKind::kIo, "socketpair for {}: {}", w->label(), std::strerror(errno));
  pid_t pid = fork();
  if (pid < 0) fail(ErrorKind::kIo, "fork for {}: {}", w->label(), std::strerror(errno));
  if (pid == 0) {
    // A worker must not outlive its driver.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != driver) _exit(1);
    ::close(fds[0]);
    for (auto& other : workers_) other->channel.close();
    spdlog::set_pattern(fmt::format("[%H:%M:%S.%e] [{}] %v", w->label()));
    Channel channel(fds[1], "driver");
    int code = 1;
    try {
      code = run_worker(w->is_source, w->rank, channel, options_);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
    }
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    _exit(code);
  }
  ::close(fds[1]);
  w->pid = pid;
  w->channel = Channel(fds[0], w->label());
  return w;
}

void LocalProcessGroup::stop(Worker& w, Deadline deadline) {
  if (w.reaped) return;
  try {
    w.channel.send({{"cmd", "exit"}});
  } catch (const Error&) {
  }
  int status;
  while (waitpid(w.pid, &status, WNOHANG) == 0) {
    if (expired(deadline)) {
      kill(w.pid, SIGKILL);
      waitpid(w.pid, &status, 0);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void LocalProcessGroup::set_destinations(int destinations) {
  if (destinations < 1) fail(ErrorKind::kTopology, "a local group needs at least one destination, got {}", destinations);
  if (destinations > options_.sources)
    fail(ErrorKind::kTopology, "{} destinations need as many sources, the group has {}", destinations, options_.sources);
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (!(*it)->is_source && (*it)->rank >= destinations) {
      stop(**it, deadline_after(Seconds(10)));
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  const int first_new = options_.destinations;
  options_.destinations = destinations;
  for (int rank = first_new; rank < destinations; ++rank) {
    workers_.push_back(spawn(false, rank));
    create_engine(*workers_.back());
  }
}

void LocalProcessGroup::create_engine(Worker& w) {
  if (!engines_) return;
  w.channel.send(create_command(engines_->first, engines_->second));
  json reply = w.channel.receive(deadline_after(Seconds(options_.config.timeout_s)));
  if (!reply.value("ok", false))
    fail(ErrorKind::kTransport, "{} could not create its engine: {}", w.label(), reply.value("error", "?"));
}

std::vector<std::string> LocalProcessGroup::replace_lost_workers() {
  std::vector<std::string> replaced;
  for (auto& w : workers_) {
    int status;
    if (!w->reaped && waitpid(w->pid, &status, WNOHANG) != w->pid) continue;
    replaced.push_back(w->label());
    w = spawn(w->is_source, w->rank);
    create_engine(*w);
  }
  return replaced;
}

LocalProcessGroup::~LocalProcessGroup() {
  // Ask all first, so that they exit in parallel, then reap each within one shared deadline.
  for (auto& w : workers_) {
    try {
      w->channel.send({{"cmd", "exit"}});
    } catch (const Error&) {
    }
  }
  const auto deadline = deadline_after(Seconds(10));
  for (auto& w : workers_) stop(*w, deadline);
}

std::vector<pid_t> LocalProcessGroup::pids() const {
  std::vector<pid_t> out;
  for (const auto& w : workers_) out.push_back(w->pid);
  return out;
}

namespace {

// Sends a command to every worker, then gathers every answer before reporting failures, so
// that one error names every worker that failed and why.
std::vector<json> broadcast(std::vector<std::unique_ptr<LocalProcessGroup::Worker>>& workers, const RefitConfig& config,
                            const std::string& phase, const std::function<json(const LocalProcessGroup::Worker&)>& command) {
  std::vector<std::string> failures;
  ErrorKind kind = ErrorKind::kInternal;
  std::vector<bool> sent(workers.size(), false);
  for (size_t i = 0; i < workers.size(); ++i) {
    try {
      workers[i]->channel.send(command(*workers[i]));
      sent[i] = true;
    } catch (const Error& e) {
      failures.push_back(fmt::format("{} {}", workers[i]->label(), exit_description(*workers[i])));
      kind = ErrorKind::kPeerLost;
    }
  }
  const auto deadline = deadline_after(Seconds(config.timeout_s) + kDriverMargin);
  std::vector<json> replies(workers.size());
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!sent[i]) continue;
    try {
      replies[i] = workers[i]->channel.receive(deadline);
      if (!replies[i].value("ok", false)) {
        if (failures.empty()) kind = static_cast<ErrorKind>(replies[i].value("kind", static_cast<int>(ErrorKind::kInternal)));
        failures.push_back(replies[i].value("error", workers[i]->label() + " failed"));
      }
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kPeerLost) {
        failures.push_back(fmt::format("{} (pid {}) {} during phase {}", workers[i]->label(), workers[i]->pid,
                                       exit_description(*workers[i]), phase));
        if (failures.size() == 1) kind = ErrorKind::kPeerLost;
      } else {
        failures.push_back(fmt::format("{}: {}", workers[i]->label(), e.what()));
        if (failures.size() == 1) kind = e.kind();
      }
    }
  }
  if (!failures.empty()) {
    std::string message = fmt::format("{} failed on {} of {} workers:", phase, failures.size(), workers.size());
    for (const auto& f : failures) message += "\n  - " + f;
    throw Error(kind, message);
  }
  return replies;
}

}  // namespace

std::vector<uint64_t> LocalProcessGroup::total_memory_bytes() {
  auto replies = broadcast(workers_, options_.config, "memory query", [](const Worker&) { return json{{"cmd", "memory"}}; });
  std::vector<uint64_t> out;
  for (const auto& r : replies) out.push_back(r.at("bytes").get<uint64_t>());
  return out;
}

void LocalProcessGroup::create_engines(uint64_t bucket_bytes, const SessionId& session) {
  broadcast(workers_, options_.config, "engine creation",
            [&](const Worker&) { return create_command(bucket_bytes, session); });
  engines_ = {bucket_bytes, session};
}

std::vector<Metadata> LocalProcessGroup::prepare() {
  auto replies = broadcast(workers_, options_.config, "prepare", [](const Worker&) { return json{{"cmd", "prepare"}}; });
  std::vector<Metadata> out;
  for (const auto& r : replies) out.push_back(from_binary(r.at("metadata")));
  return out;
}

void LocalProcessGroup::init_process_groups(std::span<const Metadata> metadata) {
  json all = json::array();
  for (const auto& m : metadata) all.push_back(binary(m));
  broadcast(workers_, options_.config, "init", [&](const Worker&) {
    return json{{"cmd", "init"}, {"metadata", all}, {"train", options_.sources}, {"rollout", options_.destinations}};
  });
}

RefitReport LocalProcessGroup::refit(uint64_t index) {
  const std::string phase = fmt::format("refit {}", index);
  broadcast(workers_, options_.config, phase + " staging", [&](const Worker&) { return json{{"cmd", "stage"}, {"index", index}}; });
  const auto start = Clock::now();
  auto replies = broadcast(workers_, options_.config, phase, [&](const Worker&) { return json{{"cmd", "refit"}, {"index", index}}; });
  RefitReport report;
  report.index = index;
  report.seconds = Seconds(Clock::now() - start).count();
  // The programs' reports (e.g. hashes of every received tensor) are not part of the refit's time.
  auto details = broadcast(workers_, options_.config, phase + " report",
                           [&](const Worker&) { return json{{"cmd", "report"}, {"index", index}}; });
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerRefitReport w;
    w.is_source = workers_[i]->is_source;
    w.rank = workers_[i]->rank;
    const auto& r = replies[i];
    if (w.is_source)
      w.send = r.at("send").get<SendStats>();
    else
      w.receive = r.at("receive").get<ReceiveStats>();
    w.detail = details[i].value("detail", "{}");
    report.workers.push_back(std::move(w));
  }
  return report;
}

void LocalProcessGroup::finalize() {
  broadcast(workers_, options_.config, "finalize", [](const Worker&) { return json{{"cmd", "finalize"}}; });
}

}  // namespace refit
