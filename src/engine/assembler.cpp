#include "engine/assembler.h"

#include <cstring>

#include "core/fail.h"
#include "refit/ext/box_copy.h"
#include "refit/ext/device_memory.h"

namespace refit {

void TensorAssembler::set_memory(MemoryKind kind, const Device& device) {
  if (kind == kind_ && device == device_) return;
  release();
  kind_ = kind;
  device_ = device;
  stream_ = std::make_unique<CopyStream>(device);
}

void TensorAssembler::begin_batch() {
  batch_infos_.clear();
  owners_.clear();
  views_.clear();
}

void TensorAssembler::stop_deferring() {
  if (!deferring_) return;
  // The first bucket that is new this refit: from here on every name is checked.
  deferring_ = false;
  for (const auto& manifest : deferred_)
    for (const auto& e : manifest->entries)
      if (e.box.is_whole() && e.tensor_offset == 0 && e.size == e.tensor.nbytes()) names_.add(e.tensor.name);
  deferred_.clear();
}

std::span<const TensorView> TensorAssembler::add_bucket(const protocol::BucketReady& bucket,
                                                        const protocol::BucketBytes& bytes, const std::string& who,
                                                        Deadline deadline, bool repeats_checked) {
  begin_batch();
  if (deferring_ && repeats_checked)
    deferred_.push_back(bucket.manifest);
  else
    stop_deferring();
  for (const auto& e : bucket.entries())
    add_chunk(e, bytes.at(e), bytes.in_region(e) ? bucket.regions()[e.region - 1].memory : kind_, nullptr, bucket.seq,
              who);
  // The loader reads merged tensors, and the link's reader refills this bucket's buffer, after we return.
  if (stream_->pending()) stream_->synchronize(deadline);
  return views_;
}

std::span<const TensorView> TensorAssembler::add_pieces(
    std::span<const TensorView> views, std::span<const std::shared_ptr<const void>> owners,
    const std::map<std::string, protocol::ManifestEntry, std::less<>>& pieces, uint64_t seq, const std::string& who,
    Deadline deadline) {
  begin_batch();
  stop_deferring();
  for (size_t k = 0; k < views.size(); ++k) {
    const TensorView& view = views[k];
    auto it = pieces.find(view.info->name);
    if (it == pieces.end())
      fail(ErrorKind::kProtocol, "bucket {} from {}: '{}' is no piece the plan sends this destination", seq, who,
           view.info->name);
    const protocol::ManifestEntry& e = it->second;
    if (view.info->nbytes() != e.size)
      fail(ErrorKind::kProtocol, "bucket {} from {}: piece '{}' has {} bytes, the plan's {}", seq, who, view.info->name,
           view.info->nbytes(), e.size);
    add_chunk(e, view.data, view.memory, k < owners.size() ? owners[k] : nullptr, seq, who);
  }
  if (stream_->pending()) stream_->synchronize(deadline);
  return views_;
}

void TensorAssembler::add_chunk(const protocol::ManifestEntry& e, const std::byte* chunk, MemoryKind chunk_kind,
                                std::shared_ptr<const void> owner, uint64_t seq, const std::string& who) {
  const uint64_t nbytes = e.tensor.nbytes();
  const bool whole = e.box.is_whole() && e.tensor_offset == 0 && e.size == nbytes;
  auto merge = merging_.empty() ? merging_.end() : merging_.find(e.tensor.name);
  const bool delivered = whole ? merge != merging_.end() || (!deferring_ && !names_.add(e.tensor.name).added)
                               : names_.contains(e.tensor.name);
  if (delivered)
    fail(ErrorKind::kProtocol, "bucket {} from {}: tensor '{}' delivered twice in one refit", seq, who, e.tensor.name);
  if (whole) {
    views_.push_back({&e.tensor, chunk, chunk_kind});
    owners_.push_back(std::move(owner));
    ++completed_;
    return;
  }
  if (merge == merging_.end()) {
    auto& buffer = merge_buffers_[e.tensor.name];
    // A buffer someone else still holds (a tensor handed out before) is theirs now.
    if (!buffer || buffer.use_count() > 1 || buffer->size() != nbytes) {
      buffer.reset();  // the old one goes before the new one is allocated
      buffer = std::make_shared<TensorMemory>(kind_, device_, nbytes, /*pin=*/true);
    }
    merge = merging_.emplace(e.tensor.name, Merge{e.tensor, buffer, 0, {}}).first;
  } else if (merge->second.info != e.tensor) {
    fail(ErrorKind::kProtocol, "bucket {} from {}: chunks of '{}' disagree on dtype or shape", seq, who, e.tensor.name);
  }
  Merge& m = merge->second;
  claim(m, e, seq, who);
  if (e.size > nbytes - m.received)
    fail(ErrorKind::kProtocol, "bucket {} from {}: a chunk of {} bytes of '{}' exceeds its {} bytes ({} here already)",
         seq, who, e.size, e.tensor.name, nbytes, m.received);
  for_each_box_block(
      e.tensor.shape, dtype_size(e.tensor.dtype), e.box, e.tensor_offset, e.size, [&](const BoxBlock& b) {
        stream_->copy_2d(m.buffer->data() + b.tensor_offset, b.pitch, chunk + (b.packed_offset - e.tensor_offset),
                         b.row_bytes, b.row_bytes, b.rows, kind_, chunk_kind);
      });
  m.received += e.size;
  if (m.received == nbytes) {
    names_.add(e.tensor.name);
    ++completed_;
    batch_infos_.push_back(std::move(m.info));
    views_.push_back({&batch_infos_.back(), m.buffer->data(), kind_});
    owners_.push_back(std::move(m.buffer));
    merging_.erase(merge);
  }
}

namespace {

// Whether two blocks of a tensor of `shape` share an element.
bool intersect(const Box& a, const Box& b, const std::vector<int64_t>& shape) {
  for (size_t d = 0; d < shape.size(); ++d) {
    const Slice x = a.along(static_cast<int32_t>(d), shape), y = b.along(static_cast<int32_t>(d), shape);
    if (x.length == 0 || y.length == 0 || x.start >= y.start + y.length || y.start >= x.start + x.length) return false;
  }
  return true;
}

}  // namespace

void TensorAssembler::claim(Merge& m, const protocol::ManifestEntry& e, uint64_t seq, const std::string& who) {
  if (e.size == 0) return;
  PieceRanges* piece = nullptr;
  for (auto& p : m.pieces) {
    if (p.box == e.box) {
      piece = &p;
    } else if (intersect(p.box, e.box, e.tensor.shape)) {
      fail(ErrorKind::kProtocol, "bucket {} from {}: piece {} of '{}' overlaps piece {} received before", seq, who,
           to_string(e.box), e.tensor.name, to_string(p.box));
    }
  }
  if (piece == nullptr) piece = &m.pieces.emplace_back(PieceRanges{e.box, {}});
  const uint64_t begin = e.tensor_offset, end = e.tensor_offset + e.size;
  auto next = piece->ranges.lower_bound(begin);
  const bool overlaps_next = next != piece->ranges.end() && next->first < end;
  const bool overlaps_previous = next != piece->ranges.begin() && std::prev(next)->second > begin;
  if (overlaps_next || overlaps_previous)
    fail(ErrorKind::kProtocol, "bucket {} from {}: bytes [{}, {}) of piece {} of '{}' arrived twice", seq, who, begin,
         end, to_string(e.box), e.tensor.name);
  piece->ranges.emplace(begin, end);
}

void TensorAssembler::finish(const std::string& who) const {
  if (merging_.empty()) return;
  const Merge& m = merging_.begin()->second;
  fail(ErrorKind::kProtocol, "refit from {} ended with {} tensor(s) incomplete, among them '{}' ({} of {} bytes)", who,
       merging_.size(), m.info.name, m.received, m.info.nbytes());
}

void TensorAssembler::reset() {
  merging_.clear();
  names_.clear();
  completed_ = 0;
  deferring_ = true;
  deferred_.clear();
  begin_batch();
}

void TensorAssembler::release() {
  reset();
  merge_buffers_.clear();
}

}  // namespace refit
