// Helpers for tests that expect a refit::Error.
#pragma once

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "refit/error.h"

namespace refit::testing {

// Runs `f`, expects it to throw refit::Error of `kind`, and returns the message (empty, with a
// test failure, when nothing was thrown).
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

// Runs `f` and returns the kind of the refit::Error it throws (its message in `message`); throws
// std::runtime_error when `f` returns normally.
template <typename F>
ErrorKind error_kind_of(F&& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    return e.kind();
  }
  throw std::runtime_error("expected refit::Error, nothing was thrown");
}

}  // namespace refit::testing
