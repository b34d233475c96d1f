// The local control channel (src/transport/local_socket) that the CUDA IPC and NCCL backends use
// for their messages: order and integrity, deadlines, and peer loss between real processes
// (a forked peer that is SIGKILLed, stopped, or closes cleanly). Runs on any machine.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error_of.h"
#include "process_harness.h"
#include "refit/error.h"
#include "transport/local_socket/init_params.h"
#include "transport/local_socket/local_peer.h"
#include "transport/local_socket/local_socket.h"

namespace refit {
namespace {

using namespace std::chrono_literals;
using LinkId = LocalSocketEndpoint::LinkId;
constexpr std::string_view kTag = "test";

using testing::error_kind_of;

Bytes pattern(size_t size, uint64_t seed) {
  Bytes bytes(size);
  for (size_t i = 0; i < size; i += 8) {
    uint64_t word = (i / 8 + seed) * 0x9E3779B97F4A7C15ull;
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, size - i));
  }
  return bytes;
}

size_t message_size(int index) {
  if (index % 10 == 0) return 0;
  if (index == 25) return 8u << 20;
  return static_cast<size_t>(index) * 613 % 20000;
}

using testing::Child;
using testing::Pipe;
using testing::require;

void put_id(Pipe& pipe, const EndpointId& id) { pipe.put(std::span<const uint8_t>(id.data(), id.size())); }
EndpointId get_id(Pipe& pipe) {
  Bytes bytes = pipe.get();
  EndpointId id;
  require(bytes.size() == id.size(), "expected an endpoint id from the peer process");
  std::copy(bytes.begin(), bytes.end(), id.begin());
  return id;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Two endpoints of this process, linked both ways.
struct Pair {
  LocalSocketEndpoint a{kTag};
  LocalSocketEndpoint b{kTag};
  LinkId a_to_b = a.connect(b.id(), kTag, "endpoint b", deadline_after(5s));
  LinkId b_to_a = b.connect(a.id(), kTag, "endpoint a", deadline_after(5s));
};

TEST(LocalSocket, DeliversMessagesInOrderWholeOnEachChannel) {
  Pair p;
  for (int i = 0; i < 40; ++i) p.a.send(p.a_to_b, 0, pattern(message_size(i), i), deadline_after(10s));
  for (int i = 0; i < 5; ++i) p.a.send(p.a_to_b, 7, pattern(100 + i, 1000 + i), deadline_after(10s));
  p.b.send(p.b_to_a, 0, pattern(33, 77), deadline_after(10s));
  // Channel 7 first: channels are independent queues.
  for (int i = 0; i < 5; ++i) EXPECT_EQ(p.b.receive(p.b_to_a, 7, deadline_after(10s)), pattern(100 + i, 1000 + i));
  for (int i = 0; i < 40; ++i) {
    Bytes got = p.b.receive(p.b_to_a, 0, deadline_after(10s));
    ASSERT_EQ(got.size(), message_size(i)) << "message " << i;
    EXPECT_TRUE(got == pattern(message_size(i), i)) << "message " << i;
  }
  EXPECT_EQ(p.a.receive(p.a_to_b, 0, deadline_after(10s)), pattern(33, 77));
  EXPECT_FALSE(p.b.try_receive(p.b_to_a, 0).has_value());
}

TEST(LocalSocket, QueuesMessagesFromASenderNotYetConnectedBack) {
  LocalSocketEndpoint a(kTag), b(kTag);
  LinkId a_to_b = a.connect(b.id(), kTag, "endpoint b", deadline_after(5s));
  a.send(a_to_b, 0, pattern(10, 1), deadline_after(5s));
  a.send(a_to_b, 0, pattern(20, 2), deadline_after(5s));
  std::this_thread::sleep_for(50ms);
  LinkId b_to_a = b.connect(a.id(), kTag, "endpoint a", deadline_after(5s));
  EXPECT_EQ(b.receive(b_to_a, 0, deadline_after(5s)), pattern(10, 1));
  EXPECT_EQ(b.receive(b_to_a, 0, deadline_after(5s)), pattern(20, 2));
}

TEST(LocalSocket, ReceiveTimesOutPromptlyNamingThePeer) {
  Pair p;
  const auto start = Clock::now();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { p.b.receive(p.b_to_a, 0, deadline_after(200ms)); }, &message), ErrorKind::kTimeout);
  EXPECT_GE(seconds_since(start), 0.19);
  EXPECT_LT(seconds_since(start), 2.0);
  EXPECT_NE(message.find("endpoint a"), std::string::npos) << message;
}

TEST(LocalSocket, ConnectingToNobodyIsAPeerLossNamingIt) {
  LocalSocketEndpoint a(kTag);
  std::string message;
  EXPECT_EQ(error_kind_of([&] { a.connect(random_id(), kTag, "source rank 9", deadline_after(2s)); }, &message),
            ErrorKind::kPeerLost);
  EXPECT_NE(message.find("source rank 9"), std::string::npos) << message;
  EXPECT_NE(message.find("@refit-test-"), std::string::npos) << message;
}

TEST(LocalSocket, ConnectsToItself) {
  LocalSocketEndpoint a(kTag);
  LinkId self = a.connect(a.id(), kTag, "myself", deadline_after(5s));
  a.send(self, 0, pattern(5, 5), deadline_after(5s));
  EXPECT_EQ(a.receive(self, 0, deadline_after(5s)), pattern(5, 5));
}

TEST(LocalSocket, HandlersGetTheirChannelWithTheSender) {
  Pair p;
  std::mutex mutex;
  std::vector<std::pair<EndpointId, Bytes>> got;
  p.b.set_handler(3, [&](const EndpointId& sender, Bytes message) {
    std::lock_guard lock(mutex);
    got.emplace_back(sender, std::move(message));
  });
  p.a.send(p.a_to_b, 3, pattern(64, 1), deadline_after(5s));
  p.a.send(p.a_to_b, 0, pattern(8, 2), deadline_after(5s));
  p.a.send(p.a_to_b, 3, pattern(65, 3), deadline_after(5s));
  EXPECT_EQ(p.b.receive(p.b_to_a, 0, deadline_after(5s)), pattern(8, 2));
  const auto deadline = deadline_after(5s);
  while (!expired(deadline)) {
    {
      std::lock_guard lock(mutex);
      if (got.size() == 2) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  std::lock_guard lock(mutex);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].first, p.a.id());
  EXPECT_EQ(got[0].second, pattern(64, 1));
  EXPECT_EQ(got[1].second, pattern(65, 3));
  EXPECT_FALSE(p.b.try_receive(p.b_to_a, 3).has_value());
}

TEST(LocalSocket, ADisconnectedPeerMayComeBack) {
  Pair p;
  p.a.send(p.a_to_b, 0, pattern(4, 4), deadline_after(5s));
  p.a.disconnect(p.a_to_b);
  // What was sent before the disconnect is still delivered; a clean disconnect is not a loss.
  EXPECT_EQ(p.b.receive(p.b_to_a, 0, deadline_after(5s)), pattern(4, 4));
  EXPECT_EQ(error_kind_of([&] { p.b.receive(p.b_to_a, 0, deadline_after(100ms)); }), ErrorKind::kTimeout);
  EXPECT_TRUE(p.b.alive(p.b_to_a));

  LinkId again = p.a.connect(p.b.id(), kTag, "endpoint b", deadline_after(5s));
  p.a.send(again, 0, pattern(6, 6), deadline_after(5s));
  EXPECT_EQ(p.b.receive(p.b_to_a, 0, deadline_after(5s)), pattern(6, 6));
  // And both sides reconnecting, as an engine's re-init does.
  p.b.disconnect(p.b_to_a);
  LinkId b_again = p.b.connect(p.a.id(), kTag, "endpoint a", deadline_after(5s));
  p.b.send(b_again, 0, pattern(7, 7), deadline_after(5s));
  EXPECT_EQ(p.a.receive(again, 0, deadline_after(5s)), pattern(7, 7));
  p.a.send(again, 0, pattern(8, 8), deadline_after(5s));
  EXPECT_EQ(p.b.receive(b_again, 0, deadline_after(5s)), pattern(8, 8));
}

TEST(LocalSocket, ADestroyedEndpointIsLostAtOnce) {
  auto a = std::make_unique<LocalSocketEndpoint>(kTag);
  LocalSocketEndpoint b(kTag);
  LinkId a_to_b = a->connect(b.id(), kTag, "endpoint b", deadline_after(5s));
  LinkId b_to_a = b.connect(a->id(), kTag, "endpoint a", deadline_after(5s));
  a->send(a_to_b, 0, pattern(4, 4), deadline_after(5s));
  a.reset();
  EXPECT_EQ(b.receive(b_to_a, 0, deadline_after(5s)), pattern(4, 4));
  const auto start = Clock::now();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { b.receive(b_to_a, 0, deadline_after(30s)); }, &message), ErrorKind::kPeerLost);
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_NE(message.find("endpoint a"), std::string::npos) << message;
}

TEST(LocalSocket, RejectsUnknownLinks) {
  LocalSocketEndpoint a(kTag);
  EXPECT_EQ(error_kind_of([&] { a.send(42, 0, Bytes{}, deadline_after(1s)); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { a.receive(42, 0, deadline_after(1s)); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { a.disconnect(42); }), ErrorKind::kInvalidArgument);
  EXPECT_FALSE(a.alive(42));
}

// Raw connections that do not speak the protocol are closed; the endpoint keeps working.
TEST(LocalSocket, SurvivesMalformedConnections) {
  Pair p;
  const std::string name = p.b.socket_name().substr(1);
  auto raw = [&](const Bytes& bytes) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, name.data(), name.size());
    socklen_t length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), length), 0) << std::strerror(errno);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    std::this_thread::sleep_for(20ms);
    ::close(fd);
  };
  raw(Bytes{'G', 'E', 'T', ' ', '/', '\n', 0, 0, 0, 0});
  raw(Bytes{0xff, 0xff, 0xff, 0xff, 1, 0});  // a 4 GiB frame
  raw(Bytes{1, 0});                          // half a header, then closed
  p.a.send(p.a_to_b, 0, pattern(12, 12), deadline_after(5s));
  EXPECT_EQ(p.b.receive(p.b_to_a, 0, deadline_after(5s)), pattern(12, 12));
  EXPECT_TRUE(p.b.alive(p.b_to_a));
}

// A forked peer: its endpoint id comes over the pipe, it links back, then follows `script`.
struct PeerProcess {
  explicit PeerProcess(const std::function<void(LocalSocketEndpoint&, LinkId, Pipe&)>& script)
      : child([script](Pipe& pipe) {
          LocalSocketEndpoint endpoint(kTag);
          put_id(pipe, endpoint.id());
          EndpointId parent = get_id(pipe);
          LinkId link = endpoint.connect(parent, kTag, "the test process", deadline_after(10s));
          require(pipe.get_byte() == 7, "the test process did not connect");  // before the script may exit
          script(endpoint, link, pipe);
        }) {
    EndpointId peer = get_id(child.pipe());
    put_id(child.pipe(), self.id());
    link = self.connect(peer, kTag, "source rank 1", deadline_after(10s));
    child.pipe().put_byte(7);
  }
  // The child is forked first, so that it inherits none of our endpoint's sockets (a copy held
  // by another process would keep a connection open after we die).
  Child child;
  LocalSocketEndpoint self{kTag};
  LinkId link = 0;
};

TEST(LocalSocketProcesses, DeliversMessagesBothWaysBetweenProcesses) {
  PeerProcess peer([](LocalSocketEndpoint& endpoint, LinkId link, Pipe& pipe) {
    for (int i = 0; i < 30; ++i) {
      Bytes got = endpoint.receive(link, 0, deadline_after(20s));
      require(got == pattern(message_size(i), i), "message " + std::to_string(i) + " differs");
      endpoint.send(link, 0, pattern(message_size(i), 100 + i), deadline_after(20s));
    }
    pipe.put_byte(1);
    pipe.get_byte();
  });
  for (int i = 0; i < 30; ++i) {
    peer.self.send(peer.link, 0, pattern(message_size(i), i), deadline_after(20s));
    EXPECT_EQ(peer.self.receive(peer.link, 0, deadline_after(20s)), pattern(message_size(i), 100 + i)) << i;
  }
  EXPECT_EQ(peer.child.pipe().get_byte(), 1);
  peer.child.pipe().put_byte(0);
  EXPECT_EQ(peer.child.wait(), 0);
}

TEST(LocalSocketProcesses, AKilledPeerEndsAWaitAtOnceNamingIt) {
  PeerProcess peer([](LocalSocketEndpoint& endpoint, LinkId link, Pipe& pipe) {
    endpoint.send(link, 0, pattern(3, 1), deadline_after(5s));
    pipe.put_byte(1);
    pause();
  });
  EXPECT_EQ(peer.child.pipe().get_byte(), 1);
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    peer.child.kill();
  });
  // The message sent before the kill still arrives; then the loss, long before the deadline.
  EXPECT_EQ(peer.self.receive(peer.link, 0, deadline_after(30s)), pattern(3, 1));
  const auto start = Clock::now();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { peer.self.receive(peer.link, 0, deadline_after(30s)); }, &message),
            ErrorKind::kPeerLost);
  killer.join();
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_NE(message.find("source rank 1"), std::string::npos) << message;
  EXPECT_NE(message.find("exited or was killed"), std::string::npos) << message;
  EXPECT_FALSE(peer.self.alive(peer.link));
  EXPECT_EQ(error_kind_of([&] { peer.self.send(peer.link, 0, pattern(8, 8), deadline_after(5s)); }, &message),
            ErrorKind::kPeerLost);
  EXPECT_NE(message.find("source rank 1"), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] { peer.self.check_alive(peer.link, "reading bucket 3"); }, &message),
            ErrorKind::kPeerLost);
  EXPECT_NE(message.find("reading bucket 3"), std::string::npos) << message;
}

TEST(LocalSocketProcesses, APeerThatExitsWithoutClosingIsLost) {
  PeerProcess peer([](LocalSocketEndpoint& endpoint, LinkId link, Pipe&) {
    endpoint.send(link, 0, pattern(9, 9), deadline_after(5s));
    // Sockets are closed by the kernel, with no BYE.
    _exit(0);
  });
  EXPECT_EQ(peer.self.receive(peer.link, 0, deadline_after(10s)), pattern(9, 9));
  EXPECT_EQ(error_kind_of([&] { peer.self.receive(peer.link, 0, deadline_after(30s)); }), ErrorKind::kPeerLost);
}

TEST(LocalSocketProcesses, SendTimesOutOnAStoppedPeerThenRefusesTheTornStream) {
  PeerProcess peer([](LocalSocketEndpoint&, LinkId, Pipe& pipe) {
    pipe.put_byte(1);
    pause();
  });
  EXPECT_EQ(peer.child.pipe().get_byte(), 1);
  peer.child.stop();  // its thread no longer reads: the socket buffer fills
  Bytes big = pattern(64u << 20, 1);
  const auto start = Clock::now();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { peer.self.send(peer.link, 0, big, deadline_after(300ms)); }, &message),
            ErrorKind::kTimeout);
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_NE(message.find("source rank 1"), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] { peer.self.send(peer.link, 0, pattern(8, 1), deadline_after(1s)); }, &message),
            ErrorKind::kTransport);
  EXPECT_NE(message.find("torn"), std::string::npos) << message;
}

TEST(LocalSocketProcesses, AKilledPeerIsSeenWithoutWaitingOnIt) {
  // The loss shows on our own link too (the peer never sent anything).
  PeerProcess peer([](LocalSocketEndpoint&, LinkId, Pipe& pipe) {
    pipe.put_byte(1);
    pause();
  });
  EXPECT_EQ(peer.child.pipe().get_byte(), 1);
  EXPECT_TRUE(peer.self.alive(peer.link));
  peer.child.kill();
  const auto deadline = deadline_after(5s);
  while (peer.self.alive(peer.link) && !expired(deadline)) std::this_thread::sleep_for(1ms);
  EXPECT_FALSE(peer.self.alive(peer.link));
  EXPECT_EQ(error_kind_of([&] { peer.self.try_receive(peer.link, 0); }), ErrorKind::kPeerLost);
}

TEST(LocalPeerAddress, RoundTripsAndRejectsForeignBlobs) {
  LocalPeerAddress address;
  address.endpoint = random_id();
  address.identity = local_identity();
  address.device = 3;
  address.bus_id = "0000:19:00.0";
  Bytes blob = encode_local_peer_address("RFCI", address);
  LocalPeerAddress back = decode_local_peer_address("RFCI", "CUDA_IPC", blob, "source rank 0");
  EXPECT_EQ(back.endpoint, address.endpoint);
  EXPECT_EQ(back.identity.host, address.identity.host);
  EXPECT_EQ(back.identity.process, address.identity.process);
  EXPECT_EQ(back.identity.pid, address.identity.pid);
  EXPECT_EQ(back.device, 3);
  EXPECT_EQ(back.bus_id, "0000:19:00.0");

  std::string message;
  EXPECT_EQ(error_kind_of([&] { decode_local_peer_address("RFNC", "NCCL", blob, "source rank 0"); }, &message),
            ErrorKind::kProtocol);
  EXPECT_NE(message.find("source rank 0"), std::string::npos) << message;
  for (size_t cut : {size_t{0}, size_t{5}, blob.size() - 1}) {
    Bytes truncated(blob.begin(), blob.begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_EQ(error_kind_of([&] { decode_local_peer_address("RFCI", "CUDA_IPC", truncated, "x"); }),
              ErrorKind::kProtocol);
  }
  Bytes longer = blob;
  longer.push_back(0);
  EXPECT_EQ(error_kind_of([&] { decode_local_peer_address("RFCI", "CUDA_IPC", longer, "x"); }), ErrorKind::kProtocol);
}

TEST(LocalIdentity, IsStableInAProcessAndNewInAFork) {
  LocalIdentity mine = local_identity();
  EXPECT_EQ(local_identity().process, mine.process);
  EXPECT_FALSE(mine.host.empty());
  Child child([&](Pipe& pipe) {
    LocalIdentity theirs = local_identity();
    require(theirs.host == mine.host, "host differs in a fork");
    require(theirs.process != mine.process, "process token inherited by a fork");
    require(theirs.pid != mine.pid, "pid");
  });
  EXPECT_EQ(child.wait(), 0);
}

TEST(InitParams, RejectsUnknownKeysNamingThem) {
  InitParams params("CUDA_IPC", {{"device", "cuda:1"}, {"devcie", "cuda:0"}});
  EXPECT_EQ(params.get("device", "cuda"), "cuda:1");
  std::string message;
  EXPECT_EQ(error_kind_of([&] { params.finish(); }, &message), ErrorKind::kConfig);
  EXPECT_NE(message.find("backend_init_params.devcie"), std::string::npos) << message;
  EXPECT_NE(message.find("accepted: device, connect_timeout_s"), std::string::npos) << message;
  // A backend that reads a param the configuration table does not give it is refit's own bug.
  InitParams unlisted("CUDA_IPC", {});
  unlisted.seconds("timeout_s", 1.0);  // NCCL's, not CUDA_IPC's
  EXPECT_EQ(error_kind_of([&] { unlisted.finish(); }, &message), ErrorKind::kInternal);
  EXPECT_NE(message.find("'timeout_s', which the configuration table does not list"), std::string::npos) << message;

  InitParams seconds("NCCL", {{"timeout_s", "-1"}});
  EXPECT_EQ(error_kind_of([&] { seconds.seconds("timeout_s", 1.0); }), ErrorKind::kConfig);
  EXPECT_EQ(error_kind_of([&] { parse_gpu_device_param("CUDA_IPC", "cpu"); }, &message), ErrorKind::kConfig);
  EXPECT_NE(message.find("use backend_name UCX"), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] { parse_gpu_device_param("CUDA_IPC", "gpu0"); }), ErrorKind::kConfig);
  EXPECT_EQ(parse_gpu_device_param("NCCL", "cuda:2").index, 2);
}

}  // namespace
}  // namespace refit
