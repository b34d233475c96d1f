// How many threads a host pool (memory/host_copy_pool.h) adds to its caller's on a host of `cores`
// cores: none under 8 cores, where the other processes of a refit need them, else a quarter of
// them, at most 8. The engine's rule, which the planner models delta's host work by.
#pragma once

#include <algorithm>

namespace refit {

inline constexpr int kMaxHostPoolThreads = 8;

inline int host_pool_threads(int cores) { return cores < 8 ? 0 : std::min(cores / 4, kMaxHostPoolThreads); }

// This process's count: REFIT_HOST_COPY_THREADS when set (0-64), else host_pool_threads() of this
// host's cores. Throws Error(kConfig) naming the variable when it is set to anything else.
int host_copy_threads();

}  // namespace refit
