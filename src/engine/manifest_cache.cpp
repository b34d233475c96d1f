#include "engine/manifest_cache.h"

#include "core/fail.h"

namespace refit {

void ManifestCache::take(uint64_t refit, protocol::BucketReady& bucket, const std::string& who) {
  if (bucket.replay_of) {
    if (refit_ != bucket.replay_of || bucket.seq >= buckets_.size())
      fail(ErrorKind::kProtocol,
           "{} replayed the manifest of bucket {} of refit {}, which this destination does not have (it has {} "
           "bucket(s) of {})",
           who, bucket.seq, *bucket.replay_of, buckets_.size(),
           refit_ ? fmt::format("refit {}", *refit_) : std::string("no refit"));
    const Bucket& cached = buckets_[bucket.seq];
    // The manifest was validated against this place when it came.
    if (cached.offset != bucket.offset || cached.used_bytes != bucket.used_bytes)
      fail(ErrorKind::kProtocol,
           "{} replayed the manifest of bucket {} for [{}, +{}) of its buffers, but that manifest came for [{}, +{})",
           who, bucket.seq, bucket.offset, bucket.used_bytes, cached.offset, cached.used_bytes);
    bucket.manifest = cached.manifest;
  }
  // Only buckets 0, 1, ... of one refit, in order, make a cache.
  if (arriving_refit_ != refit || bucket.seq != arriving_.size()) {
    arriving_.clear();
    if (bucket.seq != 0) return;
    arriving_refit_ = refit;
  }
  arriving_.push_back({bucket.manifest, bucket.offset, bucket.used_bytes});
  if (!bucket.is_last) return;
  refit_ = refit;
  buckets_ = std::move(arriving_);
  arriving_.clear();
}

}  // namespace refit
