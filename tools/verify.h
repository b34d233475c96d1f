// Checking a refit as the tools do: every destination must hold exactly the tensors its source
// reported (names and xxh3 hashes, from the worker programs' reports).
#pragma once

#include <string>
#include <vector>

#include "refit/synchronizer.h"

namespace refit::tools {

// One line per problem; empty when every destination matches its source.
std::vector<std::string> verify(const RefitReport& report);

}  // namespace refit::tools
