#include "io/token_lists.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace ds::io {

std::vector<std::vector<int32_t>> parse_token_lists(std::string_view json_text, int64_t vocab_limit,
                                                    const std::string& origin) {
  using json = nlohmann::json;
  json j;
  try {
    j = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    DS_FAIL("'{}' is not valid JSON: {}", origin, e.what());
  }
  DS_CHECK(j.is_array() && !j.empty(), "'{}' must be a non-empty JSON array of token-id arrays", origin);
  DS_CHECK(static_cast<int64_t>(j.size()) <= kMaxTokenSequences, "'{}' holds {} sequences; at most {} are accepted",
           origin, j.size(), kMaxTokenSequences);
  std::vector<std::vector<int32_t>> out;
  out.reserve(j.size());
  for (size_t s = 0; s < j.size(); ++s) {
    const json& seq = j[s];
    DS_CHECK(seq.is_array() && !seq.empty(), "'{}': sequence {} must be a non-empty array of token ids", origin, s);
    DS_CHECK(static_cast<int64_t>(seq.size()) <= kMaxTokensPerSequence,
             "'{}': sequence {} holds {} tokens; at most {} are accepted", origin, s, seq.size(),
             kMaxTokensPerSequence);
    std::vector<int32_t> ids;
    ids.reserve(seq.size());
    for (const json& t : seq) {
      // Unsigned values above INT64_MAX would wrap in get<int64_t>().
      const bool ok = t.is_number_integer() &&
                      (t.is_number_unsigned() ? t.get<uint64_t>() < static_cast<uint64_t>(vocab_limit)
                                              : t.get<int64_t>() >= 0 && t.get<int64_t>() < vocab_limit);
      DS_CHECK(ok, "'{}': sequence {} holds {}, which is not a token id in [0, {})", origin, s, t.dump(), vocab_limit);
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    out.push_back(std::move(ids));
  }
  return out;
}

}  // namespace ds::io
