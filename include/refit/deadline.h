// Every wait in refit has a deadline. A Deadline is a point on the steady clock; waits that pass
// it throw Error(kTimeout) naming what was awaited.
#pragma once

#include <chrono>

namespace refit {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(std::chrono::duration<double> timeout) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
}

inline bool expired(Deadline deadline) { return Clock::now() >= deadline; }

}  // namespace refit
