#include "engine/link_sender.h"

#include <spdlog/spdlog.h>

#include "core/fail.h"
#include "engine/peer_wait.h"
#include "refit/ext/box_copy.h"

namespace refit {

void LinkSender::begin(uint64_t refit, bool in_place) {
  in_place_ = in_place && in_place_regions_ != nullptr ? link_.access : SourceAccess::kNone;
  if (packer_)
    packer_->restart();
  else
    packer_.emplace(link_.bucket_bytes);
  bucket_ = protocol::BucketReady{};
  bucket_.refit = refit;  // this refit's number: the acknowledgements it waits for carry it too
  buffer_ = 0;
  unacknowledged_.clear();
  buffers_held_ = 0;
  payload_bytes_ = in_place_bytes_ = replayed_ = 0;
  events_.clear();
  // A refit that failed may have left the destination with other manifests than ours.
  if (!completed_) previous_.clear();
  completed_ = false;
  sent_.clear();
  replaying_ = !previous_.empty();
  open_bucket();
}

void LinkSender::open_bucket() {
  bucket_.offset = link_.buffer_offset(buffer_);
  bucket_.used_bytes = 0;
  bucket_.manifest.reset();
  manifest_ = replaying_ ? nullptr : std::make_shared<protocol::Manifest>();
  matched_ = 0;
  buffer_bytes_ = 0;
  last_entry_ = {};
  bucket_regions_.clear();
  regions_.clear();
  entry_data_.clear();
  pack_start_.reset();
  pack_phase_ = fmt::format("pack bucket {} for {}", bucket_.seq, link_.label);
}

void LinkSender::record(const TensorInfo& tensor, const Box& piece, const Chunk& c, const std::byte* data) {
  if (link_.verify_checksums) entry_data_.push_back(data);
  if (c.size > 0) last_entry_ = {c.region, c.region == 0 ? c.bucket_offset : c.source_offset, c.bucket_offset, c.size};
  if (replaying_) {
    const protocol::Manifest* counterpart =
        bucket_.seq < previous_.size() ? previous_[bucket_.seq].manifest.get() : nullptr;
    if (counterpart && matched_ < counterpart->entries.size()) {
      const protocol::ManifestEntry& e = counterpart->entries[matched_];
      if (e.tensor_offset == c.tensor_offset && e.size == c.size && e.bucket_offset == c.bucket_offset &&
          e.region == c.region && e.source_offset == c.source_offset && e.box == piece && e.tensor == tensor) {
        ++matched_;
        return;
      }
    }
    stop_replaying();
  }
  manifest_->entries.push_back({tensor, piece, c.tensor_offset, c.size, c.bucket_offset, c.region, c.source_offset});
}

void LinkSender::stop_replaying() {
  replaying_ = false;
  manifest_ = std::make_shared<protocol::Manifest>();
  if (matched_ > 0) {
    const auto& common = previous_[bucket_.seq].manifest->entries;
    manifest_->entries.assign(common.begin(), common.begin() + static_cast<std::ptrdiff_t>(matched_));
  }
}

std::optional<SourceRegions::Found> LinkSender::find_in_place(const TensorView& view, const Box& box, uint64_t size,
                                                              SourceAccess access, const std::byte** data,
                                                              bool register_new) const {
  // Checksums are computed on the CPU: only host memory goes in place with them.
  if (size == 0 || (link_.verify_checksums && view.memory != MemoryKind::kHost)) return std::nullopt;
  // Only a piece that is one contiguous range of the view.
  uint64_t first = 0, blocks = 0;
  bool contiguous = true;
  if (!box.is_whole()) {
    const TensorInfo& source = *view.info;
    for_each_box_block(source.shape, dtype_size(source.dtype), box, 0, size, [&](const BoxBlock& b) {
      if (blocks++ == 0) first = b.tensor_offset;
      contiguous = contiguous && blocks == 1 && (b.rows <= 1 || b.pitch == b.row_bytes);
    });
  }
  if (!contiguous) return std::nullopt;
  *data = view.data + first;
  return in_place_regions_->find(*data, size, view.memory, access, register_new);
}

uint32_t LinkSender::bucket_region(const SourceRegions::Found& found) {
  auto [it, fresh] = regions_.try_emplace(found.region, static_cast<uint32_t>(regions_.size() + 1));
  if (fresh) bucket_regions_.push_back(*found.remote);
  return it->second;
}

bool LinkSender::add_in_place(const TensorView& view, const Box& box, const TensorInfo& tensor, const Box& piece,
                              std::string& phase) {
  const uint64_t size = piece.is_whole() ? tensor.nbytes() : piece.nbytes_in(tensor);
  const std::byte* data = nullptr;
  const auto found = find_in_place(view, box, size, SourceAccess::kMap, &data);
  if (route_piece(SourceAccess::kMap, found.has_value(), size) != PieceRoute::kMap) return false;
  if (packer_->place_in_place(tensor, size)) flush(false, phase);
  if (!pack_start_) pack_start_ = timeline_now();
  // Mapped: it takes no room in the bucket.
  record(tensor, piece, {0, size, 0, bucket_region(*found), found->offset}, data);
  in_place_bytes_ += size;
  payload_bytes_ += size;
  return true;
}

void LinkSender::add(const TensorView& view, const Box& box, const TensorInfo& tensor, const Box& piece,
                     std::string& phase) {
  if (in_place_ == SourceAccess::kMap && add_in_place(view, box, tensor, piece, phase)) return;
  const TensorInfo& source = *view.info;
  const TensorInfo packed{tensor.name, tensor.dtype, piece.shape_in(tensor.shape)};
  const uint64_t element = dtype_size(source.dtype);
  // Read from our memory: where the piece lies there, if it can go so. A small piece only where it
  // might continue the read before it, so in memory registered already.
  const std::byte* readable_data = nullptr;
  const bool read_alone = route_piece(in_place_, true, packed.nbytes()) == PieceRoute::kRead;
  const auto readable = in_place_ == SourceAccess::kRead && (read_alone || last_entry_.region > 0)
                            ? find_in_place(view, box, packed.nbytes(), SourceAccess::kRead, &readable_data,
                                            /*register_new=*/read_alone)
                            : std::nullopt;
  for (const ChunkPlacement& c : packer_->place(packed)) {
    if (c.starts_bucket) flush(false, phase);
    if (!pack_start_) pack_start_ = timeline_now();
    phase = pack_phase_;
    Chunk entry{c.tensor_offset, c.size, c.bucket_offset};
    const std::byte* data = nullptr;
    if (readable) {
      const uint64_t source_offset = readable->offset + c.tensor_offset;
      const auto known = regions_.find(readable->region);
      const bool continues =
          known != regions_.end() && protocol::continues(last_entry_, known->second, source_offset, c.bucket_offset);
      if (route_piece(in_place_, true, packed.nbytes(), continues) == PieceRoute::kRead) {
        entry.region = bucket_region(*readable);
        entry.source_offset = source_offset;
        data = readable_data + c.tensor_offset;
        in_place_bytes_ += c.size;
      }
    }
    if (entry.region == 0) {
      std::byte* out = link_.buffers[buffer_] + c.bucket_offset;
      for_each_box_block(source.shape, element, box, c.tensor_offset, c.size, [&](const BoxBlock& b) {
        stream_.copy_2d(out + (b.packed_offset - c.tensor_offset), b.row_bytes, view.data + b.tensor_offset, b.pitch,
                        b.row_bytes, b.rows, buffer_kind_, view.memory);
      });
      data = out;
      buffer_bytes_ += c.size;
    }
    record(tensor, piece, entry, data);
    bucket_.used_bytes = c.bucket_offset + c.size;
  }
  payload_bytes_ += packed.nbytes();
}

void LinkSender::flush(bool is_last, std::string& phase) {
  const auto start = Clock::now();
  // Every copy into this buffer must be complete before the destination may read it.
  if (stream_.pending()) {
    phase = fmt::format("copy into bucket {} for {}", bucket_.seq, link_.label);
    stream_.synchronize(link_.next_deadline());
  }
  // Whether the destination takes any of the bucket from the buffer (else all of it lies in our
  // tensors, and the buffer is free for the next bucket at once).
  const bool uses_buffer = buffer_bytes_ > 0;
  // The bucket goes as a replay when it equals its counterpart of the previous refit whole.
  const bool replay = replaying_ && bucket_.seq < previous_.size() &&
                      matched_ == previous_[bucket_.seq].manifest->entries.size() &&
                      bucket_.used_bytes == previous_[bucket_.seq].used_bytes &&
                      bucket_regions_ == previous_[bucket_.seq].manifest->regions;
  if (replay) {
    bucket_.replay_of = previous_refit_;
    bucket_.manifest = previous_[bucket_.seq].manifest;
    ++replayed_;
  } else {
    if (replaying_) stop_replaying();
    manifest_->regions = std::move(bucket_regions_);
    bucket_.replay_of.reset();
    bucket_.manifest = std::move(manifest_);
  }
  sent_.push_back({bucket_.manifest, bucket_.used_bytes});
  if (link_.verify_checksums)
    bucket_.checksum = protocol::bucket_checksum(*bucket_.manifest, [&](size_t k) { return entry_data_[k]; });
  bucket_.is_last = is_last;
  phase = fmt::format("announce bucket {} to {}", bucket_.seq, link_.label);
  const double packed = timeline_now();
  events_.push_back({TimelinePhase::kPack, link_.peer_rank, bucket_.seq, pack_start_.value_or(packed), packed,
                     bucket_.used_bytes, static_cast<uint32_t>(bucket_.entries().size())});
  // Stamped before it goes: the destination may act on it before send() returns here.
  events_.push_back({TimelinePhase::kAnnounce, link_.peer_rank, bucket_.seq, packed, packed, bucket_.used_bytes});
  link_.transport->send(link_.peer, protocol::encode(bucket_), link_.next_deadline());
  unacknowledged_.push_back({bucket_.seq, uses_buffer});
  buffers_held_ += uses_buffer ? 1 : 0;
  const auto announced = Clock::now();
  bucket_.seq++;
  if (uses_buffer) buffer_ ^= 1;
  open_bucket();
  // The next bucket goes into the other buffer: the destination must be done with the bucket that
  // buffer holds (acknowledgements come in order). Buckets that hold nothing in a buffer do not
  // wait: a destination reading in place goes from one to the next with no round trip between.
  while (!is_last && buffers_held_ == 2) acknowledged_oldest(phase);
  spdlog::debug("bucket {} for {}: announced after {:.2f} ms, then {:.2f} ms waiting for a free buffer",
                bucket_.seq - 1, link_.label, std::chrono::duration<double>(announced - start).count() * 1e3,
                std::chrono::duration<double>(Clock::now() - announced).count() * 1e3);
}

void LinkSender::flush_last(std::string& phase) { flush(true, phase); }

void LinkSender::send_early(uint64_t bytes, std::string& phase) {
  if (bucket_.used_bytes < bytes) return;
  flush(false, phase);
  packer_->close_bucket();
}

void LinkSender::wait_done(std::string& phase) {
  while (!unacknowledged_.empty()) acknowledged_oldest(phase);
  // The destination has every bucket of this refit, so the next may replay their manifests.
  previous_ = std::move(sent_);
  previous_refit_ = bucket_.refit;
  completed_ = true;
}

void LinkSender::acknowledged_oldest(std::string& phase) {
  const uint64_t seq = unacknowledged_.front().seq;
  phase = fmt::format("wait for {} to read bucket {}", link_.label, seq);
  const Deadline deadline = link_.next_deadline();
  const std::string expecting = fmt::format("bucket {} done", seq);
  protocol::Message msg;
  while (true) {
    const Bytes bytes = receive_watching(*link_.transport, link_.peer, link_.label, link_.metadata.process, deadline);
    msg = protocol::decode_message(bytes, link_.label);
    if (protocol::concerns(msg, bucket_.refit, link_.first_refit)) break;
    spdlog::debug("discarding a message of an earlier refit from {}", link_.label);
  }
  if (msg.type == protocol::MessageType::kAbort) protocol::raise_abort(msg.abort, link_.label, expecting);
  if (msg.type != protocol::MessageType::kBucketDone || msg.done.seq != seq)
    fail(ErrorKind::kProtocol, "{} sent an unexpected message (type {}, refit {}, bucket {}) instead of '{}'",
         link_.label, static_cast<int>(msg.type), msg.done.refit, msg.done.seq, expecting);
  const double seen = timeline_now();
  events_.push_back({TimelinePhase::kRelease, link_.peer_rank, seq, seen, seen, 0});
  buffers_held_ -= unacknowledged_.front().uses_buffer ? 1 : 0;
  unacknowledged_.pop_front();
}

}  // namespace refit
