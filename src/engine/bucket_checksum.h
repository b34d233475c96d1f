// The checksum a bucket carries with verify_checksums (BucketReady::checksum), computed alike by
// the source before it announces the bucket and by the destination before it loads it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "engine/protocol.h"

namespace refit {

// xxh3-64 of the bucket's `used` bytes (a bucket of spans: of each span's bytes, which
// `span(k)` gives for span k, or, without it, `used` at the span's bucket offset), then of each
// in-place entry's bytes (which `in_place(k)` gives for entry k), in entry order.
uint64_t bucket_checksum(const protocol::BucketReady& m, const std::byte* used,
                         const std::function<const std::byte*(size_t entry)>& in_place,
                         const std::function<const std::byte*(size_t span)>& span = nullptr);

}  // namespace refit
