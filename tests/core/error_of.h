// Runs `f`, expects it to throw refit::Error of `kind`, and returns the message (empty, with a
// test failure, when nothing was thrown).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "refit/error.h"

namespace refit::testing {

template <typename F>
std::string error_of(ErrorKind kind, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return {};
}

}  // namespace refit::testing
