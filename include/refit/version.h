// refit's version: the one number that the library, the `refit` command, the CMake package and
// the Python package report (CMakeLists.txt reads it from here; a test checks pyproject.toml).
#pragma once

namespace refit {

inline constexpr const char* kVersionString = "0.1.0";

}  // namespace refit
