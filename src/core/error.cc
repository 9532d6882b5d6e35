#include "core/error.h"

#include <cstring>

namespace ds::detail {

void fail(const char* file, int line, const char* cond, const std::string& msg) {
  // Keep only the path below src/ so messages do not depend on the build tree.
  const char* rel = std::strstr(file, "src/");
  std::string where = fmt::format("{}:{}", rel ? rel : file, line);
  if (cond) throw Error(fmt::format("{} [{}: check `{}` failed]", msg, where, cond));
  throw Error(fmt::format("{} [{}]", msg, where));
}

}  // namespace ds::detail
