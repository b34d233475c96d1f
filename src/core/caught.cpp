#include "core/caught.h"

#include <fmt/format.h>

#include <new>
#include <system_error>

namespace refit {

Caught describe_caught(std::exception_ptr caught, ErrorKind caller_kind, std::string_view caller_prefix,
                       std::string_view who) {
  try {
    std::rethrow_exception(caught);
  } catch (const Error& e) {
    return {e.kind(), e.what()};
  } catch (const std::bad_alloc&) {
    return {ErrorKind::kInternal, "out of memory (std::bad_alloc)"};
  } catch (const std::system_error& e) {
    return {ErrorKind::kInternal, fmt::format("{} (std::system_error, code {})", e.what(), e.code().value())};
  } catch (const std::exception& e) {
    return {caller_kind, fmt::format("{}{}", caller_prefix, e.what())};
  } catch (...) {
    return {ErrorKind::kInternal, fmt::format("{} threw something that is not a std::exception", who)};
  }
}

}  // namespace refit
