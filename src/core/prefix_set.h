// Which names start with one of a set of prefixes, in O(dots in the name) rather than O(prefixes):
// layout prefixes end with '.', so a name starts with one exactly when the name cut after one of
// its dots is in the set. Prefixes without a trailing '.' (invalid in layouts, but builders accept
// what callers pass) are matched one by one.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace refit {

class PrefixSet {
 public:
  explicit PrefixSet(const std::vector<std::string>& prefixes) {
    for (const auto& p : prefixes) {
      if (!p.empty() && p.back() == '.')
        dotted_.insert(p);
      else
        other_.push_back(p);
    }
  }
  bool matches(std::string_view name) const {
    if (!dotted_.empty())
      for (size_t dot = name.find('.'); dot != std::string_view::npos; dot = name.find('.', dot + 1))
        if (dotted_.count(name.substr(0, dot + 1))) return true;
    return std::any_of(other_.begin(), other_.end(), [&](const std::string& p) { return name.starts_with(p); });
  }

 private:
  std::unordered_set<std::string_view> dotted_;  // views of the caller's strings
  std::vector<std::string> other_;
};

}  // namespace refit
