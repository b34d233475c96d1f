// One peer an engine exchanges bytes with: a destination of a source, or a source of a
// destination. The engine makes it at init from the peer's metadata (both ends derive the same
// bucket size, refit numbers and way of taking source memory); the link's LinkSender or
// LinkReader works from it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "engine/assembler.h"
#include "engine/manifest_cache.h"
#include "engine/protocol.h"
#include "refit/deadline.h"
#include "refit/ext/device_memory.h"
#include "refit/ext/transport.h"

namespace refit {

struct Link {
  Transport* transport = nullptr;
  PeerId peer = 0;
  std::string label;                  // "source rank 3 on host h2"
  uint32_t peer_rank = 0;             // its rank among the sources (or destinations)
  protocol::EngineMetadata metadata;  // the peer's
  uint64_t first_refit = 0;           // protocol::first_refit(); refit k is first_refit + k on the wire
  uint64_t bucket_bytes = 0;          // of this link
  uint64_t offset = 0;                // of the link's two buffers in our transfer region
  std::byte* buffers[2] = {};         // the two buffers, there
  RegionId region = 0;                // our transfer region
  // How the destination takes what the source leaves in its own memory (protocol::link_access).
  SourceAccess access = SourceAccess::kNone;
  double timeout_s = 0;
  bool verify_checksums = false;

  // On a destination: the source's transfer region mapped (null: read into our buffers), host
  // memory page-locked; the source memory its in-place entries lie in, mapped, by (address,
  // key); the manifests its source may replay. Kept across refits (LinkReader).
  const std::byte* mapped = nullptr;
  HostPin mapped_pin;
  std::map<std::pair<uint64_t, Bytes>, const std::byte*> in_place_maps;
  ManifestCache manifests;

  // Delta refit: on a source, the version its destination holds from us (as far as we know); on
  // a destination, what the link carries reassembled (chunks of changes, pieces) before patching.
  uint64_t weights_version = 0;
  std::unique_ptr<TensorAssembler> wire;

  uint64_t buffer_offset(int b) const { return offset + static_cast<uint64_t>(b) * bucket_bytes; }
  // The deadline of a wait on the link (a message, a copy) that starts now.
  Deadline next_deadline() const { return deadline_after(std::chrono::duration<double>(timeout_s)); }
};

}  // namespace refit
