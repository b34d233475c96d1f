#include "refit/checkpoint_engine.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <cstring>
#include <deque>
#include <random>
#include <set>

#include "core/fail.h"
#include "engine/assembler.h"
#include "engine/bucket_fetcher.h"
#include "engine/peer_wait.h"
#include "engine/protocol.h"
#include "refit/device.h"
#include "refit/plan.h"

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

uint64_t random_u64() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd();
}

SessionId new_session_id() {
  std::random_device rd;
  SessionId id;
  for (auto& b : id) b = static_cast<uint8_t>(rd());
  return id;
}

int source_rank_for_destination(int rollout_rank, int train_world_size, int rollout_world_size) {
  if (train_world_size < 1) fail(ErrorKind::kTopology, "train_world_size must be >= 1, got {}", train_world_size);
  if (rollout_world_size < 1) fail(ErrorKind::kTopology, "rollout_world_size must be >= 1, got {}", rollout_world_size);
  if (rollout_rank < 0 || rollout_rank >= rollout_world_size)
    fail(ErrorKind::kTopology, "rollout_rank must be in [0, {}), got {}", rollout_world_size, rollout_rank);
  if (train_world_size < rollout_world_size)
    fail(ErrorKind::kTopology,
         "paired refit needs train_world_size >= rollout_world_size (every destination needs its own source), got {} < {}",
         train_world_size, rollout_world_size);
  return rollout_rank;
}

class CheckpointEngine::Impl {
 public:
  explicit Impl(EngineOptions options) : options_(std::move(options)) {
    if (options_.bucket_bytes == 0) fail(ErrorKind::kConfig, "bucket size must be at least 1 byte");
    const Device& device = options_.config.device;
    in_phase("refit_cfg.nixl.device", [&] { check_device(device); });
    if (device.kind == Device::Kind::kCuda && options_.config.verify_checksums)
      fail(ErrorKind::kConfig,
           "refit_cfg.nixl.verify_checksums: checksums are computed on the CPU and need host transfer buffers "
           "(device: cpu); with device {} set verify_checksums=false",
           to_string(device));
    if (options_.transport) {
      transport_ = options_.transport;
    } else {
      // Every backend learns the transfer-buffer device from its init params.
      auto params = options_.config.backend_init_params;
      params.emplace("device", to_string(device));
      transport_ = create_transport(options_.config.backend_name, params);
    }
    // Views, merge buffers and copies take the configured device, whether the bytes are in our
    // buffers or in the source's, mapped.
    assembler_.set_memory(buffer_kind_, device);
  }

  ~Impl() {
    try {
      disconnect();
      release_buffers();
    } catch (const std::exception& e) {
      spdlog::warn("checkpoint engine teardown: {}", e.what());
    }
  }

  Metadata prepare() {
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
    md.process = this_process();
    generation_ = random_u64();
    md.generation = generation_;
    return protocol::encode(md);
  }

  void init_source(int worker_rank, int train, int rollout, std::span<const Metadata> metadata) {
    std::string self = fmt::format("source rank {}", worker_rank);
    in_phase(self + ", init", [&] {
      disconnect();
      if (worker_rank < 0 || worker_rank >= train)
        fail(ErrorKind::kTopology, "worker_rank must be in [0, {}), got {}", train, worker_rank);
      check_group(train, rollout, metadata);
      if (options_.receives_only)
        fail(ErrorKind::kInvalidArgument, "this engine was created to receive only (receives_only): it cannot be a "
                                          "source");
      // Validate the whole pairing, so that every source agrees on it, then find our peer.
      for (int r = 0; r < rollout; ++r) source_rank_for_destination(r, train, rollout);
      if (worker_rank < rollout) {
        const std::string label = fmt::format("destination rank {}", worker_rank);
        connect_peer(metadata, train + worker_rank, label);
        first_refit_ = protocol::first_refit(generation_, peer_metadata_.generation);
        if (!peer_metadata_.layout.empty()) target_layout_ = decode_layout(peer_metadata_.layout, "layout of " + label);
      }
    });
    self_ = self;
  }

  void init_destination(int rollout_rank, int train, int rollout, std::span<const Metadata> metadata) {
    std::string self = fmt::format("destination rank {}", rollout_rank);
    self_ = self;
    in_phase(self + ", init", [&] {
      disconnect();
      check_group(train, rollout, metadata);
      int source = source_rank_for_destination(rollout_rank, train, rollout);
      connect_peer(metadata, source, fmt::format("source rank {}", source));
      first_refit_ = protocol::first_refit(peer_metadata_.generation, generation_);
      if (peer_metadata_.buffers.length == 0)
        fail(ErrorKind::kProtocol, "{} published no transfer buffers (it was created to receive only)", peer_label_);
      if (options_.config.map_source_buffers) map_source_buffers();
      if (!mapped_source_ && !has_buffers_) allocate_buffers();
    });
    is_destination_ = true;
  }

  SendStats send(WeightSource& weights) {
    SendStats stats;
    const auto start = Clock::now();
    const uint64_t refit = first_refit_ + ++refits_;
    if (!has_peer_) {
      // A source without a destination still drains its stream: real weight iterators run
      // collectives that every rank must enter.
      TensorView view;
      while (weights.next(&view)) ++stats.tensors;
      stats.seconds = seconds_since(start);
      return stats;
    }
    stats.had_peer = true;
    std::string phase = "pack";
    try {
      run_send(weights, refit, stats, phase);
    } catch (const Error& e) {
      abort_peer(refit, e.kind(), e.what());
      throw Error(e.kind(), fmt::format("{}, refit {} of this connection, phase {}: {}", self_, refits_, phase, e.what()));
    } catch (const std::exception& e) {
      // The weight iterator (caller code) failed.
      abort_peer(refit, ErrorKind::kInvalidArgument, e.what());
      throw Error(ErrorKind::kInvalidArgument, fmt::format("{}, refit {} of this connection, phase {}: weight stream failed: {}", self_, refits_, phase, e.what()));
    }
    stats.seconds = seconds_since(start);
    return stats;
  }

  ReceiveStats receive(const BatchLoader& loader) {
    stale_ = true;
    ReceiveStats stats;
    const auto start = Clock::now();
    const uint64_t refit = first_refit_ + ++refits_;
    if (!has_peer_)
      fail(ErrorKind::kTopology, "{}: receive() before init_destination(): the destination is not connected to a source",
           self_.empty() ? "destination" : self_);
    std::string phase = "wait for bucket 0";
    try {
      run_receive(loader, refit, stats, phase);
    } catch (const std::exception& e) {
      ErrorKind kind = ErrorKind::kInvalidArgument;  // the loader (caller code) failed
      if (const auto* err = dynamic_cast<const Error*>(&e)) kind = err->kind();
      abort_peer(refit, kind, e.what());
      spdlog::error("{} is stale: refit {} of this connection failed in phase {}: {}", self_, refits_, phase, e.what());
      throw Error(kind, fmt::format("{}, refit {} of this connection, phase {}: {}", self_, refits_, phase, e.what()));
    }
    stats.total_seconds = seconds_since(start);
    stale_ = false;
    spdlog::info("[vLLM refit] Loaded {} tensors in {} batches via checkpoint engine; bytes={:.2f}GiB total={:.2f}s receive={:.2f}s load={:.2f}s",
                 stats.tensors, stats.batches, stats.payload_bytes / double(1ull << 30), stats.total_seconds,
                 stats.receive_seconds(), stats.load_seconds);
    return stats;
  }

  void finalize() {
    disconnect();
    if (options_.config.release_after_refit) {
      release_buffers();
      assembler_.release();
    }
  }

  bool stale() const { return is_destination_ && stale_; }
  const Layout* target_layout() const { return target_layout_ ? &*target_layout_ : nullptr; }
  uint64_t bucket_bytes() const { return options_.bucket_bytes; }
  const Transport& transport() const { return *transport_; }

 private:
  Deadline next_deadline() const { return deadline_after(Seconds(options_.config.timeout_s)); }

  void check_group(int train, int rollout, std::span<const Metadata> metadata) {
    if (!prepared_) fail(ErrorKind::kInvalidArgument, "prepare() must run before init (buffers are not registered)");
    if (train < 1 || rollout < 1)
      fail(ErrorKind::kTopology, "world sizes must be >= 1, got train_world_size={} rollout_world_size={}", train, rollout);
    if (metadata.size() != static_cast<size_t>(train + rollout))
      fail(ErrorKind::kTopology, "got {} metadata entries for train_world_size={} + rollout_world_size={}",
           metadata.size(), train, rollout);
  }

  // Decodes a peer's metadata, refuses it unless it belongs to the same group, model and bucket
  // size, and connects.
  void connect_peer(std::span<const Metadata> metadata, int index, const std::string& label) {
    auto md = protocol::decode_metadata(metadata[index], "metadata of " + label);
    if (md.session != options_.session)
      fail(ErrorKind::kProtocol, "metadata of {} comes from another refit session (stale or foreign metadata)", label);
    if (options_.model_fingerprint != 0 && md.model_fingerprint != 0 && md.model_fingerprint != options_.model_fingerprint)
      fail(ErrorKind::kProtocol, "metadata of {} describes another model (fingerprint {:016x}, ours {:016x})", label,
           md.model_fingerprint, options_.model_fingerprint);
    if (md.bucket_bytes != options_.bucket_bytes)
      fail(ErrorKind::kProtocol, "{} uses {}-byte buckets, this engine {}", label, md.bucket_bytes, options_.bucket_bytes);
    if (md.transport_name != transport_->name())
      fail(ErrorKind::kProtocol, "{} uses transport '{}', this engine '{}'", label, md.transport_name, transport_->name());
    // Errors name the peer's host too: across hosts that is what an operator looks for first.
    const std::string where = same_host(md.process) ? label : fmt::format("{} on host {}", label, md.process.hostname);
    peer_ = transport_->connect(md.transport_address, where);
    peer_metadata_ = std::move(md);
    peer_label_ = where;
    has_peer_ = true;
    refits_ = 0;
  }

  // Maps the source's transfer buffers when the transport can (same host); host memory is then
  // page-locked here too, so that loads from it into GPU tensors run at PCIe speed.
  void map_source_buffers() {
    // A peer in other namespaces shares this kernel but not its /dev/shm, /proc or pids: it is
    // remote, whatever the transport might believe.
    if (!same_host(peer_metadata_.process)) {
      spdlog::debug("{}: on another host, so the staged path", peer_label_);
      return;
    }
    mapped_source_ = transport_->map(peer_, peer_metadata_.buffers);
    if (mapped_source_ == nullptr) return;
    if (buffer_kind_ == MemoryKind::kHost)
      mapped_pin_ = HostPin::pin(const_cast<std::byte*>(mapped_source_), kBufferCount * options_.bucket_bytes);
    spdlog::debug("{} loads straight from the mapped buffers of {}", self_.empty() ? "destination" : self_, peer_label_);
  }

  void disconnect() {
    target_layout_.reset();
    mapped_pin_ = HostPin();
    mapped_source_ = nullptr;
    if (!has_peer_) return;
    has_peer_ = false;
    transport_->disconnect(peer_);
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
    buffers_[0] = allocation.base;
    buffers_[1] = allocation.base + options_.bucket_bytes;
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
    buffers_[0] = buffers_[1] = nullptr;
    has_buffers_ = false;
  }

  // The next message of refit `refit`; messages of earlier refits or connections (left queued by
  // a failure) are discarded.
  protocol::Message receive_message(uint64_t refit, const std::string& expecting) {
    const Deadline deadline = next_deadline();
    while (true) {
      auto bytes = receive_watching(*transport_, peer_, peer_label_, peer_metadata_.process, deadline);
      auto msg = protocol::decode_message(*bytes, peer_label_);
      if (msg.refit() != refit) {
        spdlog::debug("{}: discarding a message of an earlier refit from {}", self_, peer_label_);
        continue;
      }
      if (msg.type == protocol::MessageType::kAbort) protocol::raise_abort(msg.abort, peer_label_, expecting);
      return msg;
    }
  }

  void abort_peer(uint64_t refit, ErrorKind kind, const std::string& reason) noexcept {
    if (!has_peer_) return;
    try {
      transport_->send(peer_, protocol::encode(protocol::Abort{refit, kind, reason}), deadline_after(kAbortTimeout));
    } catch (const std::exception&) {
      // The peer may be the reason we are aborting.
    }
  }

  void wait_done(uint64_t refit, uint64_t seq, std::string& phase) {
    phase = fmt::format("wait for {} to read bucket {}", peer_label_, seq);
    auto msg = receive_message(refit, fmt::format("bucket {} done", seq));
    if (msg.type != protocol::MessageType::kBucketDone || msg.done.seq != seq)
      fail(ErrorKind::kProtocol, "{} sent an unexpected message (type {}, refit {}, bucket {}) instead of 'bucket {} done'",
           peer_label_, static_cast<int>(msg.type), msg.done.refit, msg.done.seq, seq);
  }

  // The bytes of a slice: in place when the slice is one contiguous block of the tensor (a dim-0
  // narrow, or leading dims of 1), else gathered (one 2-D copy, on the GPU for a GPU tensor) into
  // scratch memory of the tensor's kind, kept for the next slice.
  const std::byte* slice_of(const TensorView& view, const Selection& selection) {
    const SliceRows rows = slice_rows(*view.info, selection.slice);
    if (rows.rows <= 1) return view.data + rows.offset;
    // Copies from the scratch issued for the previous slice may still be running.
    if (pack_stream_->pending()) pack_stream_->synchronize(next_deadline());
    std::byte* scratch = nullptr;
    if (view.memory == MemoryKind::kCuda) {
      if (slice_scratch_device_.size() < selection.info.nbytes())
        slice_scratch_device_ = DeviceBuffer(Device{Device::Kind::kCuda, -1}, selection.info.nbytes());  // the current GPU
      scratch = slice_scratch_device_.data();
    } else {
      slice_scratch_.resize(selection.info.nbytes());
      scratch = slice_scratch_.data();
    }
    pack_stream_->copy_2d(scratch, rows.row_bytes, view.data + rows.offset, rows.pitch, rows.row_bytes, rows.rows,
                          view.memory, view.memory);
    return scratch;
  }

  void run_send(WeightSource& weights, uint64_t refit, SendStats& stats, std::string& phase) {
    BucketPacker packer(options_.bucket_bytes);
    protocol::BucketReady bucket;
    bucket.refit = refit;
    // Announced buckets the destination is not done with: at most one per buffer. A bucket is
    // announced as soon as it is packed, while the destination still reads the one before, so
    // that its reads follow each other with no round trip between them.
    std::deque<uint64_t> unacknowledged;

    auto bucket_start = Clock::now();
    auto flush = [&](bool is_last) {
      // Every copy into this buffer must be complete before the destination may read it.
      if (pack_stream_->pending()) {
        phase = fmt::format("copy into bucket {}", bucket.seq);
        pack_stream_->synchronize(next_deadline());
      }
      if (options_.config.verify_checksums) bucket.checksum = XXH3_64bits(buffers_[bucket.buffer], bucket.used_bytes);
      const auto packed = Clock::now();
      bucket.is_last = is_last;
      phase = fmt::format("announce bucket {}", bucket.seq);
      transport_->send(peer_, protocol::encode(bucket), next_deadline());
      unacknowledged.push_back(bucket.seq);
      ++stats.buckets;
      const uint64_t announced = bucket.seq;
      bucket.seq++;
      bucket.buffer ^= 1;
      bucket.entries.clear();
      bucket.used_bytes = 0;
      // The next bucket goes into the other buffer: the destination must be done with the bucket
      // that buffer holds.
      if (unacknowledged.size() == static_cast<size_t>(kBufferCount)) {
        wait_done(refit, unacknowledged.front(), phase);
        unacknowledged.pop_front();
      }
      spdlog::debug("{}: bucket {} packed and announced in {:.2f} ms, then {:.2f} ms waiting for {} to free a buffer",
                    self_, announced, Seconds(packed - bucket_start).count() * 1e3,
                    Seconds(Clock::now() - packed).count() * 1e3, peer_label_);
      bucket_start = Clock::now();
    };

    std::set<std::string, std::less<>> sent;  // names, to check the layout's requests were met
    TensorView view;
    while (true) {
      phase = fmt::format("pack bucket {}", bucket.seq);
      if (!weights.next(&view)) break;
      if (view.info == nullptr) fail(ErrorKind::kInvalidArgument, "the weight stream yielded a tensor without metadata");
      const TensorInfo& info = *view.info;
      const uint64_t nbytes = info.nbytes();
      if (nbytes > 0 && view.data == nullptr)
        fail(ErrorKind::kInvalidArgument, "tensor '{}' ({} bytes) has no data pointer", info.name, nbytes);

      // What the destination holds of this tensor: all of it, a slice, or nothing.
      Selection selection{Take::kWhole, {}, info};
      if (target_layout_) selection = select(*target_layout_, info);
      if (selection.take == Take::kDrop) {
        ++stats.dropped;
        continue;
      }
      const std::byte* data = view.data;
      MemoryKind data_kind = view.memory;
      if (selection.take == Take::kSlice) data = in_phase(fmt::format("gathering a slice of '{}'", info.name), [&] {
        return slice_of(view, selection);
      });
      for (const ChunkPlacement& c : packer.place(selection.info)) {
        if (c.starts_bucket) flush(false);
        if (c.size > 0)
          pack_stream_->copy(buffers_[bucket.buffer] + c.bucket_offset, data + c.tensor_offset, c.size, buffer_kind_,
                             data_kind);
        bucket.entries.push_back({selection.info, c.tensor_offset, c.size, c.bucket_offset});
        bucket.used_bytes = c.bucket_offset + c.size;
      }
      sent.insert(info.name);
      ++stats.tensors;
      stats.payload_bytes += selection.info.nbytes();
    }
    if (target_layout_) {
      // A destination that declared a tensor must get it: a request the stream never met would
      // otherwise leave that parameter stale with no word said.
      for (const auto& [name, request] : target_layout_->tensors)
        if (request.take != Take::kDrop && !sent.count(name))
          fail(ErrorKind::kLayout, "{} holds '{}' but the weight stream never yielded it", peer_label_, name);
    }
    flush(true);
    for (; !unacknowledged.empty(); unacknowledged.pop_front()) wait_done(refit, unacknowledged.front(), phase);
  }

  void run_receive(const BatchLoader& loader, uint64_t refit, ReceiveStats& stats, std::string& phase) {
    assembler_.reset();
    FetchContext context{transport_.get(), peer_, peer_label_, &peer_metadata_, {buffers_[0], buffers_[1]},
                         region_, mapped_source_, options_.bucket_bytes, refit, options_.config.timeout_s,
                         options_.config.verify_checksums};
    stats.mapped = mapped_source_ != nullptr;
    stats.buffer_bytes = has_buffers_ ? kBufferCount * options_.bucket_bytes : 0;
    BucketFetcher fetcher(std::move(context));
    while (true) {
      auto fetched = fetcher.next(phase);
      const auto& bucket = fetched.bucket;
      stats.wire_bytes += bucket.used_bytes;
      ++stats.buckets;

      phase = fmt::format("assemble bucket {}", bucket.seq);
      auto batch = assembler_.add_bucket(bucket, fetched.data, peer_label_, next_deadline());
      if (!batch.empty()) {
        phase = fmt::format("load bucket {}", bucket.seq);
        const auto load_start = Clock::now();
        loader(batch);
        stats.load_seconds += seconds_since(load_start);
        spdlog::debug("{}: bucket {} ({} bytes) loaded in {:.2f} ms", self_, bucket.seq, bucket.used_bytes,
                      seconds_since(load_start) * 1e3);
        ++stats.batches;
        stats.tensors += batch.size();
        for (const auto& v : batch) stats.payload_bytes += v.info->nbytes();
      }
      fetcher.release(bucket.seq);
      if (bucket.is_last) {
        assembler_.finish(peer_label_);
        fetcher.finish(phase);
        stats.route = mapped_source_ ? transport_->name() + " mapped" : transport_->route(peer_);
        return;
      }
    }
  }

  EngineOptions options_;
  std::shared_ptr<Transport> transport_;
  RegionId region_ = 0;                    // one allocation of the transport holds both buffers
  std::byte* buffers_[kBufferCount] = {};  // buffer b at b * bucket_bytes of it
  // Where transfer buffers (ours, or the source's mapped) live: the configured device's kind.
  const MemoryKind buffer_kind_ =
      options_.config.device.kind == Device::Kind::kCuda ? MemoryKind::kCuda : MemoryKind::kHost;
  bool has_buffers_ = false;
  HostPin pin_;                            // host buffers, page-locked when a GPU is usable
  const std::byte* mapped_source_ = nullptr;  // on a destination: its source's buffers, mapped (or null)
  HostPin mapped_pin_;
  std::unique_ptr<CopyStream> pack_stream_;  // on a source: copies into the transfer buffers
  bool prepared_ = false;  // prepare() ran since the buffers were last released

  std::string self_;
  bool is_destination_ = false;
  bool has_peer_ = false;
  PeerId peer_ = 0;
  std::string peer_label_;
  protocol::EngineMetadata peer_metadata_;
  uint64_t refits_ = 0;       // since connect; names refits in errors
  uint64_t first_refit_ = 0;  // protocol::first_refit() of this connection; refit k is first_refit_ + k on the wire
  uint64_t generation_ = 0;   // of this engine's latest metadata
  bool stale_ = true;
  TensorAssembler assembler_;
  std::optional<Layout> target_layout_;    // on a source: what its destination holds
  std::vector<std::byte> slice_scratch_;   // on a source: gathered non-contiguous slices of host tensors
  DeviceBuffer slice_scratch_device_;      // ... and of GPU tensors
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
SendStats CheckpointEngine::send(WeightSource& weights) { return impl_->send(weights); }
ReceiveStats CheckpointEngine::receive(const BatchLoader& loader) { return impl_->receive(loader); }
void CheckpointEngine::finalize() { impl_->finalize(); }
bool CheckpointEngine::stale() const { return impl_->stale(); }
uint64_t CheckpointEngine::bucket_bytes() const { return impl_->bucket_bytes(); }
const Transport& CheckpointEngine::transport() const { return impl_->transport(); }
const Layout* CheckpointEngine::target_layout() const { return impl_->target_layout(); }

}  // namespace refit
