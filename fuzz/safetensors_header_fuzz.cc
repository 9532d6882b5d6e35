// libFuzzer target for the safetensors header parser. Any input must either
// parse or raise ds::Error. Built by fuzz/CMakeLists.txt (cmake
// -DDEEPSEEK_FUZZ=ON with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/safetensors_header_fuzz -max_len=16384 fuzz/corpus/safetensors_header
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/safetensors.h"
#include "json_mutator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The first 8 bytes choose the data-block size, the rest is the header text.
  if (size < 8) return 0;
  uint64_t data_size = 0;
  for (int i = 7; i >= 0; --i) data_size = (data_size << 8) | data[i];
  try {
    ds::io::SafetensorsFile::parse_header(reinterpret_cast<const char*>(data) + 8, size - 8, data_size, nullptr);
  } catch (const ds::Error&) {
  }
  return 0;
}

// JSON-aware node mutations of the header after the 8 size bytes
// (fuzz/json_mutator.h), or libFuzzer's own on the whole input.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::mutate(data, size, max_size, seed, /*prefix=*/8, /*split_nul=*/false);
}
