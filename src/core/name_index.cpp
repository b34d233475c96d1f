#include "core/name_index.h"

#include <algorithm>
#include <functional>

namespace refit {

uint64_t NameIndex::hash_of(std::string_view name) {
  const uint64_t h = std::hash<std::string_view>{}(name);
  return h == 0 ? 1 : h;
}

std::string_view NameIndex::name(uint32_t index) const {
  const Span& s = names_.at(index);
  return std::string_view(arena_).substr(s.offset, s.length);
}

size_t NameIndex::slot_of(std::string_view name, uint64_t hash) const {
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.hash == 0 || (s.hash == hash && this->name(s.index) == name)) return i;
  }
}

void NameIndex::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.empty() ? 64 : old.size() * 2, Slot{});
  const size_t mask = slots_.size() - 1;
  for (const Slot& s : old) {
    if (s.hash == 0) continue;
    size_t i = s.hash & mask;
    while (slots_[i].hash != 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

NameIndex::Added NameIndex::add(std::string_view name) {
  if (2 * (names_.size() + 1) > slots_.size()) grow();
  const uint64_t hash = hash_of(name);
  Slot& slot = slots_[slot_of(name, hash)];
  if (slot.hash != 0) return {slot.index, false};
  slot = {hash, static_cast<uint32_t>(names_.size())};
  names_.push_back({arena_.size(), name.size()});
  arena_.append(name);
  return {slot.index, true};
}

std::optional<uint32_t> NameIndex::find(std::string_view name) const {
  if (names_.empty()) return std::nullopt;
  const Slot& slot = slots_[slot_of(name, hash_of(name))];
  if (slot.hash == 0) return std::nullopt;
  return slot.index;
}

void NameIndex::prefetch(std::string_view name) const {
  if (!slots_.empty()) __builtin_prefetch(&slots_[hash_of(name) & (slots_.size() - 1)]);
}

void NameIndex::clear() {
  if (names_.empty()) return;
  std::fill(slots_.begin(), slots_.end(), Slot{});
  names_.clear();
  arena_.clear();
}

}  // namespace refit
