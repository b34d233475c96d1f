#include "refit/timeline.h"

#include <array>

#include "core/fail.h"

namespace refit {
namespace {
constexpr std::array<std::string_view, 6> kNames = {"pack", "announce", "read", "load", "release", "gather"};
}  // namespace

std::string_view to_string(TimelinePhase phase) { return kNames.at(static_cast<size_t>(phase)); }

TimelinePhase parse_timeline_phase(std::string_view text) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (kNames[i] == text) return static_cast<TimelinePhase>(i);
  fail(ErrorKind::kInvalidArgument,
       "unknown timeline phase '{}' (expected pack, announce, read, load, release or gather)", text);
}

}  // namespace refit
