#include "engine/bucket_checksum.h"

#include <xxhash.h>

namespace refit {

uint64_t bucket_checksum(const protocol::BucketReady& m, const std::byte* used,
                         const std::function<const std::byte*(size_t entry)>& in_place,
                         const std::function<const std::byte*(size_t span)>& span) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  const auto& spans = m.spans();
  if (spans.empty()) XXH3_64bits_update(state, used, m.used_bytes);
  for (size_t k = 0; k < spans.size(); ++k)
    XXH3_64bits_update(state, span ? span(k) : used + spans[k].bucket_offset, spans[k].size);
  const auto& entries = m.entries();
  for (size_t k = 0; k < entries.size(); ++k)
    if (entries[k].region > 0) XXH3_64bits_update(state, in_place(k), entries[k].size);
  const uint64_t sum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return sum;
}

}  // namespace refit
