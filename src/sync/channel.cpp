#include "sync/channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "core/fail.h"
#include "core/wire.h"
#include "sync/channel_frame.h"

namespace refit {

namespace {

// The body is read in pieces, so a peer that announces a huge frame and sends little of it
// costs no more memory than it sent.
constexpr uint64_t kReadPiece = 16ull << 20;

// A SAX pass that accepts anything but nesting deeper than kMaxDepth.
struct DepthCheck : nlohmann::json_sax<nlohmann::json> {
  int depth = 0;
  bool too_deep = false;
  bool open() {
    too_deep = ++depth > channel_frame::kMaxDepth;
    return !too_deep;
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return --depth, true; }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override { return --depth, true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

}  // namespace

namespace channel_frame {
namespace {

// Large binary values travel after the CBOR, as they are: nlohmann's reader copies a binary value
// byte by byte, and a worker's init message carries every worker's metadata (~30 KB each for the
// default model's FSDP shards: with 128 sources, a fifth of all CPU during set-up went there). In the CBOR such a value
// is an object whose one key is kRawKey and whose value is its index among the raw blobs.
constexpr std::string_view kRawKey = "refit:raw";
constexpr size_t kMinRawBytes = 1024;

nlohmann::json without_raw(const nlohmann::json& j, std::vector<const std::vector<uint8_t>*>& raw) {
  if (j.is_binary() && j.get_binary().size() >= kMinRawBytes) {
    raw.push_back(&j.get_binary());
    return {{kRawKey, raw.size() - 1}};
  }
  if (j.is_object()) {
    if (j.size() == 1 && j.contains(kRawKey))  // would come back as raw bytes
      fail(ErrorKind::kInvalidArgument,
           "channel message: an object whose one key is '{}' stands for raw bytes on the channel; name the key "
           "otherwise",
           kRawKey);
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [key, value] : j.items()) out[key] = without_raw(value, raw);
    return out;
  }
  if (j.is_array()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& value : j) out.push_back(without_raw(value, raw));
    return out;
  }
  return j;
}

void with_raw(nlohmann::json& j, std::span<const std::span<const uint8_t>> raw, const std::string& peer) {
  if (j.is_object() && j.size() == 1 && j.contains(kRawKey)) {
    const nlohmann::json& index = j.at(kRawKey);
    if (!index.is_number_unsigned() || index.get<uint64_t>() >= raw.size())
      fail(ErrorKind::kProtocol, "malformed channel message from {}: raw value {} of {}", peer, index.dump(),
           raw.size());
    const auto bytes = raw[index.get<uint64_t>()];
    j = nlohmann::json::binary(std::vector<uint8_t>(bytes.begin(), bytes.end()));
    return;
  }
  if (j.is_structured())
    for (auto& value : j) with_raw(value, raw, peer);
}

}  // namespace

std::vector<uint8_t> encode(const nlohmann::json& message) {
  std::vector<const std::vector<uint8_t>*> raw;
  const std::vector<uint8_t> cbor = nlohmann::json::to_cbor(without_raw(message, raw));
  ByteWriter body;
  body.put_bytes<uint64_t>(cbor);
  body.put<uint64_t>(raw.size());
  for (const auto* bytes : raw) body.put_bytes<uint64_t>(*bytes);
  ByteWriter w;
  w.put_bytes<uint64_t>(body.take());
  return w.take();
}

uint64_t decode_length(std::span<const uint8_t, kLengthBytes> header, const std::string& peer) {
  ByteReader r(header, "channel frame from " + peer);
  const auto size = r.get<uint64_t>("length");
  if (size > kMaxBodyBytes)
    fail(ErrorKind::kProtocol, "malformed {}: field 'length' is {} bytes (the limit is {})", r.what(), size,
         kMaxBodyBytes);
  return size;
}

nlohmann::json decode_body(std::span<const uint8_t> body, const std::string& peer) {
  ByteReader r(body, "channel message from " + peer);
  const std::span<const uint8_t> cbor = r.get_bytes<uint64_t>("cbor");
  std::vector<std::span<const uint8_t>> raw(r.get_count<uint64_t>("raw values", sizeof(uint64_t)));
  for (auto& bytes : raw) bytes = r.get_bytes<uint64_t>("raw value");
  r.expect_end();
  DepthCheck check;
  if (!nlohmann::json::sax_parse(cbor, &check, nlohmann::json::input_format_t::cbor, false) && check.too_deep)
    fail(ErrorKind::kProtocol, "malformed channel message from {}: nested deeper than {} levels", peer, kMaxDepth);
  nlohmann::json message;
  try {
    message = nlohmann::json::from_cbor(cbor);
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorKind::kProtocol, "malformed channel message from {}: {}", peer, e.what());
  }
  with_raw(message, raw, peer);
  return message;
}

}  // namespace channel_frame

Channel::~Channel() { close(); }

Channel::Channel(Channel&& other) noexcept : fd_(std::exchange(other.fd_, -1)), peer_(std::move(other.peer_)) {}

Channel& Channel::operator=(Channel&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    peer_ = std::move(other.peer_);
  }
  return *this;
}

void Channel::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Channel::send(const nlohmann::json& message, Deadline deadline) {
  const std::vector<uint8_t> frame = channel_frame::encode(message);
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // The other end does not read (or its host is unreachable): wait for room, not forever.
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) fail(ErrorKind::kTimeout, "sending to {}: it took nothing for too long (deadline passed)", peer_);
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 100)));
      continue;
    }
    if (n < 0) fail(ErrorKind::kPeerLost, "cannot send to {}: {}", peer_, std::strerror(errno));
    sent += static_cast<size_t>(n);
  }
}

bool Channel::read_exact(void* out, size_t n, Deadline deadline, bool forever) {
  auto* p = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < n) {
    int wait_ms = -1;
    if (!forever) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      wait_ms = static_cast<int>(std::min<int64_t>(left, 1000));
    }
    pollfd pfd{fd_, POLLIN, 0};
    int r = poll(&pfd, 1, wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(ErrorKind::kIo, "poll on the channel to {}: {}", peer_, std::strerror(errno));
    if (r == 0) continue;
    ssize_t k = ::recv(fd_, p + got, n - got, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0)
      fail(ErrorKind::kPeerLost, "{} closed its channel{}", peer_,
           k < 0 ? fmt::format(" ({})", std::strerror(errno)) : "");
    got += static_cast<size_t>(k);
  }
  return true;
}

nlohmann::json Channel::receive_frame(Deadline deadline, bool forever) {
  std::array<uint8_t, channel_frame::kLengthBytes> header{};
  if (!read_exact(header.data(), header.size(), deadline, forever))
    fail(ErrorKind::kTimeout, "no answer from {} before the deadline", peer_);
  const uint64_t size = channel_frame::decode_length(header, peer_);
  std::vector<uint8_t> body;
  while (body.size() < size) {
    const size_t have = body.size();
    body.resize(have + std::min(kReadPiece, size - have));
    if (!read_exact(body.data() + have, body.size() - have, deadline, forever))
      fail(ErrorKind::kTimeout, "{} stopped mid-message", peer_);
  }
  return channel_frame::decode_body(body, peer_);
}

nlohmann::json Channel::receive(Deadline deadline) { return receive_frame(deadline, false); }
nlohmann::json Channel::receive_forever() { return receive_frame({}, true); }

}  // namespace refit
