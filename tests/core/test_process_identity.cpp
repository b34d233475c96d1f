// Which peers are on this host: the same boot and the same namespaces. A peer elsewhere is never
// judged through this host's /proc (its pid means nothing here) and its memory is never mapped.
#include "core/process_identity.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

namespace refit {
namespace {

// A pid that no process has: a child that exited and was reaped.
int32_t a_gone_pid() {
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, nullptr, 0);
  return pid;
}

TEST(ProcessIdentity, ThisProcessIsOnThisHostAndAlive) {
  const ProcessIdentity self = this_process();
  EXPECT_FALSE(self.boot_id.empty());
  EXPECT_NE(self.namespaces, 0u);
  EXPECT_FALSE(self.hostname.empty());
  EXPECT_EQ(self.pid, getpid());
  EXPECT_TRUE(same_host(self));
  EXPECT_FALSE(process_is_gone(self));
}

TEST(ProcessIdentity, AGoneProcessOnThisHostIsGone) {
  ProcessIdentity peer = this_process();
  peer.pid = a_gone_pid();
  EXPECT_TRUE(process_is_gone(peer));
}

TEST(ProcessIdentity, APeerInOtherNamespacesIsRemoteAndNeverJudgedGone) {
  ProcessIdentity peer = this_process();
  peer.pid = a_gone_pid();
  peer.namespaces ^= 1;  // same kernel and boot, other namespaces: a container, a simulated host
  EXPECT_FALSE(same_host(peer));
  EXPECT_FALSE(process_is_gone(peer)) << "a pid of another PID namespace says nothing about this host's processes";
  ProcessIdentity other_boot = this_process();
  other_boot.boot_id = "another-boot";
  other_boot.pid = a_gone_pid();
  EXPECT_FALSE(same_host(other_boot));
  EXPECT_FALSE(process_is_gone(other_boot));
}

// A real process in a namespace of its own (UTS: a hostname of its own) reports an identity that
// this process does not take for its host.
TEST(ProcessIdentity, AChildInItsOwnNamespaceIsAnotherHost) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    char ok = 0;
    if (unshare(CLONE_NEWUTS) == 0 && sethostname("refit-other", 11) == 0) {
      const ProcessIdentity id = this_process();
      ok = id.hostname == "refit-other" ? 1 : 2;
      if (write(fds[1], &ok, 1) != 1 || write(fds[1], &id.namespaces, sizeof id.namespaces) != sizeof id.namespaces)
        _exit(1);
    } else if (write(fds[1], &ok, 1) != 1) {
      _exit(1);
    }
    _exit(0);
  }
  close(fds[1]);
  char ok = 0;
  ProcessIdentity child = this_process();
  ASSERT_EQ(read(fds[0], &ok, 1), 1);
  if (ok == 0) {
    close(fds[0]);
    waitpid(pid, nullptr, 0);
    GTEST_SKIP() << "cannot make a UTS namespace here (needs root or CAP_SYS_ADMIN)";
  }
  ASSERT_EQ(read(fds[0], &child.namespaces, sizeof child.namespaces), static_cast<ssize_t>(sizeof child.namespaces));
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  EXPECT_EQ(ok, 1);
  EXPECT_FALSE(same_host(child));
}

}  // namespace
}  // namespace refit
