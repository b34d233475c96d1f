// Delta refit (refit_cfg.nixl.delta): a source remembers the bytes a destination last received
// on their link and, per tensor, sends only the elements that changed since
// (delta/codec.h); the destination keeps the same version and patches it, then hands its
// loader whole tensors as in any refit. Bit-exact: nothing is computed in floating point, and
// every patched tensor is checked against the checksum of the source's tensor. A link's tensors
// are what its destination holds of them: whole tensors, a layout's slices (packed first), or,
// resharding, the pieces the plan sends on the link, each under a name of its own
// (delta_piece_name), which the destination merges into its tensors once patched.
//
// Versions, per link: each refit's weights get a random 64-bit version. A destination declares,
// per source, the version it holds from it in its metadata (none: new, restarted, or its last
// refit failed); a source sends changes only when that is the version it last sent on the link
// and holds as its base, and everything whole otherwise (saying so). A link's first tensor,
// "refit:delta", says which version the changes apply to and which they make; a destination
// refuses changes to a version it does not hold, so a delta never applies twice or to the wrong
// weights. Both sides adopt the new version only when the whole refit went through; a failed one
// drops it (the next refit goes whole).
// Memory: each side holds one copy of what crosses the link, where the tensor lies (a source also
// keeps the slices or pieces it packs): tensors in GPU memory are compared, compacted and patched
// there by kernels (delta/device_delta.h), and only their changed elements cross to the host.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/delta_schedule.h"
#include "delta/codec.h"
#include "refit/checkpoint_engine.h"
#include "refit/ext/device_memory.h"
#include "refit/layout.h"
#include "refit/tensor.h"

namespace refit {

// The reserved name of a refit's delta header, and the prefix of a tensor sent as changes.
inline constexpr std::string_view kDeltaHeaderName = "refit:delta";
inline constexpr std::string_view kDeltaTensorPrefix = "refit:delta:";

// The name a resharding piece goes by on a delta link: the destination's tensor and where the
// piece lies in it, so that both ends name it alike from the plan.
std::string delta_piece_name(const std::string& tensor, const Box& box);

// The checksum of a tensor sent whole, by the hash of its name (the trailer's).
struct WholeSum {
  uint64_t name_hash = 0;
  DeltaChecksum kind = DeltaChecksum::kXxh3;
  uint64_t checksum = 0;
};

// What one delta refit sent or applied.
struct DeltaCounts {
  uint64_t tensors = 0;          // sent or arrived, as changes or whole (resharding: pieces)
  uint64_t changed_tensors = 0;  // of those, as changes (unchanged ones included)
  uint64_t record_bytes = 0;     // bytes of the change records
  // A destination's seconds, by step: records that arrived in GPU memory copied to the host, records
  // decoded (host tensors: and patched), GPU tensors patched and both checked, whole tensors copied.
  double to_host_seconds = 0, decode_seconds = 0, patch_seconds = 0, whole_seconds = 0;

  DeltaCounts& operator+=(const DeltaCounts& o) {
    tensors += o.tensors;
    changed_tensors += o.changed_tensors;
    record_bytes += o.record_bytes;
    to_host_seconds += o.to_host_seconds;
    decode_seconds += o.decode_seconds;
    patch_seconds += o.patch_seconds;
    whole_seconds += o.whole_seconds;
    return *this;
  }
};

// A source's side: the base (what its destination holds) and the stream that turns each tensor of
// a refit into its changes or itself.
class DeviceDelta;
class HostCopyPool;

// One tensor's version as a side of the link holds it: in host memory, or a device copy.
struct HeldTensor {
  TensorInfo info;
  MemoryKind memory = MemoryKind::kHost;
  std::vector<std::byte> bytes;  // host
  DeviceBuffer device;           // GPU: rounded up to whole words

  // A destination's host copy is what its loader reads (instead of the transfer buffer), so it is
  // page-locked like the buffers when a GPU is usable: loads into GPU tensors then run at PCIe
  // speed (on one H100, 2.2 GiB from pageable copies took 0.27 s).
  HostPin pin;
  const std::byte* pin_tried = nullptr;  // the bytes `pin` was tried on

  std::byte* data() { return memory == MemoryKind::kHost ? bytes.data() : device.data(); }
  // Holds a copy of `view`'s bytes (in its memory) from now on; `page_lock`: a host copy is pinned.
  void assign(const TensorView& view, DeviceDelta& gpu, bool page_lock = false);
  // The checksum of what it holds, of `kind`.
  uint64_t checksum(DeltaChecksum kind, DeviceDelta& gpu);
};

// Boxes of tensors packed into buffers of their own (in the tensor's memory), kept from one
// refit to the next by name: a delta refit compares what a destination holds, so a source packs
// a slice or a resharding piece before it compares. A whole box is not copied: its view is
// yielded under the name asked for.
class PackedBoxes {
 public:
  explicit PackedBoxes(double timeout_s) : timeout_s_(timeout_s) {}
  // `info`: the name and shape the packed box goes by. Valid until the same name is packed again.
  TensorView pack(const TensorView& view, const Box& box, const TensorInfo& info, CopyStream& copies);

 private:
  struct Packed {
    TensorInfo info;
    std::vector<std::byte> host;
    DeviceBuffer device;  // on the calling thread's current GPU
  };
  const double timeout_s_;
  std::map<std::string, Packed, std::less<>> packed_;
};

// A source's side of one link: the base (what its destination holds) and, per refit, each
// tensor turned into its changes or left whole. A refit sends begin()'s header, what add() and
// flush() make of its tensors, then end()'s trailer; every view they return lives until the next
// begin(), so the views outlive send() whenever the caller's do.
class SourceDelta {
 public:
  // `timeout_s`: how long packing a box on the GPU may take.
  explicit SourceDelta(double timeout_s = 300);
  ~SourceDelta();
  // `destination_version`: what the destination holds (from its metadata, or the last refit that
  // went through on this connection). Starts a refit that makes a fresh version, and returns its
  // header: changes go where the destination holds the base, else every tensor goes whole.
  // `measured` (delta: auto): changes only when the last refit sent that way took less time than
  // the last one sent whole (or has not been measured yet); the slower way is measured again
  // every kRemeasureEvery refits.
  TensorView begin(uint64_t destination_version, const std::string& destination, bool measured = false);
  // What to send of `box` of `view`, which the destination holds as `info` (its name and shape; a
  // box that is not the tensor as it is gets packed first, on `copies`): its changes against the
  // base, or itself (the base becomes it either way). Tensors that stay valid until send()
  // returns (`outlives`; packed ones are ours) wait to be compared in batches (core/delta_schedule.h) if they are GPU
  // tensors (their records written on `pool`'s threads, the engine's), or host tensors and `pool` has threads (scanned
  // on them); any other goes at once, with those waiting before it. Returns the views ready, in order (the span is
  // valid until the next add() or flush()).
  std::span<const TensorView> add(const TensorView& view, const Box& box, const TensorInfo& info, bool outlives,
                                  CopyStream& copies, HostCopyPool& pool);
  // The views still waiting, made ready.
  std::span<const TensorView> flush(HostCopyPool& pool);
  // The trailer: how many tensors the refit sent.
  TensorView end();
  // The refit went through in `seconds`: the destination now holds this refit's version, which it
  // returns.
  uint64_t commit(double seconds);
  // The refit failed: the base may be half updated, so the next refit goes whole.
  void drop();

  const DeltaCounts& counts() const { return counts_; }

 private:
  struct Record {
    TensorInfo info;
    std::vector<uint8_t> bytes;
  };
  TensorView add_record(TensorInfo info, std::vector<uint8_t> bytes);
  // What to send of each of `views`, in `out` in the same order; the GPU tensors among them are
  // compared together (two waits a call, not a tensor), the host tensors compared or copied whole
  // into their bases on `pool`'s threads. A name twice in one call is refused (its base would be
  // updated twice at once).
  void next(std::span<const TensorView> views, std::vector<TensorView>& out, HostCopyPool& pool);
  DeviceDelta& gpu();

  static constexpr int kRemeasureEvery = 8;
  // A host tensor of two parts or more is compared in parts of this size on the pool's threads.
  static constexpr uint64_t kScanPartBytes = 16 << 20;
  PackedBoxes packed_;
  std::vector<TensorView> waiting_, ready_;
  // The infos of the views that waited, kept until the next begin(): the stream's may not outlive
  // its next tensor, and a view made ready goes by its info after flush() returns.
  std::deque<TensorInfo> infos_;
  uint64_t waiting_bytes_ = 0;
  double seconds_[2] = {-1, -1};  // the last refit sent whole [0] and as changes [1]; -1: none yet
  bool changes_now_ = false;      // this refit sends changes
  int since_measured_ = 0;        // refits since the slower way was last measured

  std::map<std::string, HeldTensor, std::less<>> base_;
  std::unique_ptr<DeviceDelta> gpu_;  // made at the first tensor in GPU memory
  // The host scans' buffers, kept from tensor to tensor: one set for each scan at once.
  std::vector<std::unique_ptr<DeltaScratch>> scratch_;
  std::mutex scratch_mutex_;
  uint64_t base_version_ = 0;  // 0: none
  uint64_t next_version_ = 0;
  DeltaCounts counts_;
  std::vector<WholeSum> whole_;  // of this refit's tensors sent whole
  std::deque<Record> records_;   // of this refit; a deque: views of earlier records stay valid
};

// A destination's side: the version it holds (a copy of every tensor it received) and the
// patching of each batch before the loader sees it.
class DestinationDelta {
 public:
  DestinationDelta();
  ~DestinationDelta();
  // What to declare in the metadata: 0 unless the last refit went through.
  uint64_t version() const { return version_; }
  // A refit starts; what we hold stays valid until its header arrives.
  void begin();
  // Turns a batch as received into the batch the loader gets: the header is checked and left out,
  // changes are applied to the held copy, whole tensors are copied into it, and every tensor is
  // handed out as the copy holds it, so that nothing handed out lies in `in` (the transfer buffer
  // can go back at once). `owners` is parallel to `views` (null for a view into our copy). `who`
  // names the source in errors.
  // Host copies are checked on `pool` (the engine's: one for all its links).
  void transform(std::span<const TensorView> in, std::span<const std::shared_ptr<const void>> in_owners,
                 std::vector<TensorView>& out, std::vector<std::shared_ptr<const void>>& owners, const std::string& who,
                 HostCopyPool& pool);
  // The refit went through: checks that the header came and that as many tensors as it announced
  // arrived, then holds the new version.
  void finish(const std::string& who, HostCopyPool& pool);
  void drop() { version_ = 0; }

  const DeltaCounts& counts() const { return counts_; }

 private:
  DeviceDelta& gpu();
  // Throws Error(kIntegrity) unless `now`, the checksum of the patched tensor `name`, is the source's.
  static void check_patched(std::string_view name, const DeltaHeader& h, uint64_t now, const std::string& who);

  std::map<std::string, HeldTensor, std::less<>> held_;
  std::unique_ptr<DeviceDelta> gpu_;
  uint64_t version_ = 0;  // of held_; 0 while a refit rewrites it
  bool header_seen_ = false;
  bool ended_ = false;
  uint64_t new_version_ = 0;
  uint64_t announced_ = 0;                                        // tensors the trailer says came
  std::vector<std::pair<const std::string, HeldTensor>*> whole_;  // this refit's, as they landed in held_
  std::vector<WholeSum> announced_whole_;                         // the trailer's checksums of them
  uint64_t arrived_ = 0;
  DeltaCounts counts_;
};

}  // namespace refit
