// Structure-aware mutation for the JSON fuzz targets (LLVMFuzzerCustomMutator).
//
// Byte-level mutation rarely turns a valid multi-kilobyte document into
// another valid one that differs in a single value's type or size, which is
// where JSON readers go wrong (a number where a string was, 2^63 where an id
// was, a key removed, an object inside an array). So half of the mutations
// parse the input with nlohmann::json, change one randomly chosen node and
// write the document back; the other half, and anything that does not parse,
// go to libFuzzer's own mutator (LLVMFuzzerMutate, with -dict).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <string_view>
#include <vector>

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace ds_fuzz {

using json = nlohmann::json;

inline json interesting_value(std::mt19937& rng) {
  switch (rng() % 24) {
    case 0: return nullptr;
    case 1: return true;
    case 2: return false;
    case 3: return 0;
    case 4: return -1;
    case 5: return 1;
    case 6: return 2;
    case 7: return INT32_MAX;
    case 8: return int64_t{INT32_MAX} + 1;
    case 9: return int64_t{1} << 30;
    case 10: return INT64_MAX;
    case 11: return INT64_MIN;
    case 12: return UINT64_MAX;
    case 13: return 1e300;
    case 14: return -0.5;
    case 15: return 64.5;
    case 16: return "";
    case 17: return "x";
    case 18: return json::array();
    case 19: return json::object();
    case 20: return json::array({json::array({0})});
    case 21: return std::string(1 + rng() % 300, 'a');
    case 22: return "\xc3\xa9\xe2\x96\x81";  // é▁
    default: return json::object({{"type", "x"}});
  }
}

inline void collect(json& j, std::vector<json*>& out) {
  out.push_back(&j);
  if (j.is_structured())
    for (auto& child : j) collect(child, out);
}

// A node reached by walking down from the root, one random child at a time,
// stopping at each level with probability 1/3: every key of a small object
// (a "type" beside a "vocab" of thousands) is picked as often as its siblings.
inline json& walk(json& j, std::mt19937& rng) {
  json* n = &j;
  while (n->is_structured() && !n->empty() && rng() % 3 != 0) {
    auto it = n->begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng() % n->size()));
    n = &*it;
  }
  return *n;
}

// Changes one node of `doc`; false if nothing was done.
inline bool mutate_node(json& doc, std::mt19937& rng) {
  std::vector<json*> nodes;
  collect(doc, nodes);
  // Half the time any node alike, half the time by a walk from the root.
  json& n = rng() % 2 ? *nodes[rng() % nodes.size()] : walk(doc, rng);
  switch (rng() % 8) {
    case 0:
    case 1:  // another value, often of another type
      n = interesting_value(rng);
      return true;
    case 2:  // a copy of another node (keys, ids and strings of the same file)
      n = json(*nodes[rng() % nodes.size()]);
      return true;
    case 3:  // drop a member or an element
      if (n.is_object() && !n.empty()) {
        auto it = n.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng() % n.size()));
        n.erase(it);
        return true;
      }
      if (n.is_array() && !n.empty()) {
        n.erase(n.begin() + static_cast<std::ptrdiff_t>(rng() % n.size()));
        return true;
      }
      return false;
    case 4:  // grow a container
      if (n.is_array()) {
        json v = n.empty() || rng() % 2 ? interesting_value(rng) : json(n[rng() % n.size()]);
        n.insert(n.begin() + static_cast<std::ptrdiff_t>(rng() % (n.size() + 1)), std::move(v));
        return true;
      }
      if (n.is_object()) {
        // A key seen elsewhere in the document, or a new one.
        std::string key = "k" + std::to_string(rng() % 8);
        for (int tries = 0; tries < 4; ++tries) {
          const json* other = nodes[rng() % nodes.size()];
          if (other->is_object() && !other->empty()) {
            auto it = other->begin();
            std::advance(it, static_cast<std::ptrdiff_t>(rng() % other->size()));
            key = it.key();
            break;
          }
        }
        n[key] = interesting_value(rng);
        return true;
      }
      return false;
    case 5:  // nudge a number
      if (n.is_number_integer()) {
        const int64_t deltas[] = {-1, 1, -2, 2, 7, 1 << 16, -(1 << 16)};
        // Wrapping add: the harness itself must not overflow.
        n = static_cast<int64_t>(static_cast<uint64_t>(n.get<int64_t>()) + static_cast<uint64_t>(deltas[rng() % 7]));
        return true;
      }
      if (n.is_number_float()) {
        n = n.get<double>() * (rng() % 2 ? -1.0 : 1e10);
        return true;
      }
      return false;
    case 6:  // cut or repeat a string
      if (n.is_string()) {
        std::string s = n.get<std::string>();
        if (!s.empty() && rng() % 2) s.resize(rng() % s.size());
        else s += s;
        n = s;
        return true;
      }
      return false;
    default:  // wrap in an array or an object
      n = rng() % 2 ? json::array({n}) : json::object({{"type", n}});
      return true;
  }
}

// Mutates the JSON text `text` in place; false if it is not JSON.
inline bool mutate_json_text(std::string& text, std::mt19937& rng) {
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return false;
  const int rounds = 1 + static_cast<int>(rng() % 3);
  bool changed = false;
  for (int r = 0; r < rounds; ++r) changed |= mutate_node(doc, rng);
  if (!changed) return false;
  // Strings cut inside a UTF-8 sequence are written with U+FFFD rather than
  // throwing; the byte-level mutator supplies invalid UTF-8 on its own.
  text = doc.dump(rng() % 4 == 0 ? 1 : -1, ' ', false, json::error_handler_t::replace);
  return true;
}

// The whole mutator for inputs made of `prefix` raw bytes, then JSON text,
// then (with split_nul) optionally a NUL byte and a second JSON text.
inline size_t mutate(uint8_t* data, size_t size, size_t max_size, unsigned seed, size_t prefix, bool split_nul) {
  std::mt19937 rng(seed);
  if (size > prefix && rng() % 2 == 0) {
    const std::string_view body(reinterpret_cast<const char*>(data) + prefix, size - prefix);
    const size_t nul = split_nul ? body.find('\0') : std::string_view::npos;
    std::string first(body.substr(0, nul));
    std::string second = nul == std::string_view::npos ? std::string() : std::string(body.substr(nul + 1));
    const bool second_part = nul != std::string_view::npos && rng() % 3 == 0;
    if (mutate_json_text(second_part ? second : first, rng)) {
      std::string out(reinterpret_cast<const char*>(data), prefix);
      out += first;
      if (nul != std::string_view::npos) {
        out += '\0';
        out += second;
      }
      if (out.size() <= max_size) {
        std::memcpy(data, out.data(), out.size());
        return out.size();
      }
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

}  // namespace ds_fuzz
