#include "engine/bucket_checksum.h"

#include <xxhash.h>

namespace refit {

uint64_t bucket_checksum(const protocol::Manifest& m, const std::function<const std::byte*(size_t entry)>& at) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (size_t k = 0; k < m.entries.size(); ++k) XXH3_64bits_update(state, at(k), m.entries[k].size);
  const uint64_t sum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return sum;
}

}  // namespace refit
