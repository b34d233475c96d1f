#include "core/process_identity.h"

#include <unistd.h>

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
  static const ProcessIdentity self{read_boot_id(), static_cast<int32_t>(getpid()), start_time_of(getpid())};
  ProcessIdentity id = self;
  // After a fork the cached pid is the parent's.
  if (id.pid != getpid()) id = {id.boot_id, static_cast<int32_t>(getpid()), start_time_of(getpid())};
  return id;
}

bool process_is_gone(const ProcessIdentity& peer) {
  if (peer.boot_id.empty() || peer.pid <= 0 || peer.boot_id != this_process().boot_id) return false;
  return start_time_of(peer.pid) != peer.start_time;
}

}  // namespace refit
