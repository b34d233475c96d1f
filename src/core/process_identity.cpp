#include "core/process_identity.h"

#include <unistd.h>

#include <xxhash.h>

#include <climits>
#include <fstream>
#include <sstream>

namespace refit {
namespace {

std::string read_boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

// The namespaces that separate hosts sharing a kernel, as one hash of their ids ("pid:[4026531836]").
uint64_t read_namespaces() {
  std::string ids;
  for (const char* ns : {"pid", "ipc", "mnt", "net", "uts"}) {
    char target[128];
    const std::string link = std::string("/proc/self/ns/") + ns;
    ssize_t n = readlink(link.c_str(), target, sizeof target - 1);
    ids += n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string(ns) + ":?";
    ids += ';';
  }
  return XXH3_64bits(ids.data(), ids.size());
}

std::string read_hostname() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

// 0 when the process does not exist, has exited but was not reaped yet (a zombie), or /proc is
// unreadable.
uint64_t start_time_of(int32_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return 0;
  // The command name (field 2) may hold spaces; fields after it follow its closing parenthesis.
  auto close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return 0;
    if (i == 22) return std::stoull(field);
  }
  return 0;
}

}  // namespace

ProcessIdentity this_process() {
  // Read on every call: cheap next to what callers do with it, and right after a fork or a
  // setns() (a cached identity would then be the parent's, or the old namespaces').
  return {read_boot_id(), read_namespaces(), read_hostname(), static_cast<int32_t>(getpid()), start_time_of(getpid())};
}

bool same_host(const ProcessIdentity& peer) {
  const ProcessIdentity self = this_process();
  return !peer.boot_id.empty() && peer.boot_id == self.boot_id && peer.namespaces == self.namespaces;
}

bool process_is_gone(const ProcessIdentity& peer) {
  if (peer.pid <= 0 || !same_host(peer)) return false;
  return start_time_of(peer.pid) != peer.start_time;
}

}  // namespace refit
