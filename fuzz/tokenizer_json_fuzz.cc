// libFuzzer target for the tokenizer.json loader. The input is split at its
// first NUL byte: the part before is the tokenizer.json text, the part after
// (if any) the tokenizer_config.json text, so both are fuzzed. Loading must
// either succeed or raise ds::Error; a loaded tokenizer must then encode a
// fixed string and decode ids without anything but ds::Error. A crash, a
// sanitizer report or another exception type is a finding. Built by
// fuzz/CMakeLists.txt (cmake -DDEEPSEEK_FUZZ=ON with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/tokenizer_json_fuzz -max_len=16384 fuzz/corpus/tokenizer_json
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "io/tokenizer.h"
#include "json_mutator.h"

namespace {

// ASCII, a special token, digits, whitespace runs and multi-byte UTF-8.
constexpr std::string_view kText =
    "Hello, world! <｜begin▁of▁sentence｜>x 12345  \n\tcafé 你好 <sep>x's";

void exercise(const ds::io::Tokenizer& tok) {
  for (bool special : {false, true}) {
    try {
      const std::vector<int32_t> ids = tok.encode(kText, special);
      tok.decode(ids);
      tok.decode(ids, true);
    } catch (const ds::Error&) {
    }
  }
  try {
    tok.pre_tokenize(kText);
  } catch (const ds::Error&) {
  }
  const int32_t n = std::min<int32_t>(tok.vocab_size(), 64);
  std::vector<int32_t> all;
  for (int32_t id = 0; id < n; ++id) {
    try {
      const int32_t one[1] = {id};
      tok.decode(one);
      const auto& text = tok.id_to_token(id);
      tok.token_to_id(text);
      all.push_back(id);
    } catch (const ds::Error&) {
    }
  }
  try {
    tok.decode(all);
    tok.decode(all, true);
  } catch (const ds::Error&) {
  }
  tok.bos_id();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  const void* nul = size > 0 ? std::memchr(p, 0, size) : nullptr;
  const size_t split = nul ? static_cast<size_t>(static_cast<const char*>(nul) - p) : size;
  const std::string_view tokenizer_json(p, split);
  const std::string_view config_json = nul ? std::string_view(p + split + 1, size - split - 1) : std::string_view();
  try {
    const ds::io::Tokenizer tok = ds::io::Tokenizer::from_json(tokenizer_json, config_json, "fuzz");
    exercise(tok);
  } catch (const ds::Error&) {
  }
  return 0;
}

// JSON-aware node mutations of either part (fuzz/json_mutator.h), or libFuzzer's own.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::mutate(data, size, max_size, seed, /*prefix=*/0, /*split_nul=*/true);
}
