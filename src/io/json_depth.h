// How deep JSON text nests, found before any parser sees it: nlohmann's
// parser costs about 40 bytes of memory per byte of "[[[[...", so bodies
// and model output are refused past a depth instead.
#pragma once

#include <string_view>

namespace ds::io {

// Whether `text` nests deeper than max_depth arrays and objects outside its
// strings (an O(n) scan that allocates nothing). Text that is not JSON is
// left to the parser to name.
inline bool json_nests_deeper(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

}  // namespace ds::io
