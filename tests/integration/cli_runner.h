// Runs the real `refit` binary as a child process with a deadline, capturing its output, for
// integration tests that exercise real processes over the real UCX transport.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

namespace refit::testing {

struct CliResult {
  int exit_code = -1;  // -1: killed at the deadline
  std::string output;  // stdout and stderr
  double seconds = 0;
};

// Runs `program` (the built `refit` unless named) with `args`.
inline CliResult run_program(const std::string& program, const std::vector<std::string>& args, double timeout_s) {
  int out[2];
  if (pipe(out) != 0) std::abort();
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    dup2(out[1], 2);
    close(out[0]);
    std::vector<char*> argv;
    std::string cli = program;
    argv.push_back(cli.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(cli.c_str(), argv.data());
    _exit(127);
  }
  close(out[1]);
  CliResult r;
  char buf[4096];
  bool killed = false;
  while (true) {
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > timeout_s && !killed) {
      kill(pid, SIGKILL);
      killed = true;
    }
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 200) > 0) {
      ssize_t n = read(out[0], buf, sizeof buf);
      if (n <= 0) break;
      r.output.append(buf, static_cast<size_t>(n));
    }
  }
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.exit_code = killed ? -1 : (WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  return r;
}

inline CliResult run_cli(const std::vector<std::string>& args, double timeout_s = 120) {
  return run_program(REFIT_CLI_PATH, args, timeout_s);
}

// A fresh directory under the system temp dir, removed by the destructor.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("refit-test-" + std::to_string(rd()) + std::to_string(getpid()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(file(name)) << text;
    return file(name);
  }

 private:
  std::filesystem::path path_;
};

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

}  // namespace refit::testing
