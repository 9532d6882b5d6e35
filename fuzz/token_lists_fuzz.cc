// libFuzzer target for the token-id list reader the CLI uses (a JSON array of
// non-empty arrays of ids). Any input must either parse into ids inside
// [0, vocab_limit) or raise ds::Error; a crash, a sanitizer report, another
// exception type or an id outside the range is a finding. Built by
// fuzz/CMakeLists.txt (cmake -DDEEPSEEK_FUZZ=ON with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/token_lists_fuzz -max_len=4096 fuzz/corpus/token_lists
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/error.h"
#include "io/token_lists.h"
#include "json_mutator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t kVocab = 1000;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto lists = ds::io::parse_token_lists(text, kVocab, "fuzz");
    if (lists.empty()) std::abort();  // the contract: a non-empty array
    for (const auto& seq : lists) {
      if (seq.empty()) std::abort();
      for (int32_t id : seq)
        if (id < 0 || id >= kVocab) std::abort();
    }
  } catch (const ds::Error&) {
  }
  return 0;
}

// Half JSON-aware node mutations (fuzz/json_mutator.h), half libFuzzer's own.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::mutate(data, size, max_size, seed, /*prefix=*/0, /*split_nul=*/false);
}
