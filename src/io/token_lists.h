// Token-id lists as the CLI reads them: a JSON array of non-empty arrays of
// token ids, e.g. [[0, 15, 7], [3]]. Every id must be an integer in
// [0, vocab_limit); anything else is a ds::Error naming where it is.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ds::io {

// Upper bounds on what one input may ask for, so a crafted file cannot make
// the engine allocate without limit before the model sees it.
inline constexpr int64_t kMaxTokenSequences = int64_t{1} << 16;
inline constexpr int64_t kMaxTokensPerSequence = int64_t{1} << 24;

// `origin` names the input in error messages; `vocab_limit` is the number of
// ids the model accepts (ids at or above it are errors).
std::vector<std::vector<int32_t>> parse_token_lists(std::string_view json_text, int64_t vocab_limit,
                                                    const std::string& origin);

}  // namespace ds::io
