// The median of a list of measurements (0 for none): how the tools report repeated runs.
#pragma once

#include <algorithm>
#include <vector>

namespace refit::tools {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace refit::tools
