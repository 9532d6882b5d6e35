#include "core/error.h"

#include <string_view>

namespace ds::detail {

// The part of `file` from the project's src/ directory on. The last "/src/"
// is the project's own: the checkout itself may sit below some other src/.
static std::string_view source_relative(std::string_view file) {
  const size_t pos = file.rfind("/src/");
  if (pos != std::string_view::npos) return file.substr(pos + 1);
  return file;  // already relative ("src/...") or outside src/
}

void fail(const char* file, int line, const char* cond, const std::string& msg) {
  // Locations do not depend on where the tree was built.
  std::string where = fmt::format("{}:{}", source_relative(file), line);
  if (cond) throw Error(fmt::format("{} [{}: check `{}` failed]", msg, where, cond));
  throw Error(fmt::format("{} [{}]", msg, where));
}

}  // namespace ds::detail
