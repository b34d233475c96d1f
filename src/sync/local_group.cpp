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
#include "core/log_pattern.h"
#include "sync/worker_links.h"

namespace refit {
namespace {

using Seconds = std::chrono::duration<double>;

// Forks the worker of `is_source`/`rank`; the child closes the channels of `others` (the
// driver's ends) and serves its WorkerProgram until told to exit.
std::unique_ptr<WorkerLink> spawn(bool is_source, int rank, const GroupOptions& options,
                                  const std::vector<std::unique_ptr<WorkerLink>>& others) {
  std::fflush(nullptr);
  spdlog::default_logger()->flush();
  const pid_t driver = getpid();
  auto w = std::make_unique<WorkerLink>();
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
    for (auto& other : others) other->channel.close();
    spdlog::set_pattern(log_pattern(w->label()));
    Channel channel(fds[1], "driver");
    int code = 1;
    try {
      code = serve_worker(w->is_source, w->rank, channel, options);
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

void stop(WorkerLink& w, Deadline deadline) {
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

}  // namespace

LocalProcessGroup::LocalProcessGroup(GroupOptions options) : ProcessGroup(std::move(options)) {
  if (options_.sources < 1 || options_.destinations < 1)
    fail(ErrorKind::kTopology, "a local group needs at least one source and one destination, got {} and {}",
         options_.sources, options_.destinations);
  if (!options_.program) fail(ErrorKind::kInvalidArgument, "a local group needs a worker program");
  check_topology(options_);  // before any fork
  for (int i = 0; i < options_.sources; ++i) links_->links().push_back(spawn(true, i, options_, links_->links()));
  for (int i = 0; i < options_.destinations; ++i) links_->links().push_back(spawn(false, i, options_, links_->links()));
}

void LocalProcessGroup::set_destinations(int destinations) {
  if (destinations < 1)
    fail(ErrorKind::kTopology, "a local group needs at least one destination, got {}", destinations);
  if (destinations > options_.sources)
    fail(ErrorKind::kTopology, "{} destinations need as many sources, the group has {}", destinations,
         options_.sources);
  auto& workers = links_->links();
  for (auto it = workers.begin(); it != workers.end();) {
    if (!(*it)->is_source && (*it)->rank >= destinations) {
      stop(**it, deadline_after(Seconds(10)));
      it = workers.erase(it);
    } else {
      ++it;
    }
  }
  const int first_new = options_.destinations;
  options_.destinations = destinations;
  for (int rank = first_new; rank < destinations; ++rank) {
    links_->links().push_back(spawn(false, rank, options_, links_->links()));
    links_->create_engine(*links_->links().back());
  }
}

std::vector<std::string> LocalProcessGroup::replace_lost_workers() {
  std::vector<std::string> replaced;
  for (auto& w : links_->links()) {
    int status;
    if (!w->reaped && waitpid(w->pid, &status, WNOHANG) != w->pid) continue;
    replaced.push_back(w->label());
    w = spawn(w->is_source, w->rank, options_, links_->links());
    links_->create_engine(*w);
  }
  return replaced;
}

LocalProcessGroup::~LocalProcessGroup() {
  // Ask all first, so that they exit in parallel, then reap each within one shared deadline.
  links_->ask_all_to_exit();
  const auto deadline = deadline_after(Seconds(10));
  for (auto& w : links_->links()) stop(*w, deadline);
}

std::vector<pid_t> LocalProcessGroup::pids() const {
  std::vector<pid_t> out;
  for (const auto& w : links_->links()) out.push_back(w->pid);
  return out;
}

}  // namespace refit
