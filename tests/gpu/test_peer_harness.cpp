// The multi-process harness of the GPU tests (runs without a GPU): a peer is this binary started
// again in a role, with its channels on descriptors 3, 4, ...
#include <string>

#include "gpu_test_util.h"

namespace refit {
namespace {

using namespace gpu_test;

REFIT_PEER_ROLE(echo) {
  require(args.size() == 1 && args[0] == "twice", "args");
  for (auto& channel : channels) {
    std::string text = channel->get_text();
    channel->put(text + text);
  }
}

REFIT_PEER_ROLE(fails) { throw std::runtime_error("on purpose"); }

TEST(PeerHarness, RunsARoleWithItsChannels) {
  auto [a, a_here] = socket_pair();
  auto [b, b_here] = socket_pair();
  Channel first(a_here), second(b_here);
  Peer peer("echo", {a, b}, {"twice"});
  first.put(std::string("ab"));
  second.put(std::string("xyz"));
  EXPECT_EQ(first.get_text(10), "abab");
  EXPECT_EQ(second.get_text(10), "xyzxyz");
  EXPECT_EQ(peer.wait(30), 0);
}

TEST(PeerHarness, ReportsAFailedRole) {
  Peer peer("fails", {});
  EXPECT_EQ(peer.wait(30), 1);
  Peer unknown("no_such_role", {});
  EXPECT_EQ(unknown.wait(30), 2);
}

}  // namespace
}  // namespace refit
