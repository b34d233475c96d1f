// Reading a Hugging Face config.json, from a file, a directory holding one, or a model compiled
// into the library ("builtin:<name>", so an installed refit needs no data folder). Every error
// names the config it came from.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace refit {

struct HfConfig {
  std::string origin;   // the file read, or "builtin:<name>"; errors name it
  nlohmann::json json;  // an object
};

HfConfig read_hf_config(const std::string& path);

// True for "builtin:<name>" references (whether or not such a model exists).
bool is_builtin_model(std::string_view path);

// The config.json text of a built-in model, or nullptr when there is none of that name.
const char* builtin_model_config(std::string_view name);

}  // namespace refit
