// The default of Transport's wait for activity, for backends that keep no activity count.
#include <algorithm>
#include <thread>

#include "refit/ext/transport.h"

namespace refit {
namespace {
// A backend without an activity count is polled this often: short next to any bucket's read.
constexpr auto kPollSlice = std::chrono::microseconds(200);
}  // namespace

void Transport::wait_activity(uint64_t, Deadline deadline) {
  std::this_thread::sleep_until(std::min(deadline, Clock::now() + kPollSlice));
}

}  // namespace refit
