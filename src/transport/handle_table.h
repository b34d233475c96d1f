// The regions and peers a backend hands out by id, kept the same way by every backend: ids count
// from 1 and are never reused (a stale id is an error, never someone else's region), and a lookup
// of an unknown id is Error(kInvalidArgument) naming the backend and what was being done
// ("reading 8 bytes from source rank 1: UCX region 7 is not registered"). Not thread-safe: a
// backend guards a table with its own lock where it needs one.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "core/fail.h"

namespace refit {

template <typename T>
class HandleTable {
 public:
  // `backend` and `kind` name an entry in errors ("UCX", "region"); `missing` says what an
  // unknown id is not ("registered", "connected").
  HandleTable(std::string backend, std::string kind, std::string missing)
      : backend_(std::move(backend)), kind_(std::move(kind)), missing_(std::move(missing)) {}

  uint64_t add(T value) {
    const uint64_t id = next_++;
    items_.emplace(id, std::move(value));
    return id;
  }
  T& find(uint64_t id, std::string_view doing) { return *checked(id, doing); }
  const T& find(uint64_t id, std::string_view doing) const {
    return *const_cast<HandleTable*>(this)->checked(id, doing);
  }
  // Null for an unknown id, for callers with their own answer to it.
  T* find_if_present(uint64_t id) {
    auto it = items_.find(id);
    return it == items_.end() ? nullptr : &it->second;
  }
  // Removes the entry and returns it.
  T take(uint64_t id, std::string_view doing) {
    T* item = checked(id, doing);
    T out = std::move(*item);
    items_.erase(id);
    return out;
  }
  void erase(uint64_t id) { items_.erase(id); }
  void clear() { items_.clear(); }
  auto begin() { return items_.begin(); }
  auto end() { return items_.end(); }

 private:
  T* checked(uint64_t id, std::string_view doing) {
    auto it = items_.find(id);
    if (it == items_.end())
      fail(ErrorKind::kInvalidArgument, "{}: {} {} {} is not {}", doing, backend_, kind_, id, missing_);
    return &it->second;
  }

  std::string backend_, kind_, missing_;
  std::map<uint64_t, T> items_;
  uint64_t next_ = 1;
};

}  // namespace refit
