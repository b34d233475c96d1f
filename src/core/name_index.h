// Numbers names in the order they are added: the duplicate checks a refit makes per tensor (a
// name yielded twice, a tensor delivered twice) and a loader's lookup of its parameter by name.
// A refit of a DeepSeek-V3 rank meets ~45k names, so the index keeps their bytes in one arena, in
// the order added, and their hashes in one open-addressed table: no allocation per name, one
// cache line of the table per lookup, and clear() keeps the memory for the next refit.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace refit {

class NameIndex {
 public:
  struct Added {
    uint32_t index = 0;  // the name's number
    bool added = false;  // false: it was there already
  };
  Added add(std::string_view name);
  std::optional<uint32_t> find(std::string_view name) const;
  bool contains(std::string_view name) const { return find(name).has_value(); }
  size_t size() const { return names_.size(); }
  bool empty() const { return names_.empty(); }
  std::string_view name(uint32_t index) const;
  // Starts loading the table slot of `name` into the cache, for a find() or add() of it soon: a
  // loop over many names issues it a few names ahead, so that the lookups do not wait on memory
  // one after the other.
  void prefetch(std::string_view name) const;
  // Forgets every name, keeping the memory.
  void clear();

 private:
  struct Slot {
    uint64_t hash = 0;   // 0: empty (a name's hash is never 0)
    uint32_t index = 0;  // into names_
  };
  struct Span {
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  static uint64_t hash_of(std::string_view name);
  // The slot holding `name`, or the empty slot where it would go.
  size_t slot_of(std::string_view name, uint64_t hash) const;
  void grow();

  std::vector<Slot> slots_;  // a power of two, at most half full
  std::vector<Span> names_;  // by index: where the name lies in arena_
  std::string arena_;        // every name's bytes, in the order added
};

}  // namespace refit
