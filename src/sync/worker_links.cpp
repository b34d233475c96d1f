#include "sync/worker_links.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/fail.h"
#include "refit/device.h"
#include "refit/memory.h"

namespace refit {

using nlohmann::json;

// A timeline event crosses as a short array: a refit has thousands of them.
void to_json(json& j, const TimelineEvent& e) {
  j = json::array({static_cast<int>(e.phase), e.peer, e.bucket, e.start, e.end, e.bytes, e.pieces});
}
void from_json(const json& j, TimelineEvent& e) {
  const int phase = j.at(0).get<int>();
  if (phase < 0 || phase > static_cast<int>(TimelinePhase::kGather))
    fail(ErrorKind::kProtocol, "a worker reported timeline phase {}, which this driver does not know", phase);
  e = {static_cast<TimelinePhase>(phase),
       j.at(1).get<uint32_t>(),
       j.at(2).get<uint64_t>(),
       j.at(3).get<double>(),
       j.at(4).get<double>(),
       j.at(5).get<uint64_t>(),
       j.at(6).get<uint32_t>()};
}

// Engine statistics cross the worker channel as JSON objects keyed by field name.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(SendStats, tensors, dropped, buckets, replayed_buckets, payload_bytes,
                                   in_place_bytes, seconds, had_peer, destinations, delta_tensors, delta_bytes,
                                   delta_seconds, events)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ReceiveStats, tensors, batches, buckets, replayed_buckets, payload_bytes, wire_bytes,
                                   in_place_bytes, total_seconds, load_seconds, mapped, buffer_bytes, route, sources,
                                   delta_tensors, delta_bytes, delta_seconds, events)

namespace {

using Seconds = std::chrono::duration<double>;

// A worker's own waits end at timeout_s; the driver allows a margin on top so that it hears the
// worker's error rather than its own timeout.
constexpr Seconds kDriverMargin{15.0};
// After a first failure, how long the driver still waits for the other workers' answers.
constexpr Seconds kFailureGrace{2.0};

json binary(const Bytes& b) { return json::binary(std::vector<uint8_t>(b.begin(), b.end())); }

json create_command(uint64_t bucket_bytes, const SessionId& session) {
  return json{
      {"cmd", "create"}, {"bucket_bytes", bucket_bytes}, {"session", binary(Bytes(session.begin(), session.end()))}};
}
Bytes from_binary(const json& j) { return j.get_binary(); }

// The device of a worker: the configured one, except that a plain "cuda" deals the workers
// (sources first, then destinations) round-robin over the visible GPUs.
Device worker_device(const Device& configured, bool is_source, int rank, const GroupOptions& options) {
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

}  // namespace

int serve_worker(bool is_source, int rank, Channel& channel, const GroupOptions& options) {
  std::unique_ptr<WorkerProgram> program;
  std::unique_ptr<CheckpointEngine> engine;
  std::optional<EngineOptions> engine_options;  // what the engine was created with
  bool refit_failed = false;                    // the last refit failed: replace the engine at the next prepare
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
      } else if (name == "create" && engine) {
        // A worker that has an engine keeps it (the driver creates engines again after a failed
        // refit, for workers put in place of lost ones).
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
        if (is_source && rank < static_cast<int>(options.source_layouts.size()))
          eo.holds = options.source_layouts[rank];
        eo.model = options.model;
        eo.receives_only = !is_source;
        engine_options = eo;
        engine = std::make_unique<CheckpointEngine>(std::move(eo));
        program = options.program(is_source, rank);
        if (is_source && options.config.direct_reads) program->place_weights(*engine);
      } else if (!engine) {
        fail(ErrorKind::kInvalidArgument, "{} got '{}' before its engine was created", self, name);
      } else if (name == "prepare") {
        if (refit_failed) {
          // Messages of the failed refit may still be in flight to the old engine; a fresh one
          // (a fresh transport endpoint) never sees them.
          auto fresh = std::make_unique<CheckpointEngine>(*engine_options);
          if (is_source && options.config.direct_reads) program->place_weights(*fresh);  // from the old one's memory
          engine = std::move(fresh);
          refit_failed = false;
        }
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
        refit_failed = true;
        if (is_source) {
          auto weights = program->weights(index);
          reply["send"] = engine->send(*weights);
        } else {
          reply["receive"] = engine->receive(program->loader(index));
        }
        refit_failed = false;
      } else if (name == "report") {
        reply["detail"] = program->report(cmd.at("index").get<uint64_t>());
      } else if (name == "finalize") {
        engine->finalize();
      } else {
        fail(ErrorKind::kProtocol, "{} got unknown driver command '{}'", self, name);
      }
    } catch (const std::exception& e) {
      const auto* err = dynamic_cast<const Error*>(&e);
      reply = {
          {"ok", false}, {"error", e.what()}, {"kind", static_cast<int>(err ? err->kind() : ErrorKind::kInternal)}};
    }
    try {
      channel.send(reply, deadline_after(Seconds(options.config.timeout_s)));
    } catch (const Error&) {
      return 1;  // the driver cannot be reached: its host is gone or cut off
    }
  }
}

std::string WorkerLink::label() const {
  const std::string role = fmt::format("{} rank {}", is_source ? "source" : "destination", rank);
  return host.empty() ? role : fmt::format("{} on host {}", role, host);
}

std::string WorkerLink::exit_description() {
  if (!host.empty()) return "closed its channel (its process or host is gone)";
  int status = 0;
  // The worker closed its channel; give it a moment to be reaped.
  for (int i = 0; i < 100 && !reaped; ++i) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      reaped = true;
      if (WIFSIGNALED(status))
        return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
      return fmt::format("exited with status {}", WEXITSTATUS(status));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return "closed its channel";
}

namespace {

// Sends a command to every worker, then gathers every answer before reporting failures, so
// that one error names every worker that failed and why.
std::vector<json> broadcast(std::vector<std::unique_ptr<WorkerLink>>& workers, const RefitConfig& config,
                            const std::string& phase, const std::function<json(const WorkerLink&)>& command) {
  std::vector<std::string> failures;
  ErrorKind kind = ErrorKind::kInternal;
  std::vector<bool> sent(workers.size(), false);
  for (size_t i = 0; i < workers.size(); ++i) {
    try {
      workers[i]->channel.send(command(*workers[i]));
      sent[i] = true;
    } catch (const Error& e) {
      failures.push_back(fmt::format("{} {}", workers[i]->label(), workers[i]->exit_description()));
      kind = ErrorKind::kPeerLost;
    }
  }
  // Answers are taken in the order they come, so that one worker that never answers (its host
  // unreachable) does not hide the others' errors. Once something failed, the rest get a short
  // grace instead of the whole margin: their own errors, if any, come within it.
  auto deadline = deadline_after(Seconds(config.timeout_s) + kDriverMargin);
  std::vector<json> replies(workers.size());
  std::vector<size_t> pending;
  for (size_t i = 0; i < workers.size(); ++i)
    if (sent[i]) pending.push_back(i);
  auto record_failure = [&](std::string text, ErrorKind k) {
    if (failures.empty()) kind = k;
    failures.push_back(std::move(text));
    deadline = std::min(deadline, deadline_after(kFailureGrace));
  };
  while (!pending.empty()) {
    std::vector<pollfd> fds;
    for (size_t i : pending) fds.push_back({workers[i]->channel.fd(), POLLIN, 0});
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      for (size_t i : pending)
        record_failure(fmt::format("{} (pid {}) did not answer during phase {} within the deadline",
                                   workers[i]->label(), workers[i]->pid, phase),
                       ErrorKind::kTimeout);
      break;
    }
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(left, 200))) <= 0) continue;
    std::vector<size_t> still;
    for (size_t k = 0; k < pending.size(); ++k) {
      const size_t i = pending[k];
      if (fds[k].revents == 0) {
        still.push_back(i);
        continue;
      }
      try {
        replies[i] = workers[i]->channel.receive(deadline);
        if (!replies[i].value("ok", false))
          record_failure(replies[i].value("error", workers[i]->label() + " failed"),
                         static_cast<ErrorKind>(replies[i].value("kind", static_cast<int>(ErrorKind::kInternal))));
      } catch (const Error& e) {
        if (e.kind() == ErrorKind::kPeerLost) {
          record_failure(fmt::format("{} (pid {}) {} during phase {}", workers[i]->label(), workers[i]->pid,
                                     workers[i]->exit_description(), phase),
                         ErrorKind::kPeerLost);
        } else {
          record_failure(fmt::format("{}: {}", workers[i]->label(), e.what()), e.kind());
        }
      }
    }
    pending = std::move(still);
  }
  if (!failures.empty()) {
    std::string message = fmt::format("{} failed on {} of {} workers:", phase, failures.size(), workers.size());
    for (const auto& f : failures) message += "\n  - " + f;
    throw Error(kind, message);
  }
  return replies;
}

}  // namespace

std::vector<uint64_t> WorkerLinks::total_memory_bytes() {
  auto replies = broadcast(links_, options_.config, "memory query", [](const WorkerLink&) {
    return json{{"cmd", "memory"}};
  });
  std::vector<uint64_t> out;
  for (const auto& r : replies) out.push_back(r.at("bytes").get<uint64_t>());
  return out;
}

void WorkerLinks::create_engines(uint64_t bucket_bytes, const SessionId& session) {
  broadcast(links_, options_.config, "engine creation",
            [&](const WorkerLink&) { return create_command(bucket_bytes, session); });
  engines_ = {bucket_bytes, session};
}

std::vector<Metadata> WorkerLinks::prepare() {
  auto replies = broadcast(links_, options_.config, "prepare", [](const WorkerLink&) {
    return json{{"cmd", "prepare"}};
  });
  std::vector<Metadata> out;
  for (const auto& r : replies) out.push_back(from_binary(r.at("metadata")));
  return out;
}

void WorkerLinks::init_process_groups(std::span<const Metadata> metadata) {
  json all = json::array();
  for (const auto& m : metadata) all.push_back(binary(m));
  broadcast(links_, options_.config, "init", [&](const WorkerLink&) {
    return json{{"cmd", "init"}, {"metadata", all}, {"train", options_.sources}, {"rollout", options_.destinations}};
  });
}

RefitReport WorkerLinks::refit(uint64_t index) {
  const std::string phase = fmt::format("refit {}", index);
  broadcast(links_, options_.config, phase + " staging", [&](const WorkerLink&) {
    return json{{"cmd", "stage"}, {"index", index}};
  });
  const auto start = Clock::now();
  const double start_time = timeline_now();
  auto replies = broadcast(links_, options_.config, phase, [&](const WorkerLink&) {
    return json{{"cmd", "refit"}, {"index", index}};
  });
  RefitReport report;
  report.index = index;
  report.start_time = start_time;
  report.seconds = Seconds(Clock::now() - start).count();
  // The programs' reports (e.g. hashes of every received tensor) are not part of the refit's time.
  auto details = broadcast(links_, options_.config, phase + " report", [&](const WorkerLink&) {
    return json{{"cmd", "report"}, {"index", index}};
  });
  for (size_t i = 0; i < links_.size(); ++i) {
    WorkerRefitReport w;
    w.is_source = links_[i]->is_source;
    w.rank = links_[i]->rank;
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

void WorkerLinks::finalize() {
  broadcast(links_, options_.config, "finalize", [](const WorkerLink&) { return json{{"cmd", "finalize"}}; });
}

void WorkerLinks::create_engine(WorkerLink& w) {
  if (!engines_) return;
  w.channel.send(create_command(engines_->first, engines_->second));
  json reply = w.channel.receive(deadline_after(Seconds(options_.config.timeout_s)));
  if (!reply.value("ok", false))
    fail(ErrorKind::kTransport, "{} could not create its engine: {}", w.label(), reply.value("error", "?"));
}

void WorkerLinks::ask_all_to_exit() {
  for (auto& w : links_) {
    try {
      w->channel.send({{"cmd", "exit"}}, deadline_after(std::chrono::seconds(2)));
    } catch (const Error&) {
    }
  }
}

}  // namespace refit
