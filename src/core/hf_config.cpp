#include "core/hf_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/fail.h"
#include "refit/model.h"

namespace refit {
namespace {

constexpr std::string_view kBuiltinPrefix = "builtin:";

nlohmann::json parse_object(const std::string& text, const std::string& origin) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorKind::kModel, "config '{}': bad JSON: {}", origin, e.what());
  }
  if (!json.is_object()) fail(ErrorKind::kModel, "config '{}': not a JSON object", origin);
  return json;
}

}  // namespace

bool is_builtin_model(std::string_view path) { return path.starts_with(kBuiltinPrefix); }

HfConfig read_hf_config(const std::string& path) {
  if (is_builtin_model(path)) {
    const char* text = builtin_model_config(std::string_view(path).substr(kBuiltinPrefix.size()));
    if (!text) fail(ErrorKind::kModel, "model '{}': no such built-in model (built in: {})", path, kDefaultModel);
    return {path, parse_object(text, path)};
  }
  std::error_code ec;
  std::string file =
      std::filesystem::is_directory(path, ec) ? (std::filesystem::path(path) / "config.json").string() : path;
  std::ifstream in(file);
  if (!in) fail(ErrorKind::kModel, "config '{}': cannot open (missing or unreadable)", file);
  std::stringstream text;
  text << in.rdbuf();
  return {file, parse_object(text.str(), file)};
}

}  // namespace refit
