// A test hook: a transport that wraps another and corrupts what it reads, to prove that
// `verify_checksums` catches corruption in flight. It is switched on only by the environment
// variable REFIT_TEST_FLIP_READ_BYTES=N (flip one byte of every N-th non-empty read), checked
// when a transport is created, and it says so in the log.
#pragma once

#include <memory>

#include "refit/ext/transport.h"

namespace refit {

std::unique_ptr<Transport> maybe_inject_faults(std::unique_ptr<Transport> transport);

// Wraps `inner` so that every `every`-th non-empty read has one byte flipped.
std::unique_ptr<Transport> flip_read_bytes(std::unique_ptr<Transport> inner, uint64_t every);

}  // namespace refit
