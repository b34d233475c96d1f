// The checkpoint engine: one per worker process, on either side of a refit.
//
// Lifecycle (the reference's public contract):
//   prepare()            allocate and register the two transfer buffers (if not already),
//                        return this engine's metadata blob;
//   init_source(...) / init_destination(...)
//                        with every worker's metadata in order (sources first): validate the
//                        pairing and the peers' metadata, connect to the peer;
//   send(weights) / receive(loader)
//                        one refit; repeat as often as needed (a destination may instead pull
//                        the refit's batches itself: begin_receive() ... finish_receive());
//   finalize()           disconnect, telling the peers (their next refit of this connection
//                        fails at once, naming it); with release_after_refit also free the
//                        buffers. One prepare()'s metadata serves one connection: after
//                        finalize(), or an init that failed or replaced a connection, prepare()
//                        and exchange metadata again before the next init.
// Two topologies, chosen by what the sources declare (every peer reaches the same choice), each a
// transfer plan (transfer_plan.h) that gives every engine its links:
//  - paired (the reference's; paired_plan()): sources hold the whole model; source rank i sends to
//    destination rank i what its layout needs; sources without a destination drain their
//    weights and return;
//  - resharding: sources declare what they hold (EngineOptions::holds: their shards, no gather
//    on the training side); every engine computes the same transfer plan (transfer_plan.h) from
//    all layouts, and each destination reads its pieces from every source that has them, all at
//    once, while each source serves every destination that needs its bytes.
// The caller moves metadata between processes however it likes.
//
// Double buffering per link: the source packs bucket k+1 into one buffer while the destination
// reads bucket k from the other with a one-sided read; the destination tells the source when a
// buffer may be reused. In place (direct_reads): a destination on the source's host that can map
// the source's own tensors (CUDA IPC: any cudaMalloc memory; UCX: memory from
// allocate_weight_memory()) loads them straight from there, one copy per byte, and a bucket then
// only names them; the source keeps its registrations across refits and returns from send()
// once the destination has loaded everything. An engine's transfer memory is two buckets whatever its links: with n
// links each gets buffers of bucket_bytes / n (the larger n of the link's two ends). Every wait
// has a deadline (config.timeout_s). A destination whose refit failed stays stale() until a later
// refit succeeds.
//
// Not thread-safe: one thread drives an engine.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/config.h"
#include "refit/deadline.h"
#include "refit/error.h"
#include "refit/ext/transport.h"
#include "refit/layout.h"
#include "refit/tensor.h"
#include "refit/timeline.h"

namespace refit {

using Metadata = Bytes;
using SessionId = std::array<uint8_t, 16>;

// A random session id; the driver gives the same one to every engine of a refit group, so that
// metadata from another group or an older run is refused.
SessionId new_session_id();

struct EngineOptions {
  RefitConfig config;
  uint64_t bucket_bytes = 0;       // per buffer; from the driver's bucket sizing
  SessionId session{};             // shared by all engines of one group
  uint64_t model_fingerprint = 0;  // ModelInventory::fingerprint(); 0: not checked
  // The transport to use; null creates one from config.backend_name/backend_init_params.
  std::shared_ptr<Transport> transport;
  // A destination's layout: what it holds of each source tensor (layout_builders.h). It travels
  // in the destination's metadata and its sources send exactly that. Empty: every tensor whole.
  std::optional<Layout> layout;
  // A source's shards: what it holds of each tensor (megatron_source_layouts, fsdp_source_layout).
  // When any source of a group declares one, the group reshards (see above) and the weight
  // stream yields the shards themselves; a source that declares none holds everything.
  std::optional<Layout> holds;
  // The model's full inventory; resharding needs it (tensor shapes for the plan).
  std::shared_ptr<const ModelInventory> model;
  // This engine will only be a destination: prepare() allocates nothing, and init_destination()
  // allocates the two transfer buffers only if it cannot load from its source's mapped buffers
  // (map_source_buffers), saving 2 x bucket_bytes of (GPU) memory per destination.
  // init_source() on such an engine is an error.
  bool receives_only = false;
};

// The weights a source streams, one tensor at a time. next() fills `out` and returns true, or
// returns false at the end. Views must stay valid until the following next() call.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool next(TensorView* out) = 0;
  // True when every view stays valid and unchanged until send() returns: the weights themselves,
  // not temporaries made per tensor (a gathered or converted copy). Only such tensors may be read
  // in place by destinations (direct_reads); the default keeps every tensor in buckets.
  virtual bool views_outlive_send() const { return false; }
};

// The weight stream of tensors that the caller keeps (its weights themselves): each view once per
// send, in order. They must stay valid and unchanged until send() returns, so destinations may
// read them in place.
class ViewSource final : public WeightSource {
 public:
  explicit ViewSource(std::span<const TensorView> views) : views_(views) {}
  bool next(TensorView* out) override;
  bool views_outlive_send() const override { return true; }

 private:
  std::span<const TensorView> views_;
  size_t index_ = 0;
};

// A batch of received tensors. Views into transfer buffers (and merged tensors) are valid only
// during the loader call: copy what must outlive it.
using LoadBatch = std::span<const TensorView>;
using BatchLoader = std::function<void(LoadBatch batch)>;

// One batch of a pull-style receive (CheckpointEngine::next_batch).
struct ReceivedBatch {
  uint64_t index = 0;  // of this refit's batches, from 0
  LoadBatch tensors;   // views into transfer buffers are valid until release_batch()
  // Parallel to `tensors`: for a tensor merged from chunks, the memory it lives in, which the
  // engine gives up to whoever holds this pointer (the engine merges into fresh memory next
  // time), so it stays valid as long as it is held; null for a view into a transfer buffer.
  std::span<const std::shared_ptr<const void>> owners;
};

enum class ReceiveProgress {
  kBatch,    // a batch was handed out
  kWaiting,  // the caller's deadline came first; ask again
  kDone,     // every source has sent everything: call finish_receive()
};

struct SendStats {
  uint64_t tensors = 0;  // sent (whole, sliced, or as pieces to several destinations)
  uint64_t dropped = 0;  // not held by the destination
  uint64_t buckets = 0;
  uint64_t replayed_buckets = 0;  // of buckets, sent naming the previous refit's manifest (same model, same plan)
  uint64_t payload_bytes = 0;
  uint64_t in_place_bytes = 0;  // of payload_bytes, loaded by destinations from our own tensors
  double seconds = 0;
  bool had_peer = false;
  uint32_t destinations = 0;  // destinations served
  // Delta refit (config.delta): of tensors (resharding: of the pieces sent on every link), those
  // sent as their changed elements, and the bytes of those changes; the rest went whole. Seconds
  // spent comparing them with the bases (and packing slices and pieces).
  uint64_t delta_tensors = 0;
  uint64_t delta_bytes = 0;
  double delta_seconds = 0;
  std::vector<TimelineEvent> events;  // pack, announce and release of every bucket on every link
};

struct ReceiveStats {
  uint64_t tensors = 0;
  uint64_t batches = 0;
  uint64_t buckets = 0;
  uint64_t replayed_buckets = 0;  // of buckets, whose manifest came from the previous refit's
  uint64_t payload_bytes = 0;     // tensor bytes delivered to the loader
  uint64_t wire_bytes = 0;        // bytes read over the transport (or loaded from the mapped source buffers)
  uint64_t in_place_bytes = 0;    // of payload_bytes, loaded straight from the sources' own tensors
  bool mapped = false;            // loaded straight from the source's mapped buffers (map_source_buffers)
  uint64_t buffer_bytes = 0;      // transfer-buffer memory this engine holds (0: receives_only and mapped)
  std::string route;              // what carried the bytes: "UCX mapped", "UCX tcp/eth0" (Transport::route)
  uint32_t sources = 0;           // sources read from
  // Delta refit (config.delta): of tensors (resharding: of the pieces from every source), those
  // that came as their changed elements and were patched into this destination's copy, and the
  // bytes of those changes. Seconds spent patching and checking them (and keeping the copies).
  uint64_t delta_tensors = 0;
  uint64_t delta_bytes = 0;
  double delta_seconds = 0;
  double total_seconds = 0;
  double load_seconds = 0;
  std::vector<TimelineEvent> events;  // read, load and release of every bucket from every source
  double receive_seconds() const { return total_seconds > load_seconds ? total_seconds - load_seconds : 0; }
};

class CheckpointEngine {
 public:
  // Throws Error(kConfig) for a bucket size of 0, verify_checksums with a cuda device, or holds
  // without model; check_device()'s errors for a device this build or machine lacks; and
  // create_transport()'s when no transport is given.
  explicit CheckpointEngine(EngineOptions options);
  ~CheckpointEngine();
  CheckpointEngine(const CheckpointEngine&) = delete;
  CheckpointEngine& operator=(const CheckpointEngine&) = delete;

  Metadata prepare();
  void init_source(int worker_rank, int train_world_size, int rollout_world_size, std::span<const Metadata> metadata);
  void init_destination(int rollout_rank, int train_world_size, int rollout_world_size,
                        std::span<const Metadata> metadata);
  // With views that outlive it (WeightSource::views_outlive_send), their memory must not change
  // until send() returns: destinations on this host may be reading it in place until then. One
  // send at a time: a second send(), prepare(), an init or finalize() from another thread while
  // one runs is Error(kInvalidArgument).
  SendStats send(WeightSource& weights);
  // Memory for a source's weights (zero-filled, on the configured device) that destinations on
  // this host load in place whatever the transport (UCX: shared memory, which it cannot do for
  // memory it did not allocate). Valid until the engine is destroyed.
  std::byte* allocate_weight_memory(uint64_t bytes);
  // One refit at a destination: `loader` gets every batch, in the order they complete. The same
  // as the pull-style receive below with a loop around it.
  ReceiveStats receive(const BatchLoader& loader);

  // Pull-style receive, for callers that drive the refit themselves (an iterator, an event loop):
  //   begin_receive();
  //   for (;;) {
  //     ReceivedBatch batch;
  //     auto p = next_batch(deadline_after(100ms), &batch);
  //     if (p == ReceiveProgress::kDone) break;
  //     if (p == ReceiveProgress::kBatch) { load(batch); release_batch(); }
  //   }
  //   ReceiveStats stats = finish_receive();
  // next_batch() returns kWaiting when `until` passes before a batch is ready; the refit's own
  // deadlines (timeout_s) apply meanwhile, and a batch held longer than timeout_s fails the
  // refit at release_batch(); the time a batch is held counts as load time. A batch must be
  // released before the next is asked for. Any error ends the receive: it is thrown, the sources
  // are told, and the destination stays stale until a later refit succeeds. abort_receive()
  // gives up the same way, with the caller's reason and its kind (the sources fail with that
  // kind too), and returns the error (refit and phase in front) for the caller to throw or not.
  void begin_receive();
  ReceiveProgress next_batch(Deadline until, ReceivedBatch* batch);
  void release_batch();
  ReceiveStats finish_receive();
  Error abort_receive(const std::string& reason, ErrorKind kind = ErrorKind::kInvalidArgument);
  bool receiving() const;  // between begin_receive() and finish_receive() or an error

  // Delta refit (config.delta): a destination asks for the whole model at its next refit, by
  // declaring that it holds no version in the metadata of its next prepare() (so call it before
  // that; a connection made earlier still sends changes).
  void request_full_refit();

  // Disconnects (aborting a receive in progress); the peers' next refit fails at once, kPeerLost.
  void finalize();

  bool stale() const;
  uint64_t bucket_bytes() const;
  // On a paired source: the layout its destination declared (null: whole tensors, no
  // destination, or resharding).
  const Layout* target_layout() const;
  const Transport& transport() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// The reference's pairing (paired_plan()): destination r is fed by source r. Validates the world
// sizes and the rank, throwing Error(kTopology): T >= 1, R >= 1, 0 <= r < R, T >= R.
int source_rank_for_destination(int rollout_rank, int train_world_size, int rollout_world_size);

}  // namespace refit
