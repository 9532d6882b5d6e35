// Structure-aware mutation for the YAML fuzz targets (LLVMFuzzerCustomMutator).
//
// The run config is a flat YAML mapping, one `key: value` a line, followed
// (after a NUL byte each) by `key=value` overrides. Byte-level mutation seldom
// turns one known key into another, or a number into a list, a map, a huge
// integer or a YAML tag, which is where the readers go wrong (a value of the
// wrong type that escapes as a YAML::Exception, a key read by another path).
// So half of the mutations work on lines and overrides: replace a value, a
// key (from the target's list of known keys), add, drop, copy or move a line;
// the other half go to libFuzzer's own mutator (LLVMFuzzerMutate, with -dict).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace ds_fuzz::yaml {

// Values of every YAML kind and the edge cases of each scalar type.
inline std::string interesting_value(std::mt19937& rng) {
  static const char* const kValues[] = {
      "0", "1", "2", "-1", "-2", "3", "8", "64", "1024", "2147483647", "2147483648", "4294967296",
      "9223372036854775807", "9223372036854775808", "-9223372036854775808", "18446744073709551616",
      "99999999999999999999999", "0x10", "0o17", "1e3", "1.5", "-0.5", "0.0", "1e308", "1e400", "-1e400",
      ".nan", ".inf", "-.inf", "nan", "inf", "true", "false", "True", "yes", "null", "~", "None", "''", "\"\"",
      "x", "\"1\"", "'64'", "[]", "{}", "[1]", "[1, 2]", "[0, 4, 16, 4]", "[[1]]", "{a: 1}", "{[1]: 2}",
      "[silu, linear]", "!!binary aGk=", "!!int 3", "!!str 3", "!custom 1", "&a 1", "*a", "|\n  x", ">-\n  y",
      "deepseek", "deepseek4", "deepseek_v4", "compressed", "custom", "full", "minimal", "remat", "device", "offload",
      "synthetic", "json", "tokens", "copy", "random", "cosine", "wsd", "linear", "alltoall", "allgather",
      "sigmoid", "softmax", "sqrtsoftplus", "noaux_tc", "yarn", "adamw", "float32", "bfloat16", "tiny", "small",
      "v4-tiny", "configs/tiny.yml", ".*", "(", "[a-", "model\\.layers", "/", ".", "..", "a/b"};
  constexpr size_t n = sizeof kValues / sizeof kValues[0];
  if (rng() % 16 == 0) return std::string(1 + rng() % 200, "a1[{"[rng() % 4]);
  return kValues[rng() % n];
}

// The input as a YAML text (lines) and NUL-separated overrides.
struct Parts {
  std::vector<std::string> lines, overrides;
};

inline Parts split(std::string_view in) {
  Parts p;
  const size_t nul = in.find('\0');
  std::string_view text = in.substr(0, nul);
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = text.find('\n', start);
    p.lines.emplace_back(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  if (nul != std::string_view::npos) {
    std::string_view rest = in.substr(nul + 1);
    while (true) {
      const size_t next = rest.find('\0');
      p.overrides.emplace_back(rest.substr(0, next));
      if (next == std::string_view::npos) break;
      rest = rest.substr(next + 1);
    }
  }
  return p;
}

inline std::string join(const Parts& p) {
  std::string out;
  for (size_t i = 0; i < p.lines.size(); ++i) {
    if (i) out += '\n';
    out += p.lines[i];
  }
  for (const auto& o : p.overrides) {
    out += '\0';
    out += o;
  }
  return out;
}

// The key of a `key: value` line or a `key=value` override (empty if none).
inline std::string_view key_of(std::string_view s, char sep) {
  const size_t at = s.find(sep);
  return at == std::string_view::npos ? std::string_view() : s.substr(0, at);
}

inline std::string value_of(std::string_view s, char sep) {
  const size_t at = s.find(sep);
  if (at == std::string_view::npos) return std::string();
  std::string_view v = s.substr(at + 1);
  while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
  return std::string(v);
}

// A value for a new or changed entry: an interesting one, or one copied from
// another line of the input (a value that parsed somewhere).
inline std::string some_value(const Parts& p, std::mt19937& rng) {
  if (!p.lines.empty() && rng() % 3 == 0) {
    const std::string v = value_of(p.lines[rng() % p.lines.size()], ':');
    if (!v.empty()) return v;
  }
  return interesting_value(rng);
}

inline std::string some_key(const Parts& p, std::span<const char* const> keys, std::mt19937& rng) {
  if (!p.lines.empty() && rng() % 4 == 0) {
    const std::string_view k = key_of(p.lines[rng() % p.lines.size()], ':');
    if (!k.empty()) return std::string(k);
  }
  return keys.empty() ? std::string("k") : std::string(keys[rng() % keys.size()]);
}

// Changes one line or override of `p`; false if nothing was done.
inline bool mutate_parts(Parts& p, std::span<const char* const> keys, std::mt19937& rng) {
  auto& L = p.lines;
  auto& O = p.overrides;
  const size_t li = L.empty() ? 0 : rng() % L.size();
  switch (rng() % 10) {
    case 0:
    case 1:  // a new value for a line that has a key
      if (L.empty() || key_of(L[li], ':').empty()) return false;
      L[li] = std::string(key_of(L[li], ':')) + ": " + some_value(p, rng);
      return true;
    case 2:  // another key, same value
      if (L.empty() || key_of(L[li], ':').empty()) return false;
      L[li] = some_key(p, keys, rng) + ": " + value_of(L[li], ':');
      return true;
    case 3:  // a new line
      L.insert(L.begin() + static_cast<std::ptrdiff_t>(L.empty() ? 0 : rng() % (L.size() + 1)),
               some_key(p, keys, rng) + ": " + some_value(p, rng));
      return true;
    case 4:  // drop a line
      if (L.empty()) return false;
      L.erase(L.begin() + static_cast<std::ptrdiff_t>(li));
      return true;
    case 5:  // copy a line (a key given twice), or indent it under the line before
      if (L.empty()) return false;
      L.insert(L.begin() + static_cast<std::ptrdiff_t>(rng() % (L.size() + 1)),
               rng() % 4 == 0 ? "  " + L[li] : L[li]);
      return true;
    case 6:  // a new override, or a line moved to the command line
      if (!L.empty() && !key_of(L[li], ':').empty() && rng() % 2) {
        O.push_back(std::string(key_of(L[li], ':')) + "=" + value_of(L[li], ':'));
        L.erase(L.begin() + static_cast<std::ptrdiff_t>(li));
      } else {
        O.push_back(some_key(p, keys, rng) + "=" + some_value(p, rng));
      }
      return true;
    case 7: {  // a new value for an override
      if (O.empty()) return false;
      std::string& o = O[rng() % O.size()];
      const std::string_view k = key_of(o, '=');
      o = std::string(k.empty() ? std::string_view(o) : k) + "=" + some_value(p, rng);
      return true;
    }
    case 8:  // drop an override
      if (O.empty()) return false;
      O.erase(O.begin() + static_cast<std::ptrdiff_t>(rng() % O.size()));
      return true;
    default:  // a list or map item under a key
      if (L.empty() || key_of(L[li], ':').empty()) return false;
      L[li] = std::string(key_of(L[li], ':')) + ":";
      L.insert(L.begin() + static_cast<std::ptrdiff_t>(li + 1),
               rng() % 2 ? "  - " + some_value(p, rng) : "  " + some_key(p, keys, rng) + ": " + some_value(p, rng));
      return true;
  }
}

// The whole mutator: half line-level mutations (1 to 3 rounds), half
// libFuzzer's own.
inline size_t mutate(uint8_t* data, size_t size, size_t max_size, unsigned seed, std::span<const char* const> keys) {
  std::mt19937 rng(seed);
  if (rng() % 2 == 0) {
    Parts p = split(std::string_view(reinterpret_cast<const char*>(data), size));
    const int rounds = 1 + static_cast<int>(rng() % 3);
    bool changed = false;
    for (int r = 0; r < rounds; ++r) changed |= mutate_parts(p, keys, rng);
    if (changed) {
      const std::string out = join(p);
      if (out.size() <= max_size) {
        std::memcpy(data, out.data(), out.size());
        return out.size();
      }
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

}  // namespace ds_fuzz::yaml
