// The defaults of Transport's many-peer services, for backends that have nothing better.
#include <algorithm>
#include <thread>

#include "refit/transport.h"

namespace refit {
namespace {
// A backend without an activity count is polled this often: short next to any bucket's read.
constexpr auto kPollSlice = std::chrono::microseconds(200);
}  // namespace

std::optional<Bytes> Transport::try_receive(PeerId peer) {
  try {
    return receive(peer, Clock::now());
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kTimeout) return std::nullopt;
    throw;
  }
}

void Transport::wait_activity(uint64_t, Deadline deadline) {
  std::this_thread::sleep_until(std::min(deadline, Clock::now() + kPollSlice));
}

}  // namespace refit
