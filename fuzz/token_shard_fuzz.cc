// libFuzzer target for the token shard reader (ds::io::TokenShard::open), the
// train-NNNNN.tok / eval-NNNNN.tok files that `deepseek prepare` writes and
// the `tokens` dataset maps. The input is the whole shard file (written to an
// in-memory file, fuzz/memfile.h); it is opened once without and once with a
// vocabulary limit. Each open must either give a shard whose header, size,
// offsets and documents agree (and, with the limit, whose ids all lie below
// it) or raise ds::Error; a crash, a sanitizer report, another exception
// type, a span outside the mapped file or a limit check that disagrees with
// the ids is a finding. Built by fuzz/CMakeLists.txt (cmake -DDEEPSEEK_FUZZ=ON
// with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/token_shard_fuzz -max_len=4096 -dict=fuzz/token_shard.dict fuzz/corpus/token_shard
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "core/error.h"
#include "io/token_shards.h"
#include "memfile.h"

namespace {

constexpr int64_t kVocab = 1000;

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "token_shard_fuzz: an opened shard breaks: %s\n", what);
  std::abort();
}

// Everything TokenShard::open promises about a shard of `size` bytes; the
// largest id.
uint32_t check(const ds::io::TokenShard& s, size_t size) {
  const uint64_t D = s.num_documents(), T = s.num_tokens();
  if (size < ds::io::kTokenShardHeaderBytes) broken("shorter than the header");
  const auto offsets = s.offsets();
  const auto tokens = s.tokens();
  if (offsets.size() != D + 1 || tokens.size() != T) broken("span sizes");
  // The file is mapped, so ASan does not see reads past its end: check that
  // the spans lie inside the mapping, which starts 32 bytes before the offsets.
  const auto* base = reinterpret_cast<const unsigned char*>(offsets.data()) - ds::io::kTokenShardHeaderBytes;
  const auto* tok = reinterpret_cast<const unsigned char*>(tokens.data());
  if (tok != base + ds::io::kTokenShardHeaderBytes + 8 * (D + 1)) broken("token array placement");
  if (tok + 4 * T != base + size) broken("the token array does not end at the end of the file");
  if (offsets[0] != 0 || offsets[D] != T) broken("first or last offset");
  uint64_t total = 0;
  for (uint64_t i = 0; i < D; ++i) {
    if (offsets[i + 1] < offsets[i] || offsets[i + 1] > T) broken("offsets out of order");
    const auto doc = s.document(i);
    if (doc.size() != offsets[i + 1] - offsets[i]) broken("document size");
    if (doc.size() > 0 && (doc.data() < tokens.data() || doc.data() + doc.size() > tokens.data() + T))
      broken("document outside the token array");
    total += doc.size();
  }
  if (total != T) broken("documents do not add up to the tokens");
  try {
    (void)s.document(D);
    broken("document(num_documents()) did not throw");
  } catch (const ds::Error&) {
  }
  uint32_t top = 0;
  for (uint32_t t : tokens) top = t > top ? t : top;
  return top;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ds_fuzz::MemFile file;
  const std::string& path = file.write(data, size);
  std::optional<uint32_t> top;
  try {
    const auto s = ds::io::TokenShard::open(path);
    top = check(s, size);
  } catch (const ds::Error&) {
  }
  try {
    const auto s = ds::io::TokenShard::open(path, kVocab);
    const uint32_t limited_top = check(s, size);
    if (limited_top >= kVocab && s.num_tokens() > 0) broken("an id at or above vocab_limit was accepted");
    if (!top) broken("opened with a vocabulary limit but not without one");
  } catch (const ds::Error&) {
    // Refused with the limit: only an id at or above it may be the reason
    // when the shard opened without one.
    if (top && *top < kVocab) broken("refused with a vocabulary limit that every id is below");
  }
  return 0;
}
