// Device names ("cpu", "cuda", "cuda:N"), apart from the YAML parser so that code without
// yaml-cpp (the fuzz targets) can name devices.
#include <cctype>
#include <charconv>

#include "core/fail.h"
#include "refit/config.h"

namespace refit {

Device parse_device(std::string_view text, std::string_view key) {
  if (text == "cpu") return {Device::Kind::kCpu, -1};
  if (text == "cuda") return {Device::Kind::kCuda, -1};
  constexpr std::string_view kIndexed = "cuda:";
  if (text.starts_with(kIndexed)) {
    const std::string_view rest = text.substr(kIndexed.size());
    int index = -1;
    if (!rest.empty() && std::isdigit(static_cast<unsigned char>(rest[0]))) {
      auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), index);
      if (ec == std::errc() && end == rest.data() + rest.size()) return {Device::Kind::kCuda, index};
    }
  }
  fail(ErrorKind::kConfig, "{} must be cpu, cuda or cuda:N (N >= 0), got '{}'", key, text);
}

std::string to_string(const Device& device) {
  if (device.kind == Device::Kind::kCpu) return "cpu";
  return device.index < 0 ? "cuda" : fmt::format("cuda:{}", device.index);
}

}  // namespace refit
