// Errors: one exception type for everything the library rejects, carrying what
// was being done, the offending values (shapes, sizes) and a hint. The program
// catches it once at its edge and prints one line (see src/cli/main.cc).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace ds {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] void fail(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace ds

// DS_CHECK(cond, "fmt", args...): throws ds::Error naming file, line and the
// failed condition, followed by the formatted message.
#define DS_CHECK(cond, ...)                                                        \
  do {                                                                             \
    if (!(cond)) ::ds::detail::fail(__FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__)); \
  } while (0)

// DS_FAIL("fmt", args...): unconditional error with the same context.
#define DS_FAIL(...) ::ds::detail::fail(__FILE__, __LINE__, nullptr, fmt::format(__VA_ARGS__))
