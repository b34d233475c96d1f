#include "verify.h"

#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>

namespace refit::tools {

using nlohmann::json;

// Every destination must hold exactly the tensors its source sent, with the same bytes; a
// destination that checked itself (resharding: its bytes come from many sources) reports what it
// should hold beside what it holds.
std::vector<std::string> verify(const RefitReport& report) {
  std::map<int, json> source_hashes, destination_hashes, destination_expected;
  for (const auto& w : report.workers) {
    const json detail = json::parse(w.detail);
    (w.is_source ? source_hashes : destination_hashes)[w.rank] = detail.value("hashes", json::object());
    if (!w.is_source && detail.contains("expected")) destination_expected[w.rank] = detail.at("expected");
  }
  std::vector<std::string> problems;
  for (const auto& [rank, got] : destination_hashes) {
    const bool checked_itself = destination_expected.count(rank) > 0;
    const json& want = checked_itself ? destination_expected.at(rank) : source_hashes.at(rank);
    for (const auto& [name, hash] : want.items()) {
      if (!got.contains(name))
        problems.push_back(fmt::format("destination rank {} never received '{}'", rank, name));
      else if (got[name] != hash)
        problems.push_back(
            checked_itself ? fmt::format("destination rank {}: '{}' differs from the model", rank, name)
                           : fmt::format("destination rank {}: '{}' differs from source rank {}", rank, name, rank));
    }
    for (const auto& [name, hash] : got.items())
      if (!want.contains(name))
        problems.push_back(fmt::format("destination rank {} received unknown '{}'", rank, name));
  }
  return problems;
}

}  // namespace refit::tools
