// libFuzzer target for the meta.json of a token directory written by
// `deepseek prepare` (ds::io::TokenCorpusMeta), read as TokenCorpusMeta::read
// does: JSON text (a syntax error is refused there as ds::Error), then
// from_json. Any input must either give metadata whose version, vocab_size,
// bos/eos ids, shard names and per-split totals agree, and that reads back
// the same from its own to_json(), or raise ds::Error; a crash, a sanitizer
// report, another exception type (an nlohmann type_error, say) or metadata
// that breaks those rules is a finding. Built by fuzz/CMakeLists.txt (cmake
// -DDEEPSEEK_FUZZ=ON with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/token_meta_fuzz -max_len=4096 -dict=fuzz/json.dict fuzz/corpus/token_meta
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/error.h"
#include "io/token_shards.h"
#include "json_mutator.h"

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "token_meta_fuzz: accepted metadata breaks: %s\n", what);
  std::abort();
}

void check_split(const ds::io::TokenSplitInfo& s, const char* name) {
  uint64_t docs = 0, tokens = 0;
  for (size_t i = 0; i < s.shards.size(); ++i) {
    if (s.shards[i].file != ds::io::token_shard_name(name, static_cast<int64_t>(i))) broken("shard file name");
    docs += s.shards[i].documents;
    tokens += s.shards[i].tokens;
  }
  if (docs != s.documents || tokens != s.tokens) broken("split totals");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;  // TokenCorpusMeta::read turns this into a ds::Error
  }
  std::optional<ds::io::TokenCorpusMeta> parsed;
  try {
    parsed = ds::io::TokenCorpusMeta::from_json(j, "fuzz/meta.json");
  } catch (const ds::Error&) {
    return 0;
  }
  const ds::io::TokenCorpusMeta& m = *parsed;
  if (m.version != ds::io::kTokenCorpusVersion) broken("version");
  if (m.vocab_size < 1 || m.vocab_size > (int64_t{1} << 31)) broken("vocab_size");
  for (const auto& id : {m.bos_id, m.eos_id})
    if (id && (*id < 0 || *id >= m.vocab_size)) broken("bos_id or eos_id");
  check_split(m.train, "train");
  check_split(m.eval, "eval");
  if (&m.split("train") != &m.train || &m.split("eval") != &m.eval) broken("split()");
  // What prepare would write for it must read back the same.
  const nlohmann::json out = m.to_json();
  try {
    const auto again = ds::io::TokenCorpusMeta::from_json(nlohmann::json::parse(out.dump()), "fuzz/meta.json");
    if (again.to_json() != out) broken("to_json and from_json disagree");
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    broken("its own to_json() is refused");
  }
  return 0;
}

// Half JSON-aware node mutations (fuzz/json_mutator.h), half libFuzzer's own.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::mutate(data, size, max_size, seed, /*prefix=*/0, /*split_nul=*/false);
}
