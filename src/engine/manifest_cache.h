// The destination's side of manifest replay (protocol::BucketReady::replay_of): the manifests of
// a link's latest refit whose every bucket arrived, kept across the refits of one connection, so
// that a source that repeats a bucket of that refit sends only its number. A source replays only
// the refit before, and only once the destination acknowledged all of it: then this cache holds
// exactly that refit, and anything else a source names is a protocol error.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/protocol.h"

namespace refit {

class ManifestCache {
 public:
  // Takes a bucket of refit `refit` as it arrives. A replayed one gets the manifest it names;
  // Error(kProtocol), naming `who`, when this cache does not hold it or it came for another place
  // in the source's buffers. Buckets 0, 1, ... in order are collected with their manifests, and
  // the last one makes them the cache.
  void take(uint64_t refit, protocol::BucketReady& bucket, const std::string& who);

 private:
  struct Bucket {
    std::shared_ptr<const protocol::Manifest> manifest;
    uint64_t offset = 0;
    uint64_t used_bytes = 0;
  };
  std::optional<uint64_t> refit_;  // the refit the cache holds; none yet
  std::vector<Bucket> buckets_;    // by bucket number
  // Buckets 0, 1, ... of refit arriving_refit_ that arrived so far (an empty list takes bucket 0 of any refit).
  uint64_t arriving_refit_ = 0;
  std::vector<Bucket> arriving_;
};

}  // namespace refit
