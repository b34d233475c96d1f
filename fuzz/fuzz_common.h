// Shared by the libFuzzer targets: an oracle check that aborts (so libFuzzer records the input),
// and the one way a decoder may refuse input: refit::Error of kind kProtocol (kModel for a
// safetensors header), whose message names what was decoded.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "refit/error.h"

#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

// A decoder refused its input: it must say so as a protocol error, nothing else.
#define FUZZ_EXPECT_PROTOCOL_ERROR(e)                                                                         \
  do {                                                                                                        \
    if ((e).kind() != refit::ErrorKind::kProtocol) {                                                          \
      std::fprintf(stderr, "fuzz: unexpected error kind %d: %s\n", static_cast<int>((e).kind()), (e).what()); \
      std::abort();                                                                                           \
    }                                                                                                         \
  } while (0)

// A decoder refused its input: with `kind_`, and a message that holds `needle` (the label of what
// was decoded, e.g. "source rank 0").
#define FUZZ_EXPECT_ERROR(e, kind_, needle)                                                                   \
  do {                                                                                                        \
    if ((e).kind() != (kind_)) {                                                                              \
      std::fprintf(stderr, "fuzz: unexpected error kind %d: %s\n", static_cast<int>((e).kind()), (e).what()); \
      std::abort();                                                                                           \
    }                                                                                                         \
    if (std::strstr((e).what(), (needle)) == nullptr) {                                                       \
      std::fprintf(stderr, "fuzz: the error does not name '%s': %s\n", (needle), (e).what());                 \
      std::abort();                                                                                           \
    }                                                                                                         \
  } while (0)
