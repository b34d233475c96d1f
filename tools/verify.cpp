#include "verify.h"

#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>

namespace refit::tools {

using nlohmann::json;

// Every destination must hold exactly the tensors its source sent, with the same bytes.
std::vector<std::string> verify(const RefitReport& report) {
  std::map<int, json> source_hashes, destination_hashes;
  for (const auto& w : report.workers) {
    auto hashes = json::parse(w.detail).value("hashes", json::object());
    (w.is_source ? source_hashes : destination_hashes)[w.rank] = hashes;
  }
  std::vector<std::string> problems;
  for (const auto& [rank, got] : destination_hashes) {
    const json& want = source_hashes.at(rank);
    for (const auto& [name, hash] : want.items()) {
      if (!got.contains(name))
        problems.push_back(fmt::format("destination rank {} never received '{}'", rank, name));
      else if (got[name] != hash)
        problems.push_back(fmt::format("destination rank {}: '{}' differs from source rank {}", rank, name, rank));
    }
    for (const auto& [name, hash] : got.items())
      if (!want.contains(name)) problems.push_back(fmt::format("destination rank {} received unknown '{}'", rank, name));
  }
  return problems;
}

}  // namespace refit::tools
