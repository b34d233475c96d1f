// Delta refit's schedule (docs/DELTA.md), one set of constants for the engine that runs it
// (engine/checkpoint_engine.cpp, delta/link_delta.h) and the planner's pipeline model that runs it
// (planner/prediction.cpp, pack_stream).
#pragma once

#include <cstddef>
#include <cstdint>

namespace refit::delta_schedule {

// A source sends a bucket of changes once it holds this much, so that its destination patches
// while the source compares on: a few round trips per refit at most.
inline constexpr uint64_t kBucketBytes = uint64_t{1} << 20;

// Tensors a source compares together (GPU tensors, or host tensors where its pool has threads):
// a batch goes once it holds this many tensors or bytes. On a GPU two waits a batch, not two a
// tensor (~50 us each on one H100), with the scratch for their changes bounded (up to 24 bytes a
// changed element).
inline constexpr size_t kBatchTensors = 64;
inline constexpr uint64_t kBatchBytes = uint64_t{64} << 20;

}  // namespace refit::delta_schedule
