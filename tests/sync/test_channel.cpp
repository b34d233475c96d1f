// The driver-worker channel (src/sync/channel.cpp): its frames are a little-endian u64 length then
// CBOR, encoded and decoded with the wire codec (channel_frame.h); a malformed frame is
// Error(kProtocol) naming the peer; receive() and send() both honour their deadline.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "core/error_of.h"
#include "sync/channel.h"
#include "sync/channel_frame.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using testing::error_of;
using ::testing::HasSubstr;
using json = nlohmann::json;

struct SocketPair {
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0); }
  int fds[2] = {-1, -1};
};

void write_all(int fd, const std::vector<uint8_t>& bytes) {
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

// A body of the CBOR with its length, then the raw values (none here).
std::vector<uint8_t> body_of(const std::vector<uint8_t>& cbor, std::initializer_list<std::vector<uint8_t>> raw = {}) {
  std::vector<uint8_t> body;
  auto put = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) body.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  put(cbor.size());
  body.insert(body.end(), cbor.begin(), cbor.end());
  put(raw.size());
  for (const auto& r : raw) {
    put(r.size());
    body.insert(body.end(), r.begin(), r.end());
  }
  return body;
}

TEST(ChannelFrame, IsALittleEndianLengthThenCborThenRawValues) {
  const json message = {{"cmd", "exit"}};
  const std::vector<uint8_t> body = body_of(json::to_cbor(message));
  ASSERT_LT(body.size(), 256u);
  const std::vector<uint8_t> frame = channel_frame::encode(message);
  std::vector<uint8_t> expected = {static_cast<uint8_t>(body.size()), 0, 0, 0, 0, 0, 0, 0};
  expected.insert(expected.end(), body.begin(), body.end());
  ASSERT_EQ(frame, expected);
  EXPECT_EQ(channel_frame::decode_length(std::span<const uint8_t, 8>(frame.data(), 8), "worker 1"), body.size());
  EXPECT_EQ(channel_frame::decode_body(std::span<const uint8_t>(frame).subspan(8), "worker 1"), message);
}

// Binary values of 1 KiB or more travel after the CBOR as they are (nlohmann's reader copies a
// binary a byte at a time), wherever they are nested, and come back in place; smaller ones stay in
// the CBOR.
TEST(ChannelFrame, LargeBinaryValuesTravelAfterTheCborAndComeBackInPlace) {
  std::vector<uint8_t> big(5000), other(1024);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < other.size(); ++i) other[i] = static_cast<uint8_t>(i * 13 + 1);
  const json message = {{"cmd", "init"},
                        {"session", json::binary({1, 2, 3})},
                        {"metadata", {json::binary(big), json::binary(other), json::binary({9})}},
                        {"nested", {{"deeper", json::binary(big)}}}};
  const std::vector<uint8_t> frame = channel_frame::encode(message);
  EXPECT_LT(frame.size(), 2 * big.size() + other.size() + 300) << "each large value once, raw";
  const std::span<const uint8_t> body = std::span<const uint8_t>(frame).subspan(8);
  // The CBOR at the front names them by index; the last raw value is `big` as it is.
  const uint64_t cbor_size = body[0] | (uint64_t{body[1]} << 8);
  const json cbor = json::from_cbor(body.subspan(8, cbor_size));
  EXPECT_EQ(cbor.at("metadata").at(0), (json{{"refit:raw", 0}}));
  EXPECT_EQ(cbor.at("metadata").at(2), json::binary({9}));
  EXPECT_TRUE(std::equal(big.begin(), big.end(), body.end() - static_cast<ptrdiff_t>(big.size())));
  EXPECT_EQ(channel_frame::decode_body(body, "worker 1"), message);
  // An index past the raw values is refused, naming the sender.
  const std::vector<uint8_t> bad = body_of(json::to_cbor(json{{"m", {{"refit:raw", 1}}}}), {{1, 2}});
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { channel_frame::decode_body(bad, "worker 3"); }),
              AllOf(HasSubstr("malformed channel message from worker 3"), HasSubstr("raw value 1 of 1")));
  // A message's own object of that shape would come back as bytes: the encoder refuses it.
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         channel_frame::encode(json{{"m", {{"refit:raw", 0}}}});
                       }),
              HasSubstr("'refit:raw' stands for raw bytes"));
  EXPECT_EQ(
      channel_frame::decode_body(
          std::span<const uint8_t>(channel_frame::encode(json{{"refit:raw", 0}, {"x", 1}})).subspan(8), "worker 1"),
      (json{{"refit:raw", 0}, {"x", 1}}))
      << "with other keys it is an object like any";
}

TEST(ChannelFrame, MalformedFramesAreProtocolErrorsNamingThePeer) {
  const std::vector<uint8_t> limit = {0, 0, 0, 0x40, 0, 0, 0, 0};  // 2^30, the largest body allowed
  EXPECT_EQ(channel_frame::decode_length(std::span<const uint8_t, 8>(limit.data(), 8), "worker 1"), 1u << 30);
  const std::vector<uint8_t> too_big = {1, 0, 0, 0x40, 0, 0, 0, 0};
  EXPECT_THAT(
      error_of(ErrorKind::kProtocol,
               [&] { channel_frame::decode_length(std::span<const uint8_t, 8>(too_big.data(), 8), "worker 1"); }),
      AllOf(HasSubstr("malformed channel frame from worker 1"), HasSubstr("1073741825")));
  for (const auto& garbage : {std::vector<uint8_t>{0xff, 0x00, 0x13}, body_of({0xff, 0x00, 0x13})})
    EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { channel_frame::decode_body(garbage, "worker 2"); }),
                HasSubstr("malformed channel message from worker 2"));
  std::vector<uint8_t> deep(200, 0x81);  // arrays of one element, nested 200 deep
  deep.push_back(0x00);
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { channel_frame::decode_body(body_of(deep), "worker 2"); }),
              AllOf(HasSubstr("malformed channel message from worker 2"), HasSubstr("nested deeper than 64")));
}

TEST(Channel, SendsAndReceivesFrames) {
  SocketPair pair;
  Channel a(pair.fds[0], "worker 0");
  Channel b(pair.fds[1], "driver");
  const json message = {{"cmd", "init"}, {"metadata", json::binary({1, 2, 3})}, {"train", 2}};
  a.send(message, deadline_after(std::chrono::seconds(5)));
  EXPECT_EQ(b.receive(deadline_after(std::chrono::seconds(5))), message);
}

TEST(Channel, ReceiveRefusesAMalformedFrameNamingThePeer) {
  SocketPair pair;
  Channel channel(pair.fds[0], "worker 4");
  write_all(pair.fds[1], {3, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff});
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { channel.receive(deadline_after(std::chrono::seconds(5))); }),
              HasSubstr("worker 4"));
  ::close(pair.fds[1]);
}

TEST(Channel, ReceiveHonoursItsDeadline) {
  SocketPair pair;
  Channel channel(pair.fds[0], "worker 5");
  write_all(pair.fds[1], {8, 0, 0, 0, 0, 0, 0, 0, 0xa1});  // a frame cut short
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(error_of(ErrorKind::kTimeout, [&] { channel.receive(deadline_after(std::chrono::milliseconds(200))); }),
              HasSubstr("worker 5"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  ::close(pair.fds[1]);
}

TEST(Channel, SendHonoursItsDeadlineWhenThePeerReadsNothing) {
  SocketPair pair;
  int small = 4096;
  ::setsockopt(pair.fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  Channel channel(pair.fds[0], "worker 6");
  // Far more than the socket buffers hold: the send must give up at its deadline.
  const json message = {{"blob", json::binary(std::vector<uint8_t>(64 << 20, 1))}};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(
      error_of(ErrorKind::kTimeout, [&] { channel.send(message, deadline_after(std::chrono::milliseconds(300))); }),
      HasSubstr("worker 6"));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(250));
  EXPECT_LT(took, std::chrono::seconds(5));
  ::close(pair.fds[1]);
}

}  // namespace
}  // namespace refit
