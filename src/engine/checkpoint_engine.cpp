#include "refit/checkpoint_engine.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>

#include "core/caught.h"
#include "core/delta_schedule.h"
#include "core/fail.h"
#include "core/name_index.h"
#include "core/random_id.h"
#include "delta/link_delta.h"
#include "engine/assembler.h"
#include "engine/link.h"
#include "engine/link_reader.h"
#include "engine/link_sender.h"
#include "engine/peer_wait.h"
#include "engine/protocol.h"
#include "engine/read_route.h"
#include "engine/source_regions.h"
#include "memory/host_copy_pool.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"
#include "refit/plan.h"
#include "refit/transfer_plan.h"

namespace refit {
namespace {

using Seconds = std::chrono::duration<double>;

constexpr int kBufferCount = 2;
// An abort is a courtesy to the peer; it must never hold up reporting our own error.
constexpr Seconds kAbortTimeout{2.0};

double seconds_since(Clock::time_point start) { return Seconds(Clock::now() - start).count(); }

// Runs `body`; a refit::Error escaping it gets `context` in front of its message.
template <typename F>
auto in_phase(const std::string& context, F&& body) {
  try {
    return body();
  } catch (const Error& e) {
    throw Error(e.kind(), context + ": " + e.what());
  }
}

}  // namespace

SessionId new_session_id() { return random_id(); }

int source_rank_for_destination(int rollout_rank, int train_world_size, int rollout_world_size) {
  const TransferPlan plan = paired_plan(train_world_size, rollout_world_size);
  if (rollout_rank < 0 || rollout_rank >= rollout_world_size)
    fail(ErrorKind::kTopology, "rollout_rank must be in [0, {}), got {}", rollout_world_size, rollout_rank);
  return static_cast<int>(plan.sources_of(static_cast<uint32_t>(rollout_rank)).front());
}

class CheckpointEngine::Impl {
  // Resharding: where a piece of the plan lies at either end.
  struct PlacedPiece {
    TensorInfo tensor;  // as the destination holds it
    Box in_view;        // the piece in the coordinates of the source's shard
    Box in_tensor;      // the piece in the coordinates of the destination's tensor
    TensorInfo packed;  // delta refit only: the piece packed, under its own name (delta_piece_name)
  };
  // On a resharding source: where one tensor's pieces go.
  struct SendPiece {
    size_t link = 0;
    PlacedPiece at;
  };
  struct SendTensor {
    std::vector<int64_t> held_shape;  // what the weight stream must yield for it
    DType dtype = DType::kBFloat16;
    std::vector<SendPiece> pieces;
  };

 public:
  explicit Impl(EngineOptions options) : options_(std::move(options)) {
    // spdlog makes its registry on first use, behind a guard ThreadSanitizer cannot see (the
    // library is not instrumented): make it here, before engines on several threads log at once.
    spdlog::default_logger_raw();
    if (options_.bucket_bytes == 0) fail(ErrorKind::kConfig, "bucket size must be at least 1 byte");
    if (options_.config.uses_plugin())
      fail(ErrorKind::kConfig,
           "refit_transport '{}' is a Python checkpoint-engine plugin, not refit's engine: create it with "
           "refit.create_checkpoint_engine('{}', ...)",
           options_.config.refit_transport, options_.config.refit_transport);
    const Device& device = options_.config.device;
    in_phase("refit_cfg.nixl.device", [&] { check_device(device); });
    if (device.kind == Device::Kind::kCuda && options_.config.verify_checksums)
      fail(ErrorKind::kConfig,
           "refit_cfg.nixl.verify_checksums: checksums are computed on the CPU and need host transfer buffers "
           "(device: cpu); with device {} set verify_checksums=false",
           to_string(device));
    if (options_.holds && !options_.model)
      fail(ErrorKind::kConfig,
           "a source that declares what it holds (EngineOptions::holds) needs the model's inventory "
           "(EngineOptions::model) to plan the transfers");
    if (options_.transport) {
      transport_ = options_.transport;
    } else {
      // Every backend learns the transfer-buffer device from its init params.
      auto params = options_.config.backend_init_params;
      if (auto it = params.find("device"); it != params.end() && parse_device(it->second) != device)
        fail(ErrorKind::kConfig,
             "refit_cfg.nixl.backend_init_params.device is '{}' but refit_cfg.nixl.device is '{}': the transport's "
             "buffers and the engine's copies must be on one device (leave backend_init_params.device out)",
             it->second, to_string(device));
      params["device"] = to_string(device);
      transport_ = create_transport(options_.config.backend_name, params);
    }
    // Views, merge buffers and copies take the configured device, whether the bytes are in our
    // buffers or in the source's, mapped.
    assembler_.set_memory(buffer_kind_, device);
  }

  ~Impl() {
    try {
      disconnect("its engine was destroyed (its process ended or dropped it)");
      release_buffers();
    } catch (const std::exception& e) {
      spdlog::warn("checkpoint engine teardown: {}", e.what());
    }
  }

  Metadata prepare() {
    refuse_while_sending("prepare()");
    if (!has_buffers_ && !options_.receives_only) allocate_buffers();
    prepared_ = true;
    protocol::EngineMetadata md;
    md.session = options_.session;
    md.model_fingerprint = options_.model_fingerprint;
    md.bucket_bytes = options_.bucket_bytes;
    md.transport_name = transport_->name();
    md.transport_address = transport_->address();
    if (has_buffers_) md.buffers = transport_->describe(region_);
    if (options_.layout) md.layout = encode_layout(*options_.layout);
    if (options_.holds) md.holds = encode_layout(*options_.holds);
    md.process = this_process();
    generation_ = random_u64();
    md.generation = generation_;
    md.takes = takes();
    md.delta = options_.config.delta;
    for (const auto& [rank, delta] : destination_deltas_)
      if (delta.version() != 0) md.weights_versions.emplace_back(rank, delta.version());
    return protocol::encode(md);
  }

  void init_source(int worker_rank, int train, int rollout, std::span<const Metadata> metadata) {
    refuse_while_sending("init_source()");
    std::string self = fmt::format("source rank {}", worker_rank);
    connecting(self, [&] {
      if (worker_rank < 0 || worker_rank >= train)
        fail(ErrorKind::kTopology, "worker_rank must be in [0, {}), got {}", train, worker_rank);
      auto group = decode_group(train, rollout, metadata);
      const TransferPlan plan = plan_of_group(train, rollout, group, PlanScope::source(worker_rank));
      for (uint32_t d : plan.destinations_of(worker_rank))
        add_link(std::move(group[train + d]), d, fmt::format("destination rank {}", d),
                 plan.link_bucket_bytes(worker_rank, d, options_.bucket_bytes), /*to_destination=*/true);
      // This side's own mistakes once linked: its destinations hear of them at once (connecting()).
      if (options_.receives_only)
        fail(ErrorKind::kInvalidArgument,
             "this engine was created to receive only (receives_only): it cannot be a "
             "source");
      check_delta(self);  // before the pieces are placed: delta names them
      if (!plan.paired())
        plan_sends(plan, worker_rank);
      else if (!links_.empty() && !links_[0].metadata.layout.empty())  // what its destination holds
        target_layout_ = decode_layout(links_[0].metadata.layout, "layout of " + links_[0].label);
      for (auto& link : links_)
        for (const auto& [rank, version] : link.metadata.weights_versions)
          if (rank == static_cast<uint32_t>(worker_rank)) link.weights_version = version;
      keep_linked(source_deltas_);
      make_senders();
    });
    // Planning read every peer's layout; with hundreds of small sources on one host, what it freed
    // is most of each one's memory unless handed back.
    malloc_trim(0);
    self_ = self;
    connected_ = true;
  }

  void init_destination(int rollout_rank, int train, int rollout, std::span<const Metadata> metadata) {
    refuse_while_sending("init_destination()");
    std::string self = fmt::format("destination rank {}", rollout_rank);
    self_ = self;
    connecting(self, [&] {
      auto group = decode_group(train, rollout, metadata);
      if (rollout_rank < 0 || rollout_rank >= rollout)
        fail(ErrorKind::kTopology, "rollout_rank must be in [0, {}), got {}", rollout, rollout_rank);
      const TransferPlan plan = plan_of_group(train, rollout, group, PlanScope::destination(rollout_rank));
      for (uint32_t s : plan.sources_of(rollout_rank))
        add_link(std::move(group[s]), s, fmt::format("source rank {}", s),
                 plan.link_bucket_bytes(s, rollout_rank, options_.bucket_bytes), /*to_destination=*/false);
      // The reference's destinations report their layout whenever experts are sharded; without one
      // this destination would silently receive every expert. Checked once linked: its sources
      // hear of it at once (connecting()).
      if (options_.config.shard_expert_weights && !options_.layout)
        fail(ErrorKind::kConfig,
             "refit_cfg.nixl.shard_expert_weights is true, but {} declared no layout: give it one "
             "(EngineOptions::layout; in Python layout=refit.destination_layout(..., shard_experts=True) or "
             "refit.layout_from_compact(...))",
             self);
      std::set<uint32_t> expected;  // a tensor may come in pieces from several sources
      for (uint32_t s = 0; s < plan.source_count(); ++s)
        for (const auto& piece : plan.link(s, rollout_rank)) expected.insert(piece.tensor);
      expected_tensors_ = expected.size();
      bool all_mapped = true, all_here = !links_.empty();
      for (auto& link : links_) {
        if (link.metadata.buffers.length == 0)
          fail(ErrorKind::kProtocol, "{} published no transfer buffers (it was created to receive only)", link.label);
        if (options_.config.map_source_buffers) map_source_buffers(link);
        all_mapped = all_mapped && link.mapped != nullptr;
        const bool here = same_host(link.metadata.process);
        link.access = protocol::link_access(takes(), here, transport_->capabilities());
        all_here = all_here && here;
        const ReadRoute route{buffer_kind_,
                              transport_->name(),
                              here,
                              link.mapped != nullptr,
                              options_.config.map_source_buffers,
                              transport_->capabilities().maps_peer_memory,
                              options_.config.direct_reads};
        if (auto warning = slow_read_warning(route, self, link.label); !warning.empty()) spdlog::warn("{}", warning);
      }
      if (auto warning = same_host_gpu_warning(buffer_kind_, transport_->name(), all_here, self); !warning.empty())
        spdlog::warn("{}", warning);
      if (!all_mapped && !has_buffers_) allocate_buffers();
      assign_buffer_offsets();
      check_delta(self);
      keep_linked(destination_deltas_);
      // Delta refit when resharding: where each piece, by the name it goes by on its link, lies.
      delta_pieces_.clear();
      if (delta_ && resharding_)
        for (uint32_t s : plan.sources_of(rollout_rank))
          for (const auto& piece : plan.link(s, rollout_rank)) {
            PlacedPiece placed = place(piece, s, rollout_rank);
            protocol::ManifestEntry& e = delta_pieces_[placed.packed.name];
            e.tensor = std::move(placed.tensor);
            e.box = placed.in_tensor;
            e.size = placed.packed.nbytes();
          }
    });
    is_destination_ = true;
    connected_ = true;
  }

  SendStats send(WeightSource& weights) {
    if (sending_.exchange(true))
      fail(ErrorKind::kInvalidArgument, "{}: send() while another send() runs on this engine in another thread",
           self_label("source"));
    struct Sent {
      std::atomic<bool>& flag;
      ~Sent() { flag = false; }
    } sent{sending_};
    // Not silently nothing: a send before init (or after finalize) would drain the stream and
    // report success while no destination got a byte.
    if (!connected_)
      fail(ErrorKind::kTopology,
           "{}: send() before the source was connected (init_source(); in Python init_policy_process_group()) or "
           "after finalize(): no destination would get the weights",
           self_label("source"));
    SendStats stats;
    const auto start = Clock::now();
    ++refits_;
    if (senders_.empty()) {
      // A source without a destination still drains its stream: real weight iterators run
      // collectives that every rank must enter.
      TensorView view;
      while (weights.next(&view)) ++stats.tensors;
      stats.seconds = seconds_since(start);
      return stats;
    }
    stats.had_peer = true;
    stats.destinations = static_cast<uint32_t>(senders_.size());
    std::string phase = "pack";
    try {
      run_send(weights, stats, phase);
      if (delta_)
        for (auto& link : links_) {
          SourceDelta& delta = source_deltas_[link.peer_rank];
          link.weights_version = delta.commit(seconds_since(start));
          stats.delta_tensors += delta.counts().changed_tensors;
          stats.delta_bytes += delta.counts().record_bytes;
        }
      source_regions().end_refit();
    } catch (...) {
      // A plain std::exception comes from the weight stream (caller code); whatever it was, every
      // destination is told at once.
      const Caught c = naming_a_gone_peer(describe_caught(std::current_exception(), ErrorKind::kInvalidArgument,
                                                          "weight stream failed: ", "the weight stream"));
      if (delta_)
        for (auto& link : links_) source_deltas_[link.peer_rank].drop();
      abort_links(c.kind, c.what);
      throw refit_error(c.kind, phase, c.what);
    }
    stats.seconds = seconds_since(start);
    return stats;
  }

  std::byte* allocate_weight_memory(uint64_t bytes) {
    if (bytes == 0) fail(ErrorKind::kInvalidArgument, "allocate_weight_memory(0): nothing to allocate");
    return source_regions().allocate(bytes);
  }

  ReceiveStats receive(const BatchLoader& loader) {
    begin_receive();
    for (;;) {
      ReceivedBatch batch;
      const ReceiveProgress progress = next_batch(deadline_after(std::chrono::hours(1)), &batch);
      if (progress == ReceiveProgress::kDone) break;
      if (progress == ReceiveProgress::kWaiting) continue;
      guarded([&] { loader(batch.tensors); });
      release_batch();
    }
    return finish_receive();
  }

  void begin_receive() {
    if (receive_) fail(ErrorKind::kInvalidArgument, "{}: begin_receive() while a receive is in progress", self_label());
    const bool previous_went_through = !stale_;
    stale_ = true;
    ++refits_;
    if (!connected_)
      fail(
          ErrorKind::kTopology,
          "{}: receive() before init_destination() (or after finalize()): the destination is not connected to a source",
          self_label());
    if (!progress_) progress_ = std::make_unique<LinkProgress>(*transport_);
    auto run = std::make_unique<ReceiveRun>();
    run->previous_went_through = previous_went_through;
    run->start = Clock::now();
    run->phase = "wait for bucket 0";
    assembler_.reset();
    if (delta_)
      for (auto& link : links_) {
        destination_deltas_[link.peer_rank].begin();
        if (!link.wire) {
          link.wire = std::make_unique<TensorAssembler>();
          link.wire->set_memory(buffer_kind_, options_.config.device);
        }
        link.wire->reset();
      }
    for (auto& link : links_) run->readers.push_back(std::make_unique<LinkReader>(link, wire_refit(link)));
    run->remaining = links_.size();  // none: resharding, and this destination holds nothing
    run->stats.mapped = std::all_of(links_.begin(), links_.end(), [](const Link& l) { return l.mapped != nullptr; });
    run->stats.buffer_bytes = has_buffers_ ? kBufferCount * options_.bucket_bytes : 0;
    run->stats.sources = static_cast<uint32_t>(links_.size());
    // Each reader ends its own waits by their deadlines; this one only backs them up.
    run->idle_deadline = deadline_after(backstop());
    receive_ = std::move(run);
  }

  ReceiveProgress next_batch(Deadline until, ReceivedBatch* out) {
    ReceiveRun& run = active_receive("next_batch()");
    if (run.held)
      fail(ErrorKind::kInvalidArgument, "{}: next_batch() while batch {} is still held: release_batch() it first",
           self_, run.stats.batches);
    return guarded([&] {
      for (;;) {
        if (run.remaining == 0) return ReceiveProgress::kDone;
        // Taken before looking at the links, so that news arriving after the look ends the wait.
        const uint64_t seen = transport_->activity();
        advance_links(run);
        if (take_bucket(run)) {
          if (!run.views.empty()) {
            *out = ReceivedBatch{run.stats.batches, run.views, run.owners};  // numbered by the batches released
            run.held = true;
            run.handed_out = Clock::now();
            progress_->resume(run.readers);  // the links go on while the loader works
            return ReceiveProgress::kBatch;
          }
          finish_bucket(run);  // it completed no tensor
          continue;
        }
        if (expired(run.idle_deadline))
          fail(ErrorKind::kTimeout, "no bucket arrived from any of {} source(s) in {:.0f} s", run.remaining,
               backstop().count());
        Deadline wake = std::min({until, run.idle_deadline, deadline_after(kReceiveSlice)});
        for (auto& reader : run.readers) {
          on_link(run, *reader, [&] { reader->check(); });
          if (auto due = reader->deadline()) wake = std::min(wake, *due);
        }
        if (expired(until)) return ReceiveProgress::kWaiting;
        transport_->wait_activity(seen, wake);
      }
    });
  }

  void release_batch() {
    ReceiveRun& run = active_receive("release_batch()");
    if (!run.held) fail(ErrorKind::kInvalidArgument, "{}: release_batch() without a batch held", self_);
    guarded([&] {
      const double held = seconds_since(run.handed_out);
      if (held > options_.config.timeout_s)  // the cause, whatever the sources did meanwhile
        fail(ErrorKind::kTimeout, "the caller held batch {} for more than timeout_s={} s ({:.1f} s)", run.stats.batches,
             options_.config.timeout_s, held);
      progress_->pause(run.phase);
      run.held = false;
      run.stats.load_seconds += held;
      ++run.stats.batches;
      run.stats.tensors += run.views.size();
      for (const auto& v : run.views) run.stats.payload_bytes += v.info->nbytes();
      finish_bucket(run);
    });
  }

  ReceiveStats finish_receive() {
    ReceiveRun& run = active_receive("finish_receive()");
    if (run.held || run.remaining > 0)
      fail(ErrorKind::kInvalidArgument, "{}: finish_receive() before the refit's last batch was released ({})", self_,
           run.held ? "a batch is held" : fmt::format("{} source(s) still sending", run.remaining));
    guarded([&] {
      if (links_.empty()) return;  // resharding, and this destination holds nothing
      assembler_.finish(links_.size() == 1 ? links_[0].label : "its sources");
      if (expected_tensors_ != 0 && assembler_.tensors_completed() != expected_tensors_)
        fail(ErrorKind::kProtocol, "the plan sends this destination {} tensors, but {} arrived", expected_tensors_,
             assembler_.tensors_completed());
      if (delta_)
        for (auto& link : links_) {
          link.wire->finish(link.label);
          destination_deltas_[link.peer_rank].finish(link.label, host_pool());
        }
    });
    std::unique_ptr<ReceiveRun> done = std::move(receive_);
    ReceiveStats stats = std::move(done->stats);
    std::set<std::string> routes;
    for (auto& link : links_)
      routes.insert(link.mapped ? transport_->name() + " mapped" : transport_->route(link.peer));
    stats.route = fmt::format("{}", fmt::join(routes, "; "));
    stats.total_seconds = seconds_since(done->start);
    stale_ = false;
    if (delta_) {
      DeltaCounts all;
      for (auto& link : links_) all += destination_deltas_[link.peer_rank].counts();
      stats.delta_tensors = all.changed_tensors;
      stats.delta_bytes = all.record_bytes;
      spdlog::info("delta refit: {} of {} {} came as changes ({:.2f} MiB of changes, {:.2f} MiB read in all)",
                   stats.delta_tensors, all.tensors, resharding_ ? "pieces" : "tensors",
                   stats.delta_bytes / double(1 << 20), stats.wire_bytes / double(1 << 20));
      spdlog::debug(
          "delta refit: {:.3f} s patching, of which {:.3f} s records to the host, {:.3f} s decoding (host tensors: "
          "and patching), {:.3f} s patching GPU tensors and checking every patched one, {:.3f} s copying whole tensors",
          stats.delta_seconds, all.to_host_seconds, all.decode_seconds, all.patch_seconds, all.whole_seconds);
    }
    if (!links_.empty())
      spdlog::info(
          "[vLLM refit] Loaded {} tensors in {} batches via checkpoint engine; bytes={:.2f}GiB total={:.2f}s "
          "receive={:.2f}s load={:.2f}s",
          stats.tensors, stats.batches, stats.payload_bytes / double(1ull << 30), stats.total_seconds,
          stats.receive_seconds(), stats.load_seconds);
    return stats;
  }

  Error abort_receive(const std::string& reason, ErrorKind kind) {
    Error error = refit_error(kind, receive_ ? receive_->phase : "receive", reason);
    end_receive(kind, reason);
    return error;
  }

  bool receiving() const { return receive_ != nullptr; }

  void finalize() {
    refuse_while_sending("finalize()");
    abort_receive("finalize() was called during the receive", ErrorKind::kInvalidArgument);
    disconnect("it called finalize()");
    if (options_.config.release_after_refit) {
      release_buffers();
      assembler_.release();
    }
  }

  // A destination's weights are no version any source knows: the next refit goes whole.
  void drop_held_versions() {
    for (auto& [rank, delta] : destination_deltas_) delta.drop();
  }

  bool stale() const { return is_destination_ && stale_; }
  const Layout* target_layout() const { return target_layout_ ? &*target_layout_ : nullptr; }
  uint64_t bucket_bytes() const { return options_.bucket_bytes; }
  const Transport& transport() const { return *transport_; }

 private:
  Deadline next_deadline() const { return deadline_after(Seconds(options_.config.timeout_s)); }
  // This refit's number on the wire of `link`.
  uint64_t wire_refit(const Link& link) const { return link.first_refit + refits_; }

  // One send at a time per engine, and nothing that replaces what a send works from (buffers,
  // links) while one runs on another thread: two sends would interleave their buckets on one link.
  void refuse_while_sending(const char* what) const {
    if (sending_)
      fail(ErrorKind::kInvalidArgument, "{}: {} while send() runs on this engine in another thread",
           self_label("source"), what);
  }

  // Whether this init's links go by delta refit (delta_):
  // the mode must be the same at both ends of every link, and `auto` leaves it off where a full refit is one copy per
  // byte (a link on one host whose transport maps the peer's memory), a rule both ends apply alike.
  void check_delta(const std::string& self) {
    const DeltaMode mode = options_.config.delta;
    for (const Link& link : links_)
      if (link.metadata.delta != mode)
        fail(ErrorKind::kConfig, "refit_cfg.nixl.delta is {} on {} but {} on {}: set it the same on every worker",
             to_string(mode), self, to_string(link.metadata.delta), link.label);
    delta_ = mode == DeltaMode::kOn;
    if (mode == DeltaMode::kAuto) {
      const bool maps = transport_->capabilities().maps_peer_memory;
      delta_ = std::any_of(links_.begin(), links_.end(),
                           [&](const Link& link) { return !(maps && same_host(link.metadata.process)); });
      if (!delta_ && !links_.empty())
        spdlog::info(
            "delta refit (auto): off for {}: its link maps memory on one host, where a full refit is one "
            "copy per byte",
            self);
    }
  }

  // Delta refit: the bases or versions of peers this init does not link to are of no use any more.
  template <typename Delta>
  void keep_linked(std::map<uint32_t, Delta>& deltas) {
    std::erase_if(deltas, [&](const auto& entry) {
      return std::none_of(links_.begin(), links_.end(), [&](const Link& l) { return l.peer_rank == entry.first; });
    });
  }

  // An init: ends the connection before (its peers are told), then runs `body`, which links this
  // engine to its new peers; if that fails they are told at once too.
  template <typename F>
  void connecting(const std::string& self, F&& body) {
    disconnect("it was connected again (a new init)");
    linked_generation_ = generation_;
    try {
      in_phase(self + ", init", body);
    } catch (...) {
      const Caught c = describe_caught(std::current_exception(), ErrorKind::kInternal, "", "init");
      disconnect("its init failed: " + c.what, c.kind);
      throw;
    }
  }

  // Checks the group's sizes and decodes every member's metadata (sources first).
  std::vector<protocol::EngineMetadata> decode_group(int train, int rollout, std::span<const Metadata> metadata) {
    if (!prepared_) fail(ErrorKind::kInvalidArgument, "prepare() must run before init (buffers are not registered)");
    // The peers of the connection before were told it ended, in refit numbers this metadata
    // derives: the same metadata again would make every refit of the new one fail.
    if (closed_generation_ == generation_)
      fail(ErrorKind::kInvalidArgument,
           "init after finalize() or another init (one that failed included) needs a new prepare() and metadata "
           "exchange: this engine's metadata names a connection that is over");
    if (train < 1 || rollout < 1)
      fail(ErrorKind::kTopology, "world sizes must be >= 1, got train_world_size={} rollout_world_size={}", train,
           rollout);
    if (metadata.size() != static_cast<size_t>(train + rollout))
      fail(ErrorKind::kTopology, "got {} metadata entries for train_world_size={} + rollout_world_size={}",
           metadata.size(), train, rollout);
    std::vector<protocol::EngineMetadata> group;
    group.reserve(metadata.size());
    for (int i = 0; i < train + rollout; ++i)
      group.push_back(protocol::decode_metadata(metadata[i], "metadata of " + label_of(i, train)));
    return group;
  }

  std::string label_of(int index, int train) const {
    return index < train ? fmt::format("source rank {}", index) : fmt::format("destination rank {}", index - train);
  }

  // The group's transfer plan, with the pieces of this engine's links (`scope`): planned from the
  // layouts when any source declares what it holds (resharding), else the paired plan. Every
  // engine of the group computes the same plan from the same metadata. Of the layouts, only those
  // this engine's links place pieces by are kept (holds_, needs_).
  TransferPlan plan_of_group(int train, int rollout, std::span<const protocol::EngineMetadata> group, PlanScope scope) {
    std::vector<Layout> holds(train), needs(rollout);
    resharding_ = false;
    for (int i = 0; i < train; ++i) {
      if (group[i].holds.empty()) continue;
      resharding_ = true;
      holds[i] = decode_layout(group[i].holds, "holdings of " + label_of(i, train));
    }
    if (!resharding_) return paired_plan(train, rollout);  // a paired source reads its destination's layout alone
    for (int d = 0; d < rollout; ++d)
      if (!group[train + d].layout.empty())
        needs[d] = decode_layout(group[train + d].layout, "layout of " + label_of(train + d, train));
    if (!options_.model)
      fail(ErrorKind::kConfig,
           "the sources declare what they hold (resharding), so this engine needs the model's "
           "inventory (EngineOptions::model) to plan the transfers");
    TransferPlan plan = plan_transfers(*options_.model, holds, needs, scope);
    const bool source = scope.kind == PlanScope::Kind::kSource;
    const std::vector<uint32_t> peers = source ? plan.destinations_of(scope.rank) : plan.sources_of(scope.rank);
    auto keep_only = [](std::vector<Layout>& layouts, std::span<const uint32_t> ranks) {
      for (uint32_t k = 0; k < layouts.size(); ++k)
        if (!std::binary_search(ranks.begin(), ranks.end(), k)) layouts[k] = Layout();
    };
    keep_only(source ? holds : needs, std::vector<uint32_t>{scope.rank});
    keep_only(source ? needs : holds, peers);
    holds_ = std::move(holds);
    needs_ = std::move(needs);
    return plan;
  }

  // Links to a peer (a destination of this source, or a source of this destination): refuses its
  // metadata unless it belongs to the same group, model and bucket size, and connects.
  void add_link(protocol::EngineMetadata md, uint32_t peer_rank, const std::string& label, uint64_t link_bucket,
                bool to_destination) {
    if (md.session != options_.session)
      fail(ErrorKind::kProtocol, "metadata of {} comes from another refit session (stale or foreign metadata)", label);
    if (options_.model_fingerprint != 0 && md.model_fingerprint != 0 &&
        md.model_fingerprint != options_.model_fingerprint)
      fail(ErrorKind::kProtocol, "metadata of {} describes another model (fingerprint {:016x}, ours {:016x})", label,
           md.model_fingerprint, options_.model_fingerprint);
    if (md.bucket_bytes != options_.bucket_bytes)
      fail(ErrorKind::kProtocol, "{} uses {}-byte buckets, this engine {}", label, md.bucket_bytes,
           options_.bucket_bytes);
    if (md.transport_name != transport_->name())
      fail(ErrorKind::kProtocol, "{} uses transport '{}', this engine '{}'", label, md.transport_name,
           transport_->name());
    // Errors name the peer's host too: across hosts that is what an operator looks for first.
    const std::string where = same_host(md.process) ? label : fmt::format("{} on host {}", label, md.process.hostname);
    Link link;
    link.transport = transport_.get();
    link.timeout_s = options_.config.timeout_s;
    link.verify_checksums = options_.config.verify_checksums;
    try {
      link.peer = transport_->connect(md.transport_address, where);
    } catch (const Error& e) {
      if (auto gone = gone_peer(where, md.process, e.what())) throw *gone;  // not the transport's words alone
      throw;
    }
    // Numbered at once: a farewell from an init that fails later must carry this connection's numbers.
    link.first_refit = to_destination ? protocol::first_refit(generation_, md.generation)
                                      : protocol::first_refit(md.generation, generation_);
    link.metadata = std::move(md);
    link.label = where;
    link.peer_rank = peer_rank;
    link.bucket_bytes = link_bucket;
    links_.push_back(std::move(link));
    refits_ = 0;
  }

  // Link k's two buffers follow link k-1's in our transfer region.
  void assign_buffer_offsets() {
    uint64_t offset = 0;
    for (auto& link : links_) {
      link.offset = offset;
      link.region = region_;
      for (int b = 0; b < 2; ++b) link.buffers[b] = region_base_ + link.buffer_offset(b);
      offset += 2 * link.bucket_bytes;
    }
  }

  // On a resharding source: for every tensor we hold that someone needs, the pieces and where
  // they go.
  void plan_sends(const TransferPlan& plan, uint32_t self) {
    const auto& tensors = options_.model->tensors;
    send_tensors_.clear();
    const std::vector<uint32_t> destinations = plan.destinations_of(self);  // in link order
    for (size_t k = 0; k < links_.size(); ++k) {
      const uint32_t d = destinations[k];
      for (const TransferPiece& piece : plan.link(self, d)) {
        const TensorInfo& full = tensors[piece.tensor];
        auto [it, fresh] = send_tensors_.try_emplace(full.name);
        if (fresh) {
          it->second.held_shape = Box::of(holds_[self].request_for(full.name)).shape_in(full.shape);
          it->second.dtype = full.dtype;
        }
        it->second.pieces.push_back({k, place(piece, self, d)});
      }
    }
  }

  // Where piece `piece` of the plan, from source `s` to destination `d`, lies at either end.
  PlacedPiece place(const TransferPiece& piece, uint32_t s, uint32_t d) const {
    const TensorInfo& full = options_.model->tensors[piece.tensor];
    const Request held = holds_[s].request_for(full.name);
    const Request need = needs_[d].request_for(full.name);
    const Slice none{-1, 0, 0};
    PlacedPiece p;
    p.tensor = {full.name, full.dtype, Box::of(need).shape_in(full.shape)};
    p.in_view = piece.box.relative_to(held.take == Take::kSlice ? held.slice : none);
    p.in_tensor = piece.box.relative_to(need.take == Take::kSlice ? need.slice : none);
    if (delta_) p.packed = {delta_piece_name(full.name, p.in_tensor), full.dtype, piece.box.shape_in(full.shape)};
    return p;
  }

  void make_senders() {
    senders_.clear();
    assign_buffer_offsets();
    for (auto& link : links_) {
      // In place to a destination on this host that maps our memory, or read from our memory by one
      // that cannot map it (the choice it makes too).
      link.access =
          protocol::link_access(link.metadata.takes, same_host(link.metadata.process), transport_->capabilities());
      SourceRegions* in_place =
          options_.config.direct_reads && link.access != SourceAccess::kNone ? &source_regions() : nullptr;
      senders_.push_back(std::make_unique<LinkSender>(link, *pack_stream_, buffer_kind_, in_place));
    }
  }

  // Maps a source's transfer buffers when the transport can (same host); host memory is then
  // page-locked here too, so that loads from it into GPU tensors run at PCIe speed.
  void map_source_buffers(Link& link) {
    // A peer in other namespaces shares this kernel but not its /dev/shm, /proc or pids: it is
    // remote, whatever the transport might believe.
    if (!same_host(link.metadata.process)) {
      spdlog::debug("{}: on another host, so the staged path", link.label);
      return;
    }
    link.mapped = transport_->map(link.peer, link.metadata.buffers);
    if (link.mapped == nullptr) return;
    if (buffer_kind_ == MemoryKind::kHost)
      link.mapped_pin = HostPin::pin(const_cast<std::byte*>(link.mapped), link.metadata.buffers.length);
    spdlog::debug("{} loads straight from the mapped buffers of {}", self_label(), link.label);
  }

  // How this engine, as a destination, can take tensors from its sources' own memory
  // (EngineMetadata::takes): load them mapped from a source on its host, read them from another.
  uint8_t takes() const {
    if (!options_.config.direct_reads) return 0;
    const TransportCapabilities caps = transport_->capabilities();
    return (options_.config.map_source_buffers && caps.maps_peer_memory ? protocol::kTakesByMap : 0) |
           (caps.reads_registered_memory ? protocol::kTakesByRead : 0);
  }

  // Delta refit's host work on several cores, for every link (delta/link_delta.h): a destination's
  // patches and checksums, a source's records of GPU tensors.
  HostCopyPool& host_pool() {
    if (!host_pool_) host_pool_ = std::make_unique<HostCopyPool>();
    return *host_pool_;
  }

  SourceRegions& source_regions() {
    if (!source_regions_) source_regions_ = std::make_unique<SourceRegions>(transport_.get());
    return *source_regions_;
  }

  // Ends the connection: a peer waiting in one of its refits, now or later, fails at once naming
  // `why` (with `kind`) rather than at its deadline.
  void disconnect(const std::string& why, ErrorKind kind = ErrorKind::kPeerLost) {
    // A receive's readers work from the links: it ends first (the sources are told).
    end_receive(ErrorKind::kInvalidArgument, "the engine was connected again (init) during the receive");
    abort_links(kind, why, /*farewell=*/true);
    target_layout_.reset();
    senders_.clear();
    send_tensors_.clear();
    for (auto& link : links_) {
      link.mapped_pin = HostPin();
      transport_->disconnect(link.peer);
    }
    links_.clear();
    connected_ = false;
  }

  // Both transfer buffers come from one allocation of the transport, on the configured device.
  void allocate_buffers() {
    const Device& device = options_.config.device;
    const uint64_t bytes = kBufferCount * options_.bucket_bytes;
    if (options_.bucket_bytes > UINT64_MAX / kBufferCount)
      fail(ErrorKind::kConfig, "bucket size of {} bytes is too large for two buffers", options_.bucket_bytes);
    check_buffers_fit(device, options_.bucket_bytes, kBufferCount);
    auto allocation = transport_->allocate_memory(bytes);
    region_ = allocation.region;
    region_base_ = allocation.base;
    has_buffers_ = true;
    if (memory_kind_of(allocation.base) != buffer_kind_) {
      release_buffers();
      fail(ErrorKind::kConfig, "refit_cfg.nixl.device is {} but backend {} allocated its transfer buffers in {} memory",
           to_string(device), transport_->name(), buffer_kind_ == MemoryKind::kCuda ? "host" : "GPU");
    }
    // Host buffers are page-locked when a GPU is usable, so that copies to and from GPU tensors
    // run at PCIe speed and asynchronously; without one this does nothing.
    if (buffer_kind_ == MemoryKind::kHost) pin_ = HostPin::pin(allocation.base, bytes);
    pack_stream_ = std::make_unique<CopyStream>(device);
  }

  void release_buffers() {
    prepared_ = false;  // metadata describing the buffers is stale from here on
    if (!has_buffers_) return;
    if (pack_stream_ && pack_stream_->pending()) pack_stream_->synchronize(next_deadline());
    pin_ = HostPin();
    transport_->deregister_memory(region_);
    region_base_ = nullptr;
    has_buffers_ = false;
  }

  // Tells every peer that this refit failed, or with `farewell` that this connection is over.
  void abort_links(ErrorKind kind, const std::string& reason, bool farewell = false) noexcept {
    const Deadline deadline = deadline_after(kAbortTimeout);  // one for all: peers may be gone
    for (const Link& link : links_) {
      try {
        transport_->send(link.peer, protocol::encode(protocol::Abort{wire_refit(link), kind, reason, farewell}),
                         deadline);
      } catch (...) {
        // The peer may be the reason we are aborting.
      }
    }
    if (farewell && !links_.empty()) closed_generation_ = linked_generation_;
  }

  void run_send(WeightSource& weights, SendStats& stats, std::string& phase) {
    const bool in_place = weights.views_outlive_send();
    for (size_t k = 0; k < senders_.size(); ++k) senders_[k]->begin(wire_refit(links_[k]), in_place);
    sent_.clear();  // names, to check every request was met
    auto add_whole = [&](size_t k, const TensorView& view) {
      senders_[k]->add(view, Box::whole(), *view.info, Box::whole(), phase);
    };
    // Delta refit: each link's delta, whose header goes first. Until the refit is committed the
    // destination holds no version we know of.
    std::vector<SourceDelta*> deltas;
    if (delta_)
      for (size_t k = 0; k < links_.size(); ++k) {
        SourceDelta& delta = source_deltas_.try_emplace(links_[k].peer_rank, options_.config.timeout_s).first->second;
        const TensorView header =
            delta.begin(links_[k].weights_version, links_[k].label, options_.config.delta == DeltaMode::kAuto);
        links_[k].weights_version = 0;
        add_whole(k, header);
        deltas.push_back(&delta);
      }
    // Delta: what link k's destination holds goes as changes or whole, once `compare` has compared
    // its batch (SourceDelta::add, flush).
    auto send_compared = [&](size_t k, auto&& compare) {
      const auto start = Clock::now();
      const std::span<const TensorView> ready = compare();
      stats.delta_seconds += seconds_since(start);
      for (const TensorView& out : ready) {
        add_whole(k, out);
        senders_[k]->send_early(delta_schedule::kBucketBytes, phase);
      }
    };
    auto twice = [](const std::string& name) {
      fail(ErrorKind::kInvalidArgument, "tensor '{}' appears twice in one refit", name);
    };
    TensorView view;
    SendPiece paired_piece;  // paired: the one piece of the tensor in hand
    std::string pack_phase = "pack";
    uint64_t phase_bucket = UINT64_MAX;
    while (true) {
      // The weight stream runs while the open bucket fills (the one bucket, paired).
      if (senders_.size() == 1 && senders_[0]->bucket() != phase_bucket) {
        phase_bucket = senders_[0]->bucket();
        pack_phase = fmt::format("pack bucket {}", phase_bucket);
      }
      phase = pack_phase;
      if (!weights.next(&view)) break;
      if (view.info == nullptr)
        fail(ErrorKind::kInvalidArgument, "the weight stream yielded a tensor without metadata");
      const TensorInfo& info = *view.info;
      const uint64_t nbytes = info.nbytes();
      if (nbytes > 0 && view.data == nullptr)
        fail(ErrorKind::kInvalidArgument, "tensor '{}' ({} bytes) has no data pointer", info.name, nbytes);
      // Where the tensor goes: the plan's pieces of this shard (resharding), or what the paired
      // destination holds of it (all of it, a slice or nothing) as one piece.
      std::span<const SendPiece> pieces(&paired_piece, 1);
      if (resharding_) {
        auto it = send_tensors_.find(info.name);
        if (it == send_tensors_.end()) {
          ++stats.dropped;
          continue;
        }
        const SendTensor& t = it->second;
        if (info.shape != t.held_shape || info.dtype != t.dtype)
          fail(ErrorKind::kLayout, "the weight stream yielded '{}' as {} {}, but this source declared it holds {} {}",
               info.name, dtype_name(info.dtype), shape_string(info.shape), dtype_name(t.dtype),
               shape_string(t.held_shape));
        if (!sent_.add(info.name).added) twice(info.name);
        pieces = t.pieces;
      } else if (target_layout_) {
        Selection selection = select(*target_layout_, info);
        if (selection.take == Take::kDrop) {
          ++stats.dropped;
          continue;
        }
        if (!sent_.add(info.name).added && delta_) twice(info.name);
        paired_piece.at.in_view = Box::of(Request{selection.take, selection.slice});
        paired_piece.at.tensor = std::move(selection.info);
      } else {
        // The packer refuses a name twice, but a delta link packs records under names of their own.
        if (delta_ && !sent_.add(info.name).added) twice(info.name);
        paired_piece.at.tensor = info;  // reuses the previous tensor's allocations
      }
      for (const SendPiece& p : pieces)
        if (delta_)  // a resharding piece goes by its own name
          send_compared(p.link, [&] {
            return deltas[p.link]->add(view, p.at.in_view, resharding_ ? p.at.packed : p.at.tensor, in_place,
                                       *pack_stream_, host_pool());
          });
        else
          senders_[p.link]->add(view, p.at.in_view, p.at.tensor, p.at.in_tensor, phase);
      ++stats.tensors;
    }
    if (target_layout_) {
      // A destination that declared a tensor must get it: a request the stream never met would
      // otherwise leave that parameter stale.
      for (const auto& [name, request] : target_layout_->tensors)
        if (request.take != Take::kDrop && !sent_.contains(name))
          fail(ErrorKind::kLayout, "{} holds '{}' but the weight stream never yielded it", links_[0].label, name);
    }
    for (const auto& [name, t] : send_tensors_)
      if (!sent_.contains(name))
        fail(ErrorKind::kLayout, "{} needs a piece of '{}' from this source, but the weight stream never yielded it",
             links_[t.pieces.front().link].label, name);
    for (size_t k = 0; k < deltas.size(); ++k) {
      send_compared(k, [&] { return deltas[k]->flush(host_pool()); });
      add_whole(k, deltas[k]->end());
    }
    // Every link's last bucket goes out before we wait on any of them.
    for (auto& sender : senders_) sender->flush_last(phase);
    for (auto& sender : senders_) {
      sender->wait_done(phase);
      stats.buckets += sender->bucket();
      stats.replayed_buckets += sender->replayed_buckets();
      stats.payload_bytes += sender->payload_bytes();
      stats.in_place_bytes += sender->in_place_bytes();
      stats.events.insert(stats.events.end(), sender->events().begin(), sender->events().end());
    }
  }

  // A pull-style receive in progress.
  struct ReceiveRun {
    std::vector<std::unique_ptr<LinkReader>> readers;  // one per link, all advanced by this thread
    size_t remaining = 0;                              // links not done
    size_t cursor = 0;  // the link to look at first, so that no source starves the others
    Clock::time_point start;
    bool previous_went_through = false;  // the refit before this one, on this connection
    Deadline idle_deadline;
    ReceiveStats stats;
    std::string phase;
    // The bucket being assembled or loaded, and the batch it completed.
    std::optional<LinkReader::Fetched> bucket;
    size_t link = 0;
    double assembling = 0;              // on the timeline
    uint64_t mapped_in_place = 0;       // of the bucket: bytes its entries load from the source's tensors
    std::span<const TensorView> views;  // the assembler's, of `bucket` (or delta_views)
    std::span<const std::shared_ptr<const void>> owners;  // parallel to views
    // Delta refit: the bucket's views as the loader gets them (DestinationDelta::transform).
    std::vector<TensorView> delta_views;
    std::vector<std::shared_ptr<const void>> delta_owners;
    bool held = false;  // handed out (batch number stats.batches), not yet released
    Clock::time_point handed_out;
  };

  Seconds backstop() const { return Seconds(2 * options_.config.timeout_s + 1); }
  // Who this engine is in messages: "source rank 2", or its role before init named it.
  std::string self_label(const char* role = "destination") const { return self_.empty() ? role : self_; }

  ReceiveRun& active_receive(const char* what) {
    if (!receive_)
      fail(ErrorKind::kInvalidArgument, "{}: {} without a receive in progress (begin_receive() first, or it failed)",
           self_label(), what);
    return *receive_;
  }

  // Runs a step of the receive; an error ends it (the sources are told) and is rethrown with the
  // refit and phase in front.
  template <typename F>
  std::invoke_result_t<F> guarded(F&& step) {
    try {
      return step();
    } catch (...) {
      // A plain std::exception comes from the loader (caller code).
      const Caught c =
          naming_a_gone_peer(describe_caught(std::current_exception(), ErrorKind::kInvalidArgument, "", "the loader"));
      throw abort_receive(c.what, c.kind);
    }
  }

  // A transport's error where a peer's process on this host is gone says that first: a transport
  // reports a dead peer in its own words ("Shared memory error").
  Caught naming_a_gone_peer(Caught c) const {
    if (c.kind != ErrorKind::kTransport) return c;
    for (const Link& link : links_)
      if (auto gone = gone_peer(link.label, link.metadata.process, c.what)) return {gone->kind(), gone->what()};
    return c;
  }

  // An error of the refit in progress, with the refit and phase in front.
  Error refit_error(ErrorKind kind, const std::string& phase, const std::string& what) const {
    return Error(kind,
                 fmt::format("{}, refit {} of this connection, phase {}: {}", self_label(), refits_, phase, what));
  }

  // Ends a receive that failed or was given up: the sources are told why, the destination stays stale.
  void end_receive(ErrorKind kind, const std::string& reason) noexcept {
    if (!receive_) return;
    abort_links(kind, reason);
    spdlog::error("{} is stale: refit {} of this connection failed in phase {}: {}", self_, refits_, receive_->phase,
                  reason);
    try {
      progress_->pause(receive_->phase);  // the readers are this thread's again
    } catch (...) {
      // A reader's error while the receive ends for another reason: that one is reported.
    }
    receive_.reset();  // cancels the reads in flight
    stale_ = true;
    drop_held_versions();
  }

  // Takes the next bucket any source has ready and assembles it into run.views; false when none is.
  bool take_bucket(ReceiveRun& run) {
    for (size_t n = 0; n < run.readers.size(); ++n) {
      const size_t k = (run.cursor + n) % run.readers.size();
      LinkReader& reader = *run.readers[k];
      if (reader.done()) continue;
      auto fetched = reader.take();
      if (!fetched) continue;
      // The link's next bucket is read while this one is loaded.
      on_link(run, reader, [&] { reader.advance(); });
      Link& link = links_[k];
      run.cursor = (k + 1) % run.readers.size();
      run.idle_deadline = deadline_after(backstop());
      run.link = k;
      run.bucket = std::move(fetched);
      const auto& bucket = run.bucket->bucket;
      run.mapped_in_place = 0;
      for (const auto& e : bucket.entries()) {
        if (e.region == 0) continue;
        run.stats.in_place_bytes += e.size;
        if (run.bucket->bytes.in_region(e)) run.mapped_in_place += e.size;
      }
      run.stats.wire_bytes += bucket.used_bytes;
      ++run.stats.buckets;
      if (bucket.replay_of) ++run.stats.replayed_buckets;
      run.phase = fmt::format("assemble bucket {} from {}", bucket.seq, link.label);
      run.assembling = timeline_now();
      // A replay of a bucket of the previous refit, which this destination checked whole.
      const bool repeats_checked =
          bucket.replay_of && run.previous_went_through && *bucket.replay_of == wire_refit(link) - 1;
      if (!delta_) {
        run.views = assembler_.add_bucket(bucket, run.bucket->bytes, link.label, next_deadline(), repeats_checked);
        run.owners = assembler_.owners();
      } else {
        // Delta refit: what the link carried, patched where it came as changes; resharding, the
        // link's pieces then merge into this destination's tensors.
        TensorAssembler& wire = *link.wire;
        const auto carried = wire.add_bucket(bucket, run.bucket->bytes, link.label, next_deadline(), repeats_checked);
        const auto patching = Clock::now();
        destination_deltas_[link.peer_rank].transform(carried, wire.owners(), run.delta_views, run.delta_owners,
                                                      link.label, host_pool());
        run.stats.delta_seconds += seconds_since(patching);
        run.views = run.delta_views;
        run.owners = run.delta_owners;
        if (resharding_) {
          run.views = assembler_.add_pieces(run.delta_views, run.delta_owners, delta_pieces_, bucket.seq, link.label,
                                            next_deadline());
          run.owners = assembler_.owners();
        }
        // Nothing the loader gets lies in the bucket (DestinationDelta::transform): its buffer goes
        // back now, and the source sends on while the loader works.
        release_bucket(run);
      }
      if (!run.views.empty()) run.phase = fmt::format("load bucket {} from {}", bucket.seq, link.label);
      return true;
    }
    return false;
  }

  // Moves every link on as far as it goes without waiting: announcements taken, reads posted.
  void advance_links(ReceiveRun& run) {
    for (size_t k = 0; k < run.readers.size(); ++k)
      if (!run.readers[k]->done()) on_link(run, *run.readers[k], [&] { run.readers[k]->advance(); });
  }

  // Runs a step of one link's reader; an error names the link's phase.
  template <typename F>
  void on_link(ReceiveRun& run, LinkReader& reader, F&& step) {
    try {
      step();
    } catch (...) {
      run.phase = reader.phase();
      throw;
    }
  }

  // Nothing more is read from the bucket: its buffer goes back to its source.
  void release_bucket(ReceiveRun& run) {
    const auto& bucket = run.bucket->bucket;
    const uint32_t peer = links_[run.link].peer_rank;
    // The load event spans assembling too: both are the destination's copies out of the bucket. Its
    // bytes are all it copied: the bucket's and those read in place from the source's tensors.
    const double released = timeline_now();
    run.stats.events.push_back({TimelinePhase::kLoad, peer, bucket.seq, run.assembling, released,
                                bucket.used_bytes + run.mapped_in_place,
                                static_cast<uint32_t>(bucket.entries().size())});
    LinkReader& reader = *run.readers[run.link];
    on_link(run, reader, [&] { reader.release(bucket.seq); });
    run.stats.events.push_back({TimelinePhase::kRelease, peer, bucket.seq, released, released, 0});
  }

  // The bucket's tensors are loaded.
  void finish_bucket(ReceiveRun& run) {
    const auto& bucket = run.bucket->bucket;
    const size_t k = run.link;
    if (!delta_) release_bucket(run);  // a delta refit's went back before the loader ran
    LinkReader& reader = *run.readers[k];
    spdlog::debug("{}: bucket {} ({} bytes) from {} done", self_, bucket.seq, bucket.used_bytes, links_[k].label);
    if (reader.done()) {
      run.stats.events.insert(run.stats.events.end(), reader.events().begin(), reader.events().end());
      --run.remaining;
    }
    run.views = {};
    run.bucket.reset();
  }

  EngineOptions options_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<SourceRegions> source_regions_;  // on a source: its memory registered for in-place reads
  std::unique_ptr<LinkProgress> progress_;         // on a destination: moves the links on while the loader works
  RegionId region_ = 0;                            // one allocation of the transport holds every link's two buffers
  std::byte* region_base_ = nullptr;
  // Where transfer buffers (ours, or the source's mapped) live: the configured device's kind.
  const MemoryKind buffer_kind_ =
      options_.config.device.kind == Device::Kind::kCuda ? MemoryKind::kCuda : MemoryKind::kHost;
  bool has_buffers_ = false;
  HostPin pin_;                              // host buffers, page-locked when a GPU is usable
  std::unique_ptr<CopyStream> pack_stream_;  // on a source: copies into the transfer buffers
  bool prepared_ = false;                    // prepare() ran since the buffers were last released
  uint64_t linked_generation_ = 0;           // generation_ when the links were made
  uint64_t closed_generation_ = 0;           // peers were told the connection of this generation is over

  std::string self_;
  bool is_destination_ = false;
  std::vector<Link> links_;
  std::vector<std::unique_ptr<LinkSender>> senders_;  // on a source: one per link
  uint64_t refits_ = 0;                               // since connect; names refits in errors
  uint64_t generation_ = 0;                           // of this engine's latest metadata
  bool stale_ = true;
  TensorAssembler assembler_;
  std::optional<Layout> target_layout_;  // on a paired source: what its destination holds
  // Resharding: every source's holdings and every destination's needs (as in the metadata), the
  // pieces a source sends by tensor name, the tensors a destination gets.
  std::vector<Layout> holds_, needs_;
  std::map<std::string, SendTensor, std::less<>> send_tensors_;
  NameIndex sent_;                 // on a source: the tensors the stream yielded this refit (run_send)
  uint64_t expected_tensors_ = 0;  // on a destination: the tensors the plan sends it (paired: 0, not checked)
  bool resharding_ = false;        // the group reshards (the latest init's plan_of_group)
  bool delta_ = false;             // this init's links go by delta refit (check_delta)
  bool connected_ = false;         // the latest init succeeded, and no finalize() since
  std::unique_ptr<ReceiveRun> receive_;
  std::atomic<bool> sending_{false};  // send() is running
  // Delta refit (delta/link_delta.h), by link: a source's by destination rank, a destination's by source rank, kept
  // across connections (the versions in the metadata say what still holds).
  std::map<uint32_t, SourceDelta> source_deltas_;
  std::map<uint32_t, DestinationDelta> destination_deltas_;
  std::unique_ptr<HostCopyPool> host_pool_;  // their host work's threads: one pool whatever the links
  // On a resharding destination: the pieces the plan sends it, by the name they go by on a delta
  // link, and where each lies in its tensor.
  std::map<std::string, protocol::ManifestEntry, std::less<>> delta_pieces_;
};

CheckpointEngine::CheckpointEngine(EngineOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
CheckpointEngine::~CheckpointEngine() = default;
Metadata CheckpointEngine::prepare() { return impl_->prepare(); }
void CheckpointEngine::init_source(int worker_rank, int train_world_size, int rollout_world_size,
                                   std::span<const Metadata> metadata) {
  impl_->init_source(worker_rank, train_world_size, rollout_world_size, metadata);
}
void CheckpointEngine::init_destination(int rollout_rank, int train_world_size, int rollout_world_size,
                                        std::span<const Metadata> metadata) {
  impl_->init_destination(rollout_rank, train_world_size, rollout_world_size, metadata);
}
bool ViewSource::next(TensorView* out) {
  if (index_ == views_.size()) return false;
  *out = views_[index_++];
  return true;
}

SendStats CheckpointEngine::send(WeightSource& weights) { return impl_->send(weights); }
std::byte* CheckpointEngine::allocate_weight_memory(uint64_t bytes) { return impl_->allocate_weight_memory(bytes); }
ReceiveStats CheckpointEngine::receive(const BatchLoader& loader) { return impl_->receive(loader); }
void CheckpointEngine::begin_receive() { impl_->begin_receive(); }
ReceiveProgress CheckpointEngine::next_batch(Deadline until, ReceivedBatch* batch) {
  return impl_->next_batch(until, batch);
}
void CheckpointEngine::release_batch() { impl_->release_batch(); }
ReceiveStats CheckpointEngine::finish_receive() { return impl_->finish_receive(); }
Error CheckpointEngine::abort_receive(const std::string& reason, ErrorKind kind) {
  return impl_->abort_receive(reason, kind);
}
bool CheckpointEngine::receiving() const { return impl_->receiving(); }
void CheckpointEngine::request_full_refit() { impl_->drop_held_versions(); }
void CheckpointEngine::finalize() { impl_->finalize(); }
bool CheckpointEngine::stale() const { return impl_->stale(); }
uint64_t CheckpointEngine::bucket_bytes() const { return impl_->bucket_bytes(); }
const Transport& CheckpointEngine::transport() const { return impl_->transport(); }
const Layout* CheckpointEngine::target_layout() const { return impl_->target_layout(); }

}  // namespace refit
