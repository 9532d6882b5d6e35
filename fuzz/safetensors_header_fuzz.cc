// libFuzzer target for the safetensors header parser. Any input must either
// parse or raise ds::Error. Build with clang:
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address -Isrc fuzz/safetensors_header_fuzz.cc \
//     src/io/safetensors.cc src/io/atomic_file.cc src/core/*.cc -lfmt -fopenmp -o safetensors_fuzz
//   ./safetensors_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/safetensors.h"

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
