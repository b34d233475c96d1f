// The nixl scope's rows of the configuration table, from the parser's own key list (config.cpp),
// for config_keys() (config_keys.cpp).
#pragma once

#include <vector>

#include "refit/config_keys.h"

namespace refit {

std::vector<ConfigKey> nixl_config_rows();

}  // namespace refit
