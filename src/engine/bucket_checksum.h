// The checksum a bucket carries with verify_checksums (BucketReady::checksum), computed alike by
// the source before it announces the bucket and by the destination before it loads it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "engine/protocol.h"

namespace refit {

// xxh3-64 of each entry's bytes, in entry order, wherever they lie (`at(k)` gives entry k's): what
// the destination loads, not what happened to travel.
uint64_t bucket_checksum(const protocol::Manifest& m, const std::function<const std::byte*(size_t entry)>& at);

}  // namespace refit
