// Simulated hosts for tests (scripts/simhosts.sh): each host has its own network, mount, IPC, PID
// and UTS namespaces, joined to the others by a veth link on a bridge. A SimHosts object makes
// them and removes them, its processes and links with it; ranks of `refit bench --launcher env`
// run inside them.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace refit::testing {

// Runs a command (argv) to completion; returns its exit status and output.
inline std::pair<int, std::string> run_command(const std::vector<std::string>& argv) {
  std::string line;
  for (const auto& a : argv) line += "'" + a + "' ";
  line += "2>&1";
  FILE* p = popen(line.c_str(), "r");
  if (!p) throw std::runtime_error("popen failed: " + line);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class SimHosts {
 public:
  // Empty when hosts can be made here; otherwise why not (the tests skip with it).
  static std::string unavailable() {
    auto [status, out] = run_command({REFIT_SIMHOSTS, "check"});
    return status == 0 ? "" : out;
  }

  explicit SimHosts(int count, const std::string& rate = "off") : count_(count) {
    std::random_device rd;
    tag_ = "t" + std::to_string(rd() % 100000);
    run_command({REFIT_SIMHOSTS, "clean"});
    setenv("SIMHOSTS_OWNER", std::to_string(getpid()).c_str(), 1);
    check(run_command({REFIT_SIMHOSTS, "up", tag_, std::to_string(count), "--rate", rate}), "up");
  }
  ~SimHosts() {
    for (pid_t pid : started_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    run_command({REFIT_SIMHOSTS, "down", tag_});
  }
  SimHosts(const SimHosts&) = delete;
  SimHosts& operator=(const SimHosts&) = delete;

  const std::string& tag() const { return tag_; }
  std::string address(int host) const {
    auto [status, out] = run_command({REFIT_SIMHOSTS, "addr", tag_, std::to_string(host)});
    if (status != 0) throw std::runtime_error(out);
    return out.substr(0, out.find('\n'));
  }
  std::string hostname(int host) const { return tag_ + "-h" + std::to_string(host); }

  // Starts argv on `host` in the background, its output into `log`; returns the local pid.
  pid_t start(int host, const std::vector<std::string>& argv, const std::string& log) {
    pid_t pid = fork();
    if (pid == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<std::string> all = {REFIT_SIMHOSTS, "exec", tag_, std::to_string(host)};
      all.insert(all.end(), argv.begin(), argv.end());
      std::vector<char*> args;
      for (auto& a : all) args.push_back(a.data());
      args.push_back(nullptr);
      execv(REFIT_SIMHOSTS, args.data());
      _exit(127);
    }
    started_.push_back(pid);
    return pid;
  }

  // Waits for a started process; its exit status, or -1 when it outlived `timeout_s` (killed).
  int wait(pid_t pid, double timeout_s) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > end) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        forget(pid);
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    forget(pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  // The network state of a host and of its switch port, for failure messages.
  std::string diagnose(int host) const {
    std::string out = "--- network of host " + std::to_string(host) + "\n";
    out += run_command({REFIT_SIMHOSTS, "exec", tag_, std::to_string(host), "sh", "-c",
                        "ip -s link show eth0; ip neigh; ip route; tc -s qdisc show dev eth0; ss -tan"})
               .second;
    out += run_command({"ip", "netns", "exec", "refit-" + tag_ + "-sw", "sh", "-c",
                        "ip -s link show rs" + tag_ + std::to_string(host) + "; tc -s qdisc show dev rs" + tag_ +
                            std::to_string(host) + "; bridge fdb show br br0"})
               .second;
    return out;
  }

  void kill_host(int host) { check(run_command({REFIT_SIMHOSTS, "kill", tag_, std::to_string(host)}), "kill"); }
  void restart_host(int host) {
    check(run_command({REFIT_SIMHOSTS, "restart", tag_, std::to_string(host)}), "restart");
  }
  void link(int host, bool up) {
    check(run_command({REFIT_SIMHOSTS, "link", tag_, std::to_string(host), up ? "up" : "down"}), "link");
  }

 private:
  static void check(const std::pair<int, std::string>& r, const char* what) {
    if (r.first != 0) throw std::runtime_error(std::string("simhosts ") + what + ": " + r.second);
  }
  void forget(pid_t pid) {
    for (auto it = started_.begin(); it != started_.end(); ++it)
      if (*it == pid) {
        started_.erase(it);
        return;
      }
  }

  int count_;
  std::string tag_;
  std::vector<pid_t> started_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace refit::testing
